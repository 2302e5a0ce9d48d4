"""SD auto against SD off on an RL-shaped rollout without the update: epochs of the same prompts (epoch 0 is every
prompt's first visit, later ones have history), both engines in one process on one model, interleaved per epoch,
the batch-invariant engine (the same tokens in both arms, checked). Per epoch: tokens / s of each arm, the selector's
SD-off estimate (`spec/speedup_est`) beside the measured ratio, its predicted and measured decode tokens / s and the
share of steps each arm ran.

    .venv/bin/python benchmarks/sd_epochs.py [--preset long] [--epochs 3] [--max-tokens 96] [--prompts 8] [--n 8]
        [--arms off,auto,self,auto+self] [--sets 1]

--sets S: the epochs again on S disjoint prompt sets (prompts S*P.. of the task), the arms' order rotated by set and
epoch, and a last table of each epoch's seconds summed over the sets (on a machine whose speed drifts by 10-20% over
minutes, a single rollout of 8 s does not resolve 5%). Before timing, each engine generates once on other prompts
(the task's last ones): the first pass in a process touches the KV cache's memory for the first time.

Prompts: the first `--prompts` training prompts of the preset's task (default: the default run's arithmetic levels
1-2), chat template, T 0.7. Run each measurement on a quiet machine (a second process on 2 cores makes OpenMP's
barriers wait, and both arms slow down by different amounts)."""

from __future__ import annotations

import argparse
import time

import torch

from tailrl.config import load_config
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import load_model
from tailrl.rl.data import load_datasets
from tailrl.speculative.config import SpecConfig
from tailrl.tasks import chat_prompt


def spec_of(arm: str) -> SpecConfig:
    """An arm: a spec mode (off, auto, history, ngram, self), or auto+self (auto with the self drafter offered)."""
    if arm == "auto+self":
        return SpecConfig(mode="auto", self_draft=True)
    return SpecConfig(mode=arm)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sets", type=int, default=1)
    ap.add_argument("--arms", default="off,auto", help="comma list, off first: off, auto, history, ngram, self, "
                    "auto+self (auto with rollout.spec.self_draft)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = load_config(None, [], args.preset)
    train, _ = load_datasets(cfg.data)
    sets = [[chat_prompt(e.prompt, cfg.data.system_prompt) for e in train[i * args.prompts:(i + 1) * args.prompts]]
            for i in range(args.sets)]
    if not sets[-1] or len(train) < (args.sets + 1) * args.prompts:
        raise SystemExit(f"--sets {args.sets} x --prompts {args.prompts} (and a warm-up set) need more than the "
                         f"task's {len(train)} training prompts")
    warm = [chat_prompt(e.prompt, cfg.data.system_prompt) for e in train[-args.prompts:]]
    model, tok = load_model(cfg.model.path, device="cpu", dtype=args.dtype)
    arms = args.arms.split(",")
    if arms[0] != "off":
        raise SystemExit("--arms: off comes first (every other arm is compared with it)")
    engines = {m: Engine(model, tok, EngineConfig(kv_cache_gb=2.0, batch_invariant=True, spec=spec_of(m)))
               for m in arms}
    for eng in engines.values():
        eng.generate(warm, SamplingParams(temperature=0.7, max_tokens=args.max_tokens, n=args.n, seed=7))
    print(f"{args.prompts} prompts x {args.n}, up to {args.max_tokens} tokens, T 0.7, {model.dtype}, {args.sets} set(s)\n")
    print("| set | epoch | arm | tok/s | / off | estimate | predicted / measured decode tok/s | accept length | arms |")
    print("|---|---|---|---|---|---|---|---|---|")
    total = {(ep, m): [0.0, 0] for ep in range(args.epochs) for m in arms}  # seconds, tokens
    for si, ep in ((si, ep) for si in range(args.sets) for ep in range(args.epochs)):
        res = {}
        k = (si + ep) % len(arms)
        for m in arms[k:] + arms[:k]:
            params = SamplingParams(temperature=0.7, max_tokens=args.max_tokens, n=args.n, seed=1000 + 10 * si + ep)
            t = time.perf_counter()
            outs = engines[m].generate(sets[si], params)
            secs, toks = time.perf_counter() - t, sum(len(o.token_ids) for o in outs)
            res[m] = (outs, toks / secs)
            total[ep, m][0] += secs
            total[ep, m][1] += toks
        off, off_tps = res["off"]
        print(f"| {si} | {ep} | off | {off_tps:.0f} | 1.00x | | | | |", flush=True)
        for m in arms[1:]:
            outs, tps = res[m]
            same = [o.token_ids for o in off] == [o.token_ids for o in outs]
            met = outs.stats.metrics()
            shares = ", ".join(f"{k.split('/')[-1]} {v:.0%}" for k, v in sorted(met.items(), key=lambda kv: -kv[1])
                               if k.startswith("spec/arm_share/") and v >= 0.02)
            acc = ", ".join(f"{k.split('/')[-1]} {v:.2f}" for k, v in sorted(met.items())
                            if k.startswith("spec/accept_length/") and v > 0)
            print(f"| {si} | {ep} | {m} | {tps:.0f} | {tps / off_tps:.2f}x{'' if same else ' (tokens differ!)'} "
                  f"| {outs.stats.speedup_est:.2f}x | {met.get('spec/pred_tokens_per_s', 0):.0f} / "
                  f"{met.get('spec/decode_tokens_per_s', 0):.0f} | {acc} | {shares} |", flush=True)
    if args.sets > 1:
        print("\n| epoch | " + " | ".join(f"{m} tok/s" for m in arms) + " | " + " | ".join(f"{m} / off" for m in arms[1:]) + " |")
        print("|---|" + "---|" * (2 * len(arms) - 1))
        for ep in range(args.epochs):
            rate = {m: total[ep, m][1] / total[ep, m][0] for m in arms}
            print(f"| {ep} | " + " | ".join(f"{rate[m]:.0f}" for m in arms) + " | "
                  + " | ".join(f"{rate[m] / rate['off']:.3f}x" for m in arms[1:]) + " |")


if __name__ == "__main__":
    main()
