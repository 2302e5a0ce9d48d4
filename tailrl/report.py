"""The run report: plots of reward and accuracy, step time by phase, response lengths per step, accept length over
steps and the rollout's long tail (running sequences over rollout time, SD on against the SD-off estimate; tail
share and SD's speedup in the tail and the body per step, engine/tail.py), written as report.png and report.md in the
run folder, and one good and one bad completion from the first and the last logged steps (samples.jsonl), so that
a reader sees what the model learned."""

from __future__ import annotations

from pathlib import Path

from .metrics import read_jsonl, read_metrics

PHASES = ["gen", "reward", "old_log_prob", "ref", "update", "sync", "eval"]


def make_report(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    if not train:
        raise ValueError(f"{run_dir}/metrics.jsonl has no training steps yet")
    steps = [r["step"] for r in train]
    tail = [r for r in train if r.get("rollout/timeline")]
    fig, axes = plt.subplots(3 if tail else 2, 2, figsize=(12, 12 if tail else 8))
    ax = axes[0][0]
    ax.plot(steps, [r["reward/mean"] for r in train], marker="o", label="train reward")
    ax.plot(steps, [r["acc/mean"] for r in train], marker=".", label="train accuracy")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], marker="s", label="eval accuracy (greedy)")
    ax.set_title("reward and accuracy")
    ax.set_xlabel("step")
    ax.legend()
    ax = axes[0][1]
    bottom = [0.0] * len(train)
    for ph in PHASES:
        vals = [r.get(f"timing_s/{ph}", 0.0) for r in train]
        if any(vals):
            ax.bar(steps, vals, bottom=bottom, label=ph)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("step time by phase (s)")
    ax.set_xlabel("step")
    ax.legend()
    ax = axes[1][0]
    data = [r.get("response_lengths") or [r["response_length/mean"]] for r in train]
    ax.boxplot(data, positions=steps, widths=0.6)
    ax.set_title("response length per step (tokens)")
    ax.set_xlabel("step")
    ax = axes[1][1]
    ax.plot(steps, [r.get("spec/accept_length", 1.0) for r in train], marker="o", label="all decode steps")
    for key in sorted({k for r in train for k in r if k.startswith("spec/accept_length/")}):
        ax.plot(steps, [r.get(key, float("nan")) for r in train], marker=".", label=key.split("/")[-1] + " (when chosen)")
    ax.set_title("accept length (tokens per sequence per step)")
    ax.set_xlabel("step")
    ax.legend()
    if tail:
        tail_panels(axes[2], tail)
    fig.tight_layout()
    png = run_dir / "report.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    first, last = train[0], train[-1]
    total = sum(r["timing_s/step"] for r in train)
    gen = sum(r["timing_s/gen"] for r in train)
    lines = [
        f"# tailrl run report: {run_dir}", "",
        f"steps {steps[0]}..{steps[-1]}; reward {first['reward/mean']:.3f} -> {last['reward/mean']:.3f}; "
        f"train accuracy {first['acc/mean']:.2f} -> {last['acc/mean']:.2f}"
        + (f"; eval accuracy {evals[0]['eval/accuracy']:.2f} -> {evals[-1]['eval/accuracy']:.2f}" if evals else ""), "",
        f"time {total:.0f}s, of which rollout {gen:.0f}s ({100 * gen / max(total, 1e-9):.0f}%); "
        f"mean accept length {sum(r.get('spec/accept_length', 1) for r in train) / len(train):.2f}, "
        f"the selector's estimate of the rollout speedup {sum(r.get('spec/speedup_est', 1) for r in train) / len(train):.2f}x "
        "(its cost model's plain-decoding time over the measured time; `benchmarks/e2e.py` measures SD on against off)", "",
        "![report](report.png)", "",
        *tail_lines(tail),
        *eval_lines(evals),
        # rounds: sampling rounds (more than 1 with algo.dynamic_sampling); groups: those with a spread of rewards
        # in the update (the rest have advantage 0) / those left out for equal rewards
        "| step | reward | acc | resp len | rounds | groups kept / filtered | gen s | update s | step s | accept len |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in train:
        lines.append(f"| {r['step']} | {r['reward/mean']:.3f} | {r['acc/mean']:.2f} | {r['response_length/mean']:.0f} | "
                     f"{r.get('rollout/gen_rounds', 1)} | {r.get('rollout/informative_groups', '-')} / "
                     f"{r.get('rollout/filtered_groups', 0)} | {r['timing_s/gen']:.1f} | {r.get('timing_s/update', 0):.1f} "
                     f"| {r['timing_s/step']:.1f} | {r.get('spec/accept_length', 1):.2f} |")
    lines += partial_lines(train)
    lines += sample_lines(run_dir)
    md = run_dir / "report.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def partial_lines(train: list[dict]) -> list[str]:
    """Markdown: partial rollouts per step (rollout.partial): how off-policy the trained tokens were."""
    rows = [r for r in train if "rollout/offpolicy_token_frac" in r]
    if not rows:
        return []
    share = sum(r["rollout/offpolicy_token_frac"] for r in rows) / len(rows)
    lines = ["", "## Partial rollouts (off-policy)", "",
             f"mean share of trained tokens drawn by an older policy {share:.2f}; staleness at most "
             f"{max(r['rollout/staleness_max'] for r in rows)} versions", "",
             "| step | groups launched | stopped at (tokens) | responses carried | restarted (stale) | off-policy tokens "
             "| staleness mean / max |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['step']} | {r['rollout/partial_launched']} | {r.get('rollout/partial_horizon', '-') or '-'} | "
                     f"{r['rollout/partial_carried']} | "
                     f"{r['rollout/partial_restarted']} | {r['rollout/offpolicy_token_frac']:.2f} | "
                     f"{r['rollout/staleness_mean']:.2f} / {r['rollout/staleness_max']} |")
    return lines


def tail_panels(axes, tail: list[dict]) -> None:
    """Running sequences over rollout time at the first and the slowest step (measured with the run's SD setting,
    and the SD-off estimate of the same steps), and the tail's share and SD's tail and body speedups per step."""
    ax = axes[0]
    slowest = max(tail, key=lambda r: r["rollout/timeline"][-1][0])
    for row, color in zip([tail[0]] + ([slowest] if slowest is not tail[0] else []), ("C0", "C3")):
        line, r = row["rollout/timeline"], row["step"]
        for i, style, what in ((0, "-", "measured"), (1, "--", "SD-off estimate")):
            xs = [0.0] + [p[i] for p in line] + [line[-1][i]]  # ends at 0 running: the rollout's end
            ax.step(xs, [line[0][2]] + [p[2] for p in line] + [0], where="pre", linestyle=style, color=color,
                    label=f"step {r}, {what}")
        ax.axhline(line[0][2] / 4, color="grey", linewidth=0.5)
    ax.set_title("running sequences over rollout time (grey: a quarter, the tail below)")
    ax.set_xlabel("rollout seconds")
    ax.legend()
    ax = axes[1]
    steps = [r["step"] for r in tail]
    ax.plot(steps, [r["rollout/tail_share"] for r in tail], marker="o", label="tail share of rollout time")
    ax.set_ylim(0, 1)
    ax.set_xlabel("step")
    ax.legend(loc="upper left")
    ax2 = ax.twinx()
    ax2.plot(steps, [r.get("spec/tail_speedup_est", 1.0) for r in tail], marker="s", color="C3", label="SD speedup, tail")
    ax2.plot(steps, [r.get("spec/body_speedup_est", 1.0) for r in tail], marker=".", color="C2", label="SD speedup, body")
    ax2.axhline(1.0, color="grey", linewidth=0.5)
    ax2.legend(loc="upper right")
    ax.set_title("the tail: its share, and SD against the SD-off estimate (x)")


def tail_lines(tail: list[dict]) -> list[str]:
    """Markdown: the tail's share of rollout time and SD's estimated speedups, over the run's rollouts."""
    if not tail:
        return []
    on = {part: sum(r[f"rollout/{part}_s"] for r in tail) for part in ("tail", "body")}
    off = {part: sum(r[f"rollout/{part}_s"] * r[f"spec/{part}_speedup_est"] for r in tail) for part in on}
    total = on["tail"] + on["body"]
    return [f"the long tail (at most a quarter of the sequences running): {on['tail']:.0f}s of {total:.0f}s of "
            f"rollout ({on['tail'] / max(total, 1e-9):.0%}); SD against the selector's SD-off estimate of the same "
            f"steps: {off['tail'] / max(on['tail'], 1e-9):.2f}x in the tail, {off['body'] / max(on['body'], 1e-9):.2f}x "
            "in the body (`benchmarks/e2e.py` measures SD on against off)", ""]


def eval_lines(evals: list[dict]) -> list[str]:
    """Markdown: greedy accuracy on the held-out prompts at each evaluation."""
    if not evals:
        return []
    return (["| eval at step | greedy accuracy (held out, strict) | eval reward |", "|---|---|---|"]
            + [f"| {r['step']} | {r['eval/accuracy']:.2f} | {r.get('eval/reward', float('nan')):.3f} |" for r in evals] + [""])


def sample_lines(run_dir: Path) -> list[str]:
    """Markdown: the best and the worst completion (by reward) of the first and the last step in samples.jsonl."""
    path = run_dir / "samples.jsonl"
    rows = read_jsonl(path) if path.is_file() else []
    if not rows:
        return []
    steps = sorted({r["step"] for r in rows})
    out = ["", "## What the model wrote", ""]
    for step in dict.fromkeys([steps[0], steps[-1]]):
        at = [r for r in rows if r["step"] == step]
        good, bad = max(at, key=lambda r: r["reward"]), min(at, key=lambda r: r["reward"])
        for label, r in (("good", good), ("bad", bad)):
            head = (f"**step {step}, {label}** (reward {r['reward']:.2f}{', correct' if r.get('correct') else ''}, "
                    f"{r.get('length', '?')} tokens, {r.get('finish_reason', '?')})")
            out += [head, "",
                    "> " + r["prompt"].strip().replace("\n", "\n> "), "", "```text",
                    _response(r).replace("```", "` ` `"), "```", ""]
    return out


def _response(row: dict) -> str:
    """The completion, or for a multi-turn trajectory its turns: what the model wrote and each tool's answer."""
    if not row.get("conversation"):
        return row["completion"]
    turns = row["conversation"][row.get("prompt_messages", 0):]
    calls = row.get("tool_calls") or []
    text = "\n".join(f"[{m['role'] if m['role'] == 'assistant' else 'tool result'}] {m['content']}" for m in turns)
    return text + f"\n({len(calls)} tool call{'s' if len(calls) != 1 else ''}: " + (
        ", ".join(f"{c['name']} {c['status']}" for c in calls) or "none") + ")"
