"""The losslessness audit's table for vLLM: plain decoding drawn once, then each speculative method against it
(speculative/audit.py; one LLM at a time). Run in a venv with vLLM (scripts/setup.sh --vllm):

    python benchmarks/vllm_audit.py --methods ngram suffix tailrl [--model smollm2-135m] [--dtype float32]
    python benchmarks/vllm_audit.py --tiny --methods ngram tailrl --n 32 --max-tokens 16   # the tiny peaked Llama

Each method's audit has a false-alarm rate <= alpha for a lossless engine; the methods share the plain arm's draws.
Every emitted token of every arm (the plain one as the control) is scored by our model in fp32 (engine/score.py)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", nargs="+", default=["ngram", "suffix", "tailrl"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="the tiny peaked Llama of tailrl/model/tiny.py and its prompts")
    args = ap.parse_args()

    import torch

    from tailrl.cli_audit import audit_prompts
    from tailrl.engine.requests import encode
    from tailrl.engine.score import model_scorer
    from tailrl.model import load_model
    from tailrl.rollout.vllm.audit import cache_path, llm_sampler, model_context, spec_dict
    from tailrl.rollout.vllm.llm import hf_folder, make_llm, vllm_version
    from tailrl.speculative.audit import AuditConfig, context_needed, draw, judge, score_arm, tol_for

    if args.tiny:
        from tailrl.model.tiny import VLLM_PROMPTS as PROMPTS, make_tiny_vllm_model as make_folder

        folder, prompts, name = make_folder(tempfile.mkdtemp(prefix="tiny_vllm_")), PROMPTS[:4], "tiny Llama"
    else:
        from transformers import AutoTokenizer

        folder, name = hf_folder(args.model), args.model
        tok = AutoTokenizer.from_pretrained(folder)
        prompts = audit_prompts(lambda m: encode(tok, m), 4, args.seed)
    cfg = AuditConfig(n=args.n, max_tokens=args.max_tokens, seed=args.seed, logprob_tol=tol_for(args.dtype))
    max_len = context_needed(prompts, args.max_tokens, model_context(folder))
    # fp32 on the GPU where there is one (on an H100's 16 CPU cores, 14,000 tokens took 49 s to score)
    scorer = model_scorer(load_model(folder, device="cuda" if torch.cuda.is_available() else "cpu",
                                     dtype=torch.float32)[0])
    off = None
    print(f"{vllm_version()}, {name} {args.dtype}, {len(prompts)} prompts x {args.n} x T {cfg.temperatures}, "
          f"max_tokens {args.max_tokens}, k {args.k}, alpha {cfg.alpha}; tokens scored by our model in fp32",
          flush=True)
    # ngram last: an LLM built in this process after an ngram one fails at startup on vllm-cpu 0.32 (its numba
    # wrappers break the CPU platform's kernel rebinding: "'_lib_fn_wrapper' object has no attribute 'get'")
    for method in ["off"] + sorted(args.methods, key=lambda m: m == "ngram"):
        spec = spec_dict(method, args.k)
        t0 = time.perf_counter()
        try:
            llm = make_llm(folder, args.dtype, args.seed + (method != "off"), max_len, spec)
        except Exception as e:  # a method this build lacks (suffix needs arctic-inference): say so, go on
            print(f"{method}: could not start ({type(e).__name__}: {str(e)[:200]})", flush=True)
            continue
        start = time.perf_counter() - t0
        t0 = time.perf_counter()
        draws = draw(llm_sampler(llm, method == "tailrl"), prompts, cfg, int(method != "off"))
        sample_s = time.perf_counter() - t0
        tokens = sum(len(r) for per_t in draws for per_p in per_t for r in per_p)
        print(f"{method}: startup {start:.0f} s, {tokens} tokens in {sample_s:.0f} s = {tokens / sample_s:.1f} tok/s",
              flush=True)
        del llm
        gc.collect()
        t0 = time.perf_counter()
        checks = score_arm(draws, prompts, cfg, scorer)
        print(f"{method}: scored in {time.perf_counter() - t0:.0f} s", flush=True)
        if method == "off":  # the control: plain decoding against itself has nothing to compare, only tokens to score
            off = draws
            control = judge(off, off, cfg, "vLLM off (control)", checks)
            print("\n".join(control.table().splitlines()[2:]), flush=True)
            continue
        res = judge(off, draws, cfg, f"vLLM {method}", checks)
        print(res.table(), flush=True)
        print(f"{'PASS' if res.passed else 'FAIL'} (threshold {res.threshold:.2g}): {res.figures()}", flush=True)
        gate = AuditConfig(max_tokens=args.max_tokens, positions=min(4, args.max_tokens), seed=args.seed,
                           logprob_tol=tol_for(args.dtype))
        if cfg == gate and not args.tiny:  # the gate's own settings: a run on this device reuses the verdict
            path = cache_path(method, args.k, args.dtype, args.max_tokens)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(res.to_dict()))


if __name__ == "__main__":
    main()
