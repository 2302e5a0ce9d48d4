"""Arms of runs over several seeds, side by side: held-out accuracy at each eval step (mean, and each seed's), the
best and last eval, wall time, rollout time, sampling rounds per step and entropy, from the runs' `metrics.jsonl`.

    .venv/bin/python benchmarks/seeds.py base=runs/base_s0,runs/base_s1,runs/base_s2 ds=runs/ds_s0,runs/ds_s1,...

An arm is label=comma-separated run folders (one per seed). 32 held-out prompts move one eval by about 0.1, so
read the mean over seeds, and the per-seed values beside it for the spread."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from compare_runs import load  # (step rows, eval accuracies by step) of a run folder


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("arms", nargs="+", help="label=run1,run2,...")
    args = ap.parse_args()
    arms = []
    for spec in args.arms:
        label, _, folders = spec.partition("=")
        arms.append((label, [load(Path(f)) for f in folders.split(",") if f]))
    steps = sorted({s for _, runs in arms for _, ev in runs for s in ev})
    print("held-out accuracy by step: mean over seeds (each seed)")
    print("| arm | " + " | ".join(str(s) for s in steps) + " | best | last - best |")
    print("|---|" + "---|" * (len(steps) + 2))
    for label, runs in arms:
        cells = []
        for s in steps:
            vals = [ev[s] for _, ev in runs if s in ev]
            cells.append(f"{mean(vals):.2f} ({' '.join(f'{v:.2f}' for v in vals)})" if vals else "-")
        best = [max(ev.values()) for _, ev in runs if ev]
        drop = [ev[max(ev)] - max(ev.values()) for _, ev in runs if ev]
        print(f"| {label} | " + " | ".join(cells) + f" | {mean(best):.2f} | {mean(drop):+.2f} |")
    print()
    print("| arm | seeds | steps | wall s (mean) | rollout s | update s | rounds/step | entropy first -> last |"
          " reward first -> last | off-policy tokens (mean) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, runs in arms:
        last = min(max(rows) for rows, _ in runs if rows)

        def per_run(key: str, agg=sum) -> float:
            return mean([agg([rows[s].get(key, 0.0) for s in range(1, last + 1)]) for rows, _ in runs])

        rounds = per_run("rollout/gen_rounds") / last if any("rollout/gen_rounds" in r[1] for r, _ in runs) else 1.0
        # the first and last steps that report entropy (a step that updated no sequence has none)
        ent = [[rows[s]["actor/entropy"] for s in range(1, last + 1) if "actor/entropy" in rows[s]] for rows, _ in runs]
        ent0, ent1 = (mean([e[i] for e in ent if e] or [float("nan")]) for i in (0, -1))
        rew0, rew1 = (mean([rows[s]["reward/mean"] for rows, _ in runs]) for s in (1, last))
        print(f"| {label} | {len(runs)} | {last} | {per_run('timing_s/step'):.0f} | {per_run('timing_s/gen'):.0f} | "
              f"{per_run('timing_s/update'):.0f} | {rounds:.2f} | {ent0:.3f} -> {ent1:.3f} | {rew0:.2f} -> {rew1:.2f} | "
              f"{per_run('rollout/offpolicy_token_frac') / last:.2f} |")


if __name__ == "__main__":
    main()
