"""How the base policy answers the built-in arithmetic task under a few sampling temperatures, instructions and system
prompts: how often a sample writes the answer line (`####`), strict accuracy, pass@k and greedy accuracy. This chose
the default run's temperature (0.7) and system prompt (an example of the answer line).

    .venv/bin/python benchmarks/instructions.py [--prompts 16] [--k 8] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import time

import torch

from tailrl.config import SYSTEM_PROMPT
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import load_model
from tailrl.rl import tasks
from tailrl.rl.data import chat_prompt
from tailrl.rl.rewards.builtin import BUILTIN

EXAMPLE_SYSTEM = SYSTEM_PROMPT  # the default run's data.system_prompt
VARIANTS = [  # (temperature, system prompt)
    (1.0, ""), (0.7, ""), (0.5, ""), (0.7, EXAMPLE_SYSTEM), (0.5, EXAMPLE_SYSTEM),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m", device="cpu", dtype="auto")
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=2.0, max_model_len=512))
    rows = tasks.make_rows("arithmetic", args.prompts, seed=777)  # not the default run's train or eval prompts
    strict, shaped = BUILTIN["math"], BUILTIN["math_partial"]
    print(f"\nSmolLM2-135M ({model.dtype}), {args.prompts} arithmetic prompts (levels 1-4), {args.k} samples each, "
          f"max {args.max_tokens} tokens; instruction {tasks.INSTRUCTION!r}\n")
    print(f"| T | system prompt | samples with #### | strict acc | math_partial | pass@{args.k} | greedy acc | "
          "greedy with #### | mean len | s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for temp, system in VARIANTS:
        t = time.perf_counter()
        prompts = [chat_prompt(r["prompt"], system) for r in rows]
        s = eng.generate(prompts, SamplingParams(n=args.k, temperature=temp, max_tokens=args.max_tokens, seed=0))
        g = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens))
        acc = [strict(c.text, rows[c.prompt_index]["answer"]) for c in s]
        part = [shaped(c.text, rows[c.prompt_index]["answer"]) for c in s]
        gacc = [strict(c.text, rows[c.prompt_index]["answer"]) for c in g]
        passk = sum(any(acc[i * args.k:(i + 1) * args.k]) for i in range(len(rows))) / len(rows)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        print(f"| {temp} | {'example' if system else 'none'} | {mean(['####' in c.text for c in s]):.2f} | "
              f"{mean(acc):.3f} | {mean(part):.3f} | {passk:.2f} | {mean(gacc):.2f} | "
              f"{mean(['####' in c.text for c in g]):.2f} | {mean([len(c.token_ids) for c in s]):.0f} | "
              f"{time.perf_counter() - t:.0f} |", flush=True)
    print(f"\nsystem prompt 'example': {EXAMPLE_SYSTEM!r}")


if __name__ == "__main__":
    main()
