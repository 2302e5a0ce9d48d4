"""The base policy's pass@1 (greedy) and pass@k (sampled) per task and level, with the strict verifier and with
the shaped reward: GRPO learns where the policy sometimes succeeds, so the default run is chosen from this.

    .venv/bin/python benchmarks/base_policy.py [--per-level 32] [--k 8] [--temperature 1.0] [--max-tokens 128]
        [--system "..."] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import load_model
from tailrl.rl.data import chat_prompt
from tailrl.rl.rewards.builtin import BUILTIN
from tailrl.rl.tasks import make_rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="arithmetic")
    ap.add_argument("--per-level", type=int, default=32)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--system", default="")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m", device="cpu", dtype=getattr(torch, args.dtype))
    by_level = defaultdict(list)
    for r in make_rows(args.task, 40 * args.per_level, seed=12345):
        if len(by_level[r["level"]]) < args.per_level:
            by_level[r["level"]].append(r)
    strict = BUILTIN["countdown" if args.task == "countdown" else "math"]
    shaped = BUILTIN["countdown" if args.task == "countdown" else "math_partial"]
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=2.0, max_model_len=512))
    print(f"\nSmolLM2-135M {args.dtype}, task {args.task}, {args.per_level} prompts per level, max {args.max_tokens} "
          f"tokens, pass@{args.k} at T={args.temperature}, system prompt {args.system!r}\n")
    print(f"| level | greedy acc | greedy shaped | sampled acc (mean) | pass@{args.k} | shaped mean | mean len |")
    print("|---|---|---|---|---|---|---|")
    for level in sorted(by_level):
        rows = by_level[level]
        prompts = [chat_prompt(r["prompt"], args.system) for r in rows]
        g = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
        s = eng.generate(prompts, SamplingParams(n=args.k, temperature=args.temperature, max_tokens=args.max_tokens, seed=0))
        cols = lambda r: {k: v for k, v in r.items() if k != "prompt"}  # noqa: E731
        g_acc = [strict(c.text, **cols(rows[c.prompt_index])) for c in g]
        g_sh = [shaped(c.text, **cols(rows[c.prompt_index])) for c in g]
        s_acc = [strict(c.text, **cols(rows[c.prompt_index])) for c in s]
        s_sh = [shaped(c.text, **cols(rows[c.prompt_index])) for c in s]
        passk = sum(any(s_acc[i * args.k : (i + 1) * args.k]) for i in range(len(rows))) / len(rows)
        mlen = sum(len(c.token_ids) for c in s) / len(s)
        print(f"| {level} | {sum(g_acc) / len(g_acc):.2f} | {sum(g_sh) / len(g_sh):.2f} | {sum(s_acc) / len(s_acc):.3f} "
              f"| {passk:.2f} | {sum(s_sh) / len(s_sh):.3f} | {mlen:.0f} |", flush=True)
    print("\nexample greedy completion:", repr(g[0].text[:300]))


if __name__ == "__main__":
    main()
