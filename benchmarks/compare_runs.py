"""Side by side: what finished runs spent and learned, from their `metrics.jsonl`, over the steps they all reached.

    .venv/bin/python benchmarks/compare_runs.py runs/before runs/now [--labels before now] [--steps N] [--cpu-s A B]

One row per run: the sums over steps 1..N of each phase's seconds (`timing_s/*`), the response tokens, rollout
tokens per second, and held-out accuracy at each eval step up to N; then each phase's ratio against the first run.
N is the last step every run reached (or --steps). The last line per run says from which step its responses (their lengths and
rewards) differ from the first run's: runs of one seed whose passes give the same bits sample the very same ones.
--cpu-s: each run's process CPU seconds over the whole run, measured outside (a run's metrics hold wall time only):
on a shared machine, where wall seconds depend on the neighbours, the figure that survives. Compare it only between
runs that did the same work (the same steps and evals)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PHASES = ["gen", "reward", "old_log_prob", "update", "sync", "step"]


def load(folder: Path) -> tuple[dict[int, dict], dict[int, float]]:
    """Step rows (with a `timing_s/step`) and eval accuracies by step; a later row of a step (a resumed run) wins."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{folder}: no metrics.jsonl there (is it a run folder?)")
    rows, evals = {}, {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "eval/accuracy" in row:
            evals[int(row["step"])] = float(row["eval/accuracy"])
        if "timing_s/step" in row:
            rows[int(row["step"])] = row
    return rows, evals


def summary(rows: dict[int, dict], evals: dict[int, float], last: int) -> dict:
    steps = [rows[s] for s in range(1, last + 1)]
    out = {p: sum(float(r.get(f"timing_s/{p}", 0.0)) for r in steps) for p in PHASES}
    out["tokens"] = sum(sum(r.get("response_lengths", [])) for r in steps)
    out["evals"] = {s: a for s, a in sorted(evals.items()) if s <= last}
    out["trace"] = [(tuple(r.get("response_lengths", [])), r.get("reward/mean")) for r in steps]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--labels", nargs="*", default=[])
    ap.add_argument("--steps", type=int, default=0, help="compare steps 1..N (default: the last step all reached)")
    ap.add_argument("--cpu-s", nargs="*", type=float, default=[], help="each run's process CPU seconds, in order")
    args = ap.parse_args()
    labels = args.labels or [str(r) for r in args.runs]
    if len(labels) != len(args.runs) or (args.cpu_s and len(args.cpu_s) != len(args.runs)):
        ap.error("give one label (and one --cpu-s figure) per run")
    loaded = [load(r) for r in args.runs]
    reached = min(max(rows, default=0) for rows, _ in loaded)
    last = min(args.steps, reached) if args.steps else reached
    if last < 1 or any(set(range(1, last + 1)) - set(rows) for rows, _ in loaded):
        raise SystemExit(f"no common steps 1..{last} in every run's metrics.jsonl")
    sums = [summary(rows, evals, last) for rows, evals in loaded]
    cpu = ["| run CPU s " if args.cpu_s else "", "|---" if args.cpu_s else ""]
    print(f"Steps 1..{last}, sums of each phase's seconds (wall), response tokens, held-out accuracy at each eval.\n")
    print("| run | " + " | ".join(f"{p} s" for p in PHASES) + " | tokens | rollout tok/s " + cpu[0] + "| held-out accuracy |")
    print("|---|" + "---|" * len(PHASES) + "---|---" + cpu[1] + "|---|")
    for i, (label, s) in enumerate(zip(labels, sums)):
        extra = f"| {args.cpu_s[i]:.0f} " if args.cpu_s else ""
        acc = " / ".join(f"{a:.2f}" for a in s["evals"].values())
        print(f"| {label} | " + " | ".join(f"{s[p]:.0f}" for p in PHASES)
              + f" | {s['tokens']} | {s['tokens'] / max(s['gen'], 1e-9):.1f} {extra}| {acc} |")
    base = sums[0]
    for i, (label, s) in enumerate(zip(labels[1:], sums[1:]), start=1):
        ratios = ", ".join(f"{p} {base[p] / s[p]:.2f}x" for p in PHASES if min(base[p], s[p]) >= 1.0)
        if args.cpu_s:
            ratios += f", run CPU s {args.cpu_s[0] / args.cpu_s[i]:.2f}x"
        differ = [n for n, (a, b) in enumerate(zip(base["trace"], s["trace"]), start=1) if a != b]
        same = (f"responses differ from step {differ[0]} on" if differ else "the same responses and rewards at every step")
        print(f"\n{labels[0]} / {label} (above 1: {label} faster): {ratios}; {same}")


if __name__ == "__main__":
    main()
