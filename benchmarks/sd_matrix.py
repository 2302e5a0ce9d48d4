"""Does SD auto know what it buys? SD auto, SD off and fixed arms side by side, on each workload and oneDNN ISA cap,
each run its own `tailrl train` process (the same seed: on the batch-invariant engine every arm draws the very same
tokens, which the table checks), rollout tokens / s from the runs' metrics.

    .venv/bin/python benchmarks/sd_matrix.py [--workloads default long tools partial] [--isas default AVX2]
        [--arms auto off history:15 ngram:4] [--seed 0] [--out /tmp/tailrl-matrix]

A workload is a preset with fewer steps and no evaluation (what is timed is the rollout); a fixed arm `d:k` is
`rollout.spec.mode=d rollout.spec.budgets=[k]` (that drafter at that budget on every decode step). Under
ONEDNN_MAX_CPU_ISA=AVX2 the engine runs in fp32 (no bf16 matrix hardware: a Zen 3's regime). A finished run's folder
is read, not rerun (delete --out to measure again). Per cell: tokens / s of each arm, auto against off and against
the best fixed arm, the selector's estimates (`spec/speedup_est`, `spec/tail_speedup_est`) beside the measured
ratios (off's rollout and tail seconds over auto's), and whether every arm drew the same response lengths."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

WORKLOADS = {  # name -> (preset, overrides)
    "default": ("", ["trainer.steps=8"]),
    "long": ("long", ["trainer.steps=2", "algo.dynamic_sampling=false"]),
    "tools": ("tools", ["trainer.steps=4"]),
    "partial": ("", ["trainer.steps=8", "rollout.partial=true"]),
}
COMMON = ["trainer.eval_every=0", "trainer.save_every=0", "trainer.overwrite=true", "trainer.keep_checkpoints=1"]


def arm_overrides(arm: str) -> list[str]:
    if arm in ("auto", "off"):
        return [f"rollout.spec.mode={arm}"]
    drafter, budget = arm.split(":")
    return [f"rollout.spec.mode={drafter}", f"rollout.spec.budgets=[{int(budget)}]"]


def run(out: Path, workload: str, arm: str, isa: str, seed: int) -> list[dict]:
    if not (out / "done.json").exists():
        preset, extra = WORKLOADS[workload]
        cmd = [sys.executable, "-m", "tailrl.cli", "train", *(["--preset", preset] if preset else []),
               f"trainer.out_dir={out}", f"trainer.seed={seed}", *COMMON, *extra, *arm_overrides(arm)]
        env = dict(os.environ)
        env.pop("ONEDNN_MAX_CPU_ISA", None)
        if isa != "default":
            env["ONEDNN_MAX_CPU_ISA"] = isa
        print(f"$ [{isa}]", " ".join(cmd[2:]), flush=True)
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        (out / "done.json").write_text(json.dumps({"wall_s": time.perf_counter() - t}))
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict]) -> dict:
    train = [r for r in rows if "timing_s/gen" in r]
    tokens = sum(sum(r.get("response_lengths", [])) for r in train)
    gen = sum(r["timing_s/gen"] for r in train)
    tail = sum(r.get("rollout/tail_s", 0.0) for r in train)
    est = sum(r["timing_s/gen"] * r.get("spec/speedup_est", 1.0) for r in train)
    tail_est = sum(r.get("rollout/tail_s", 0.0) * r.get("spec/tail_speedup_est", 1.0) for r in train)
    return {"tokens": tokens, "tps": tokens / gen if gen else 0.0, "gen_s": gen, "tail_s": tail,
            "est": est / gen if gen else 1.0, "tail_est": tail_est / tail if tail else 1.0,
            "lengths": [r.get("response_lengths", []) for r in train]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--isas", nargs="+", default=["default", "AVX2"])
    ap.add_argument("--arms", nargs="+", default=["auto", "off", "history:15", "ngram:4"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="/tmp/tailrl-matrix")
    args = ap.parse_args()
    fixed = [a for a in args.arms if ":" in a]
    print(f"| workload | ISA | {' | '.join(f'{a} tok/s' for a in args.arms)} | auto / off | auto / best fixed "
          "| rollout est / measured | tail est / measured | same lengths |")
    print("|---" * (len(args.arms) + 7) + "|")
    for isa in args.isas:
        for w in args.workloads:
            res = {a: summary(run(Path(args.out) / f"{w}-{isa}-{a.replace(':', '')}", w, a, isa, args.seed))
                   for a in args.arms}
            auto, off = res.get("auto"), res.get("off")
            cells = [f"{res[a]['tps']:.0f}" for a in args.arms]
            vs_off = f"{auto['tps'] / off['tps']:.2f}x" if auto and off else "-"
            best = max((res[a]["tps"] for a in fixed), default=0.0)
            vs_best = f"{auto['tps'] / best:.2f}x" if auto and best else "-"
            est = (f"{auto['est']:.2f} / {off['gen_s'] / auto['gen_s']:.2f}" if auto and off else "-")
            tail = (f"{auto['tail_est']:.2f} / {off['tail_s'] / auto['tail_s']:.2f}"
                    if auto and off and auto["tail_s"] else "-")
            same = all(res[a]["lengths"] == res[args.arms[0]]["lengths"] for a in args.arms)
            print(f"| {w} | {isa} | {' | '.join(cells)} | {vs_off} | {vs_best} | {est} | {tail} | {same} |", flush=True)


if __name__ == "__main__":
    main()
