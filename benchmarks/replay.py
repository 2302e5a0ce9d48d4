"""Rollout speed of SD auto against SD off on the very same policy and history: both arms resume a run's checkpoint
(weights, history index, data position) and time the next step's rollout, interleaved, several times.

Both arms sample the same prompts with the same seeds and weights; with batch-invariant decoding (bf16 on a CPU,
engine/invariant.py) they emit the very same tokens, and the script counts the responses that agree. Give it an
SD-auto run: an SD-off run's checkpoint holds no history index, so its auto arm drafts from siblings alone (the
regime of a run's first epoch). Prints the selector's choices and the tokens/s per batch-size bucket too.

    .venv/bin/python benchmarks/replay.py RUN_DIR [--repeats 3] [--arms off auto auto,rollout.spec.allocate=false]
"""

from __future__ import annotations

import argparse
import logging
import re
import time
from pathlib import Path

from tailrl.config import load_config


def trainer_for(run: Path, arm: str):
    """arm: `off`, `auto`, or `auto` followed by comma-separated overrides (`auto,rollout.spec.allocate=false`)."""
    from tailrl.rl.trainer import Trainer

    mode, *overrides = re.split(r",(?![^\[]*\])", arm)  # commas inside [..] belong to a list value
    # the run's config.json is YAML too; out_dir = the folder given (a copy of a run replays its own checkpoints)
    return Trainer(load_config(str(run / "config.json"), [f"rollout.spec.mode={mode}", *overrides, "trainer.resume=true",
                                                          "trainer.overwrite=false", f"trainer.out_dir={run}"]))


def timed_rollout(trainer) -> dict:
    trainer.resume()  # the checkpoint's weights, history index and data position, every time (an SD-off run's
    # checkpoint has no history index: the auto arm then drafts from siblings alone, as in a run's first epoch)
    examples = [trainer.train_set[i] for i in trainer.loader.next(trainer.cfg.trainer.prompts_per_step)]
    t = time.perf_counter()
    comps = trainer.rollout(examples, trainer.step)
    s = time.perf_counter() - t
    st = trainer.engine.last_stats
    return {"s": s, "tokens": sum(len(c.token_ids) for c in comps), "accept": st.mean_accept_length,
            "max_len": max(len(c.token_ids) for c in comps), "same": [c.token_ids for c in comps],
            "choices": st.choices, "by_bucket": st.by_bucket,
            "parts": {"prefill": st.prefill_s, "draft": st.draft_s, "forward": st.forward_s, "verify": st.verify_s,
                      "decode steps": st.decode_steps}}


def bucket_range(b: int) -> str:
    lo, hi = (1 << (b - 1)) + 1 if b else 1, 1 << b
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", nargs="+", default=["off", "auto"],
                    help="off, auto, or auto with overrides: auto,rollout.spec.allocate=false (the first is the baseline)")
    args = ap.parse_args()
    logging.getLogger("tailrl").setLevel(logging.ERROR)
    arms = {m: trainer_for(args.run, m) for m in args.arms}
    base = args.arms[0]
    for tr in arms.values():  # warm-up: the selector measures its cost table and acceptance (not checkpointed)
        timed_rollout(tr)
    res = {m: [] for m in arms}
    for _ in range(args.repeats):
        for m, tr in arms.items():
            res[m].append(timed_rollout(tr))
    ref = arms[base]
    print(f"\n{args.run} at step {ref.step}: the next step's rollout ({ref.cfg.trainer.prompts_per_step} prompts x "
          f"{ref.cfg.rollout.n}), {args.repeats} repeats per arm, interleaved\n")
    print(f"| arm | rollout s (each) | mean s | tokens (mean) | longest | tokens/s | accept len | speedup vs {base} | "
          f"responses as {base} |")
    print("|---|---|---|---|---|---|---|---|---|")
    mean = {}
    for m, rs in res.items():
        mean[m] = sum(r["s"] for r in rs) / len(rs)
        tok = sum(r["tokens"] for r in rs) / len(rs)
        each = ", ".join(f"{r['s']:.1f}" for r in rs)
        same = sum(a == b for r0, r in zip(res[base], rs) for a, b in zip(r0["same"], r["same"]))
        print(f"| SD {m} | {each} | {mean[m]:.1f} | {tok:.0f} | {max(r['max_len'] for r in rs)} | {tok / mean[m]:.0f} | "
              f"{sum(r['accept'] for r in rs) / len(rs):.2f} | {mean[base] / mean[m]:.2f}x | "
              f"{same} of {sum(len(r['same']) for r in rs)} |")
    print("\nwhere the rollout's time goes (mean over repeats; seconds, and decode steps)")
    print("| arm | prefill | draft | forward | sample/accept | decode steps |")
    print("|---|---|---|---|---|---|")
    for m, rs in res.items():
        p = {k: sum(r["parts"][k] for r in rs) / len(rs) for k in rs[0]["parts"]}
        print(f"| SD {m} | {p['prefill']:.2f} | {p['draft']:.2f} | {p['forward']:.2f} | {p['verify']:.2f} | "
              f"{p['decode steps']:.0f} |")
    print(f"\nper batch-size bucket (last repeat): decode steps per arm the selector chose; seconds and tokens/s per arm")
    last = {m: rs[-1] for m, rs in res.items()}
    for b in sorted(set().union(*(r["by_bucket"] for r in last.values()))):
        rate = {m: (lambda c: c[0] / c[1] if c and c[1] else 0.0)(last[m]["by_bucket"].get(b)) for m in last}
        secs = {m: last[m]["by_bucket"].get(b, [0, 0.0])[1] for m in last}
        print(f"  B {bucket_range(b)}: " + "; ".join(f"{m} {last[m]['choices'].get(b, {})} {secs[m]:.2f} s {rate[m]:.0f}/s"
                                                     for m in last))
    for tr in arms.values():
        tr.close()


if __name__ == "__main__":
    main()
