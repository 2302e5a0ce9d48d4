"""Runs side by side, step by step: one table per quantity (step seconds, rollout seconds, the tail's share of the
rollout, the share of trained tokens an older policy drew, train reward, held-out accuracy), a row per run and a
column per step, from the runs' `metrics.jsonl`; the last column sums (seconds) or averages (shares) the steps.

    .venv/bin/python benchmarks/per_step.py "SD off=runs/off" "SD auto=runs/auto" "partial + SD auto=runs/p_auto"

A run is label=folder. A step a run has not reached is "-"; a resumed run's later row of a step wins (as in
compare_runs.py)."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from compare_runs import load  # (step rows, eval accuracies by step) of a run folder

# (title, metrics key, format, how the last column folds the steps)
QUANTITIES = [
    ("step s", "timing_s/step", "{:.0f}", "sum"),
    ("rollout s", "timing_s/gen", "{:.0f}", "sum"),
    ("tail share of the rollout", "rollout/tail_share", "{:.2f}", "mean"),
    ("off-policy share of trained tokens", "rollout/offpolicy_token_frac", "{:.2f}", "mean"),
    ("train reward", "reward/mean", "{:.2f}", "mean"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="label=folder")
    args = ap.parse_args()
    runs = []
    for spec in args.runs:
        label, _, folder = spec.partition("=")
        if not folder:
            raise SystemExit(f"{spec!r}: expected label=folder")
        runs.append((label, *load(Path(folder))))
    steps = sorted({s for _, rows, _ in runs for s in rows})
    for title, key, fmt, fold in QUANTITIES:
        print(f"{title}, by step")
        print("| run | " + " | ".join(str(s) for s in steps) + f" | {fold} |")
        print("|---|" + "---|" * (len(steps) + 1))
        for label, rows, _ in runs:
            vals = [rows[s].get(key, 0.0) if s in rows else None for s in steps]
            got = [v for v in vals if v is not None]
            total = (sum(got) if fold == "sum" else statistics.fmean(got)) if got else None
            cells = [fmt.format(v) if v is not None else "-" for v in vals + [total]]
            print(f"| {label} | " + " | ".join(cells) + " |")
        print()
    evs = sorted({s for _, _, ev in runs for s in ev})
    print("held-out accuracy, by step")
    print("| run | " + " | ".join(str(s) for s in evs) + " |")
    print("|---|" + "---|" * len(evs))
    for label, _, ev in runs:
        print(f"| {label} | " + " | ".join(f"{ev[s]:.2f}" if s in ev else "-" for s in evs) + " |")


if __name__ == "__main__":
    main()
