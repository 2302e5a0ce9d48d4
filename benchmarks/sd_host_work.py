"""What SD auto's host work costs a decode step, piece by piece, in wall seconds (not a profiler's, which inflates
Python several times): the selector's choice (`Selector.choose`), the rest of `Speculator.plan` (proposals on
speculative steps), the feedback (`Speculator.observe`: the step-time and acceptance records, drafters' indexes,
shadow drafts) and, for scale, the sampler (`decide`: warping, keyed Gumbel-max), which SD off pays too.

    .venv/bin/python benchmarks/sd_host_work.py [--epochs 2] [--prompts 4] [--n 8] [--max-tokens 96] [--dtype bfloat16]

The default run's shape (4 prompts x 8, 96 tokens, T 0.7) on the batch-invariant engine; epoch 0 is every prompt's
first visit, where SD auto decodes plainly in most steps and what it adds to a plain step is what it loses. Run it
on a quiet machine."""

from __future__ import annotations

import argparse
import collections
import functools
import time

import torch

import tailrl.engine.passes as passes
import tailrl.speculative.speculator as speculator
from tailrl.config import load_config
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import load_model
from tailrl.rl.data import load_datasets
from tailrl.speculative.config import SpecConfig
from tailrl.speculative.selector import Selector
from tailrl.tasks import chat_prompt

SECONDS: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def timed(owner, name: str, label: str) -> None:
    """Wraps owner.name to add its wall seconds to SECONDS[label]."""
    f = getattr(owner, name)

    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            SECONDS[label] += time.perf_counter() - t
            CALLS[label] += 1

    setattr(owner, name, g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(2)
    timed(speculator.Speculator, "plan", "plan")
    timed(Selector, "choose", "choose")
    timed(speculator.Speculator, "observe", "observe")
    timed(speculator, "shadow_step", "shadows")
    timed(passes, "decide", "decide")
    cfg = load_config(None, [], "")
    train, _ = load_datasets(cfg.data)
    prompts = [chat_prompt(e.prompt, cfg.data.system_prompt) for e in train[:args.prompts]]
    warm = [chat_prompt(e.prompt, cfg.data.system_prompt) for e in train[-args.prompts:]]
    model, tok = load_model(cfg.model.path, device="cpu", dtype=args.dtype)
    print(f"{args.prompts} prompts x {args.n}, up to {args.max_tokens} tokens, T 0.7, {model.dtype}; ms per decode step\n")
    print("| arm | epoch | decode steps | ms a step | choose | plan (all) | observe | of it shadows | decide |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in ("off", "auto"):
        eng = Engine(model, tok, EngineConfig(kv_cache_gb=2.0, batch_invariant=True, spec=SpecConfig(mode=mode)))
        eng.generate(warm, SamplingParams(temperature=0.7, max_tokens=args.max_tokens, n=args.n, seed=7))
        for ep in range(args.epochs):
            SECONDS.clear()
            CALLS.clear()
            outs = eng.generate(prompts, SamplingParams(temperature=0.7, max_tokens=args.max_tokens, n=args.n,
                                                        seed=1000 + ep))
            steps = outs.stats.decode_steps
            step_ms = outs.stats.decode_s / max(steps, 1) * 1e3
            ms = {k: SECONDS[k] / max(steps, 1) * 1e3 for k in ("choose", "plan", "observe", "shadows", "decide")}
            print(f"| {mode} | {ep} | {steps} | {step_ms:.1f} | {ms['choose']:.2f} | {ms['plan']:.2f} | "
                  f"{ms['observe']:.2f} | {ms['shadows']:.2f} | {ms['decide']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
