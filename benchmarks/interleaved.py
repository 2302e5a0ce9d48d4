"""The default run with SD off and SD auto in one process, their steps interleaved: the fair whole-run comparison.

With batch-invariant decoding (engine/invariant.py) the two arms of a seed train on the very same rollouts, so
they do the same work step for step, and any difference in time is speculation's. `benchmarks/e2e.py` runs each
arm as its own process, one after the other, and this shared machine drifts by 10-50% between them (the same
update, on the same data, took up to 1.57x as long in one arm); here each step runs in both arms back to back,
in alternating order. No evaluation and no checkpoints: the training steps only.

    .venv/bin/python benchmarks/interleaved.py [--seeds 0 1] [--steps 16] [--extra k=v ...]
"""

from __future__ import annotations

import argparse
import logging

from tailrl.config import load_config
from tailrl.rl.trainer import Trainer

ARMS = ("off", "auto")
KEYS = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/update", "timing_s/step")


def run_seed(seed: int, steps: int, extra: list[str]) -> list[dict]:
    trainers = {m: Trainer(load_config(None, [f"trainer.seed={seed}", f"rollout.spec.mode={m}", "trainer.eval_every=0",
                                               f"trainer.out_dir=/tmp/tailrl-interleaved-{m}", *extra]))
                for m in ARMS}
    rows = []
    try:
        for step in range(steps):
            out = {}
            for m in (ARMS if step % 2 == 0 else ARMS[::-1]):
                out[m] = trainers[m].train_step()
            rows.append(out)
            a, b = out["auto"], out["off"]
            print(f"  step {step + 1}: gen off {b['timing_s/gen']:.1f} s, auto {a['timing_s/gen']:.1f} s "
                  f"(accept {a['spec/accept_length']:.2f}); same rollouts: "
                  f"{a['response_lengths'] == b['response_lengths'] and a['reward/mean'] == b['reward/mean']}",
                  flush=True)
    finally:
        for t in trainers.values():
            t.close()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--extra", nargs="*", default=[])
    args = ap.parse_args()
    logging.getLogger("tailrl").setLevel(logging.ERROR)
    total = {m: {k: 0.0 for k in KEYS} for m in ARMS}
    tokens, same = 0, 0
    print("| seed | step | tokens | gen s off | gen s auto | gen off / auto | step off / auto | accept len | same rollout |")
    print("|---|---|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        for i, out in enumerate(run_seed(seed, args.steps, args.extra)):
            a, b = out["auto"], out["off"]
            for m in ARMS:
                for k in KEYS:
                    total[m][k] += out[m][k]
            n = sum(b["response_lengths"])
            tokens += n
            ok = a["response_lengths"] == b["response_lengths"] and a["reward/mean"] == b["reward/mean"]
            same += ok
            print(f"| {seed} | {i + 1} | {n} | {b['timing_s/gen']:.1f} | {a['timing_s/gen']:.1f} | "
                  f"{b['timing_s/gen'] / a['timing_s/gen']:.2f}x | {b['timing_s/step'] / a['timing_s/step']:.2f}x | "
                  f"{a['spec/accept_length']:.2f} | {'yes' if ok else 'NO'} |", flush=True)
    steps = len(args.seeds) * args.steps
    print(f"\n{steps} steps per arm, {tokens} rollout tokens per arm; steps with the very same rollout in both arms: "
          f"{same} of {steps}\n")
    print("| arm | gen s | old_log_prob s | update s | step s | rollout tokens/s |")
    print("|---|---|---|---|---|---|")
    for m in ARMS:
        t = total[m]
        print(f"| SD {m} | {t['timing_s/gen']:.1f} | {t['timing_s/old_log_prob']:.1f} | {t['timing_s/update']:.1f} | "
              f"{t['timing_s/step']:.1f} | {tokens / t['timing_s/gen']:.0f} |")
    off, auto = total["off"], total["auto"]
    f = off["timing_s/gen"] / off["timing_s/step"]
    print(f"\nrollout speedup (gen off / auto): {off['timing_s/gen'] / auto['timing_s/gen']:.2f}x; "
          f"step speedup: {off['timing_s/step'] / auto['timing_s/step']:.2f}x; rollout share of an SD-off step: {f:.0%}")


if __name__ == "__main__":
    main()
