"""What a training run prints: a header (model, precision, device, data, steps, speculation, run folder), one plain
line per step, a progress line while a rollout or an update runs long, and at the end the eval summary.

Invariants: every line is printed whole and is never cut to the terminal's width; the progress line exists only on a
terminal (it is transient: it disappears when the phase ends), so a log written to a file (`> run.log`) holds the
header and one line per step, nothing else of ours. The progress line only reads the trainer's `phase` and the
engine's public counters from its own thread: it never slows or stops a step (a failure there turns it off)."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)


def _count(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K" if n >= 1e3 else str(int(n))


def _dtype(t) -> str:
    return {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(t), str(t))


def header_lines(trainer, loggers_where: dict[str, str], resumed: bool) -> list[tuple[str, str]]:
    """(label, text) rows describing the run about to start."""
    import math

    import torch

    cfg, r, t, d = trainer.cfg, trainer.cfg.rollout, trainer.cfg.trainer, trainer.cfg.data
    params = sum(p.numel() for p in trainer.policy.parameters())
    if cfg.actor.lora.rank:  # the adapters' tensors, whichever process holds them (N ranks: trainer.policy is the engine's)
        trainable = sum(math.prod(s) for s in trainer.actor.shapes().values())
    else:
        trainable = sum(p.numel() for p in trainer.policy.parameters() if p.requires_grad)
    device = next(trainer.policy.parameters()).device
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    source = d.train_file + (f" (eval: {d.eval_file})" if d.eval_file else "") if d.train_file else (
        f"built-in {d.task}" + (f", levels {', '.join(map(str, d.levels))}" if d.levels else ""))
    rows = [
        ("model", f"{cfg.model.path} ({_count(params)} parameters)"),
        ("precision", f"engine {_dtype(trainer.rollout.dtype)}"
                      + (" (batch-invariant)" if trainer.rollout.batch_invariant else "")
                      + (f"; trainer fp32 master + AdamW, compute {trainer.actor.mode}" if not cfg.actor.lora.rank else
                         f"; trainer LoRA rank {cfg.actor.lora.rank} (fp32 adapters + AdamW, {_count(trainable)} "
                         f"trained), frozen base in {trainer.actor.mode}")
                      + (f", {t.world_size} ranks (FSDP2)" if t.world_size > 1 else "")),
        ("device", f"{device}{threads}"),
        ("data", f"{source}: {len(trainer.train_set)} train / {len(trainer.eval_set)} eval prompts"),
        ("reward", ", ".join(cfg.reward.functions)),
        ("steps", f"{t.steps} x {t.prompts_per_step} prompts x {r.n} samples, max {r.max_tokens} tokens, T {r.temperature:g}; "
                  f"eval every {t.eval_every or 'never'}, save every {t.save_every or 'end'}"
                  + (f"; dynamic sampling (up to {cfg.algo.max_gen_rounds} rounds)" if cfg.algo.dynamic_sampling else "")),
        ("rollout", trainer.rollout.version),
        ("speculation", trainer.rollout.spec_note),
        *([("off-policy", f"partial rollouts: {r.partial_oversample:g}x groups in flight, unfinished responses carried "
                          f"to the next step (at most {r.partial_max_staleness} versions stale), TIS cap "
                          f"{cfg.algo.tis_cap:g}")] if r.partial else []),
        ("run folder", f"{t.out_dir}" + (f" (resumed at step {trainer.step})" if resumed else "")),
    ]
    if loggers_where:
        rows.append(("loggers", ", ".join(f"{k} {v}".strip() for k, v in loggers_where.items())))
    return rows + [("note", n) for n in trainer.notes]


def step_line(step: int, total: int, m: dict, elapsed: float) -> str:
    def g(k: str) -> float:  # a step whose prompts were all rejected has no reward
        return m.get(k, float("nan"))

    line = (f"step {step}/{total}  reward {g('reward/mean'):.3f}  acc {g('acc/mean'):.2f}  "
            f"len {g('response_length/mean'):.0f}  gen {g('timing_s/gen'):.1f}s  upd {g('timing_s/update'):.1f}s "
            f"({g('perf/update_tokens_per_s'):.0f} tok/s)")
    if "spec/accept_length" in m or "rollout/partial_horizon" not in m:
        line += f"  accept {g('spec/accept_length'):.2f}"
    if "rollout/partial_horizon" in m:  # partial rollouts: where the rollout stopped, how off-policy the batch is
        stop = m["rollout/partial_horizon"]
        line += (f"  partial: {'buffered groups' if not stop else f'stopped at {stop} tokens'}, "
                 f"{100 * m.get('rollout/offpolicy_token_frac', 0):.0f}% off-policy")
    if m.get("rollout/gen_rounds", 1) > 1 or m.get("rollout/filtered_groups"):  # dynamic sampling
        line += f"  rounds {m['rollout/gen_rounds']} ({m.get('rollout/informative_groups', 0)} groups kept" + (
            ", round limit)" if m.get("rollout/round_limit") else ")")
    if "eval/accuracy" in m:
        line += f"  eval acc {m['eval/accuracy']:.2f}"
    if m.get("train/skipped_steps"):
        line += "  [update skipped: non-finite values]"
    return f"{line}  [{_clock(elapsed)}]"


def _clock(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def eval_summary(rows: list[dict]) -> str | None:
    """'eval accuracy 0.06 (step 0) -> 0.44 (step 16); best 0.72 at step 8' from metrics rows."""
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if isinstance(r.get("eval/accuracy"), (int, float))]
    if not evals:
        return None
    (s0, a0), (s1, a1) = evals[0], evals[-1]
    best = max(evals, key=lambda e: e[1])
    text = f"eval accuracy {a0:.2f} (step {s0}) -> {a1:.2f} (step {s1})" if len(evals) > 1 else f"eval accuracy {a1:.2f} (step {s1})"
    return text + (f"; best {best[1]:.2f} at step {best[0]}" if len(evals) > 2 and best[1] > a1 else "")


class RunConsole:
    """The run's console; `console`: a rich Console (tests pass one writing to a buffer)."""

    def __init__(self, console=None, steps: bool = True, progress_after_s: float = 3.0, poll_s: float = 0.5):
        from rich.console import Console

        self.console = console or Console()
        self.steps, self.after, self.poll = steps, progress_after_s, poll_s
        self.t0 = time.perf_counter()
        self._live = self._thread = None
        self._stop = threading.Event()

    def print(self, text: str) -> None:
        self.console.print(text, soft_wrap=True, highlight=False, markup=False)

    def header(self, rows: list[tuple[str, str]]) -> None:
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            self.print(f"{k:>{width}}  {v}")

    def step(self, step: int, total: int, m: dict) -> None:
        if self.steps:
            self.print(step_line(step, total, m, time.perf_counter() - self.t0))

    def eval(self, step: int, m: dict) -> None:
        if self.steps:
            self.print(f"step {step}: eval acc {m['eval/accuracy']:.2f}  reward {m['eval/reward']:.3f}  "
                       f"[{_clock(time.perf_counter() - self.t0)}]")

    # ---- the progress line (a terminal only) --------------------------------------------------------------

    def watch(self, trainer) -> None:
        """Shows what a long phase of `trainer` is doing until close(); nothing where there is no terminal."""
        if not (self.steps and self.console.is_terminal):
            return
        from rich.live import Live
        from rich.text import Text

        self._live = Live(Text(""), console=self.console, transient=True, auto_refresh=False)
        self._live.start()
        self._thread = threading.Thread(target=self._run, args=(trainer,), daemon=True, name="tailrl-progress")
        self._thread.start()

    def _run(self, trainer) -> None:
        from rich.text import Text

        seen: dict = {}
        while not self._stop.wait(self.poll):
            try:
                text = self._status(trainer, seen)
            except Exception as e:  # display only: never a reason to disturb the run
                log.debug("progress line off: %s", e)
                text = ""
                self._stop.set()
            self._live.update(Text(text, style="dim"), refresh=True)

    def _status(self, trainer, seen: dict) -> str:
        phase = trainer.phase
        if phase is None:
            return ""
        name, since = phase
        took = time.perf_counter() - since
        if took < self.after:
            return ""
        step = trainer.step + (name != "eval")  # an evaluation follows the step it belongs to
        line = f"step {step}/{trainer.cfg.trainer.steps} {name} {took:.0f}s"
        tokens, running = trainer.rollout.progress()
        if name in ("rollout", "eval") and running:
            now, prev = time.perf_counter(), seen.get("stats")
            if prev is not None and tokens > prev[0]:  # this rollout's counters (a new rollout starts from 0)
                rate = (tokens - prev[0]) / max(now - prev[1], 1e-9)
                seen["rate"] = 0.7 * seen.get("rate", rate) + 0.3 * rate
                line += f": {tokens:,} tokens, {running} running, {seen['rate']:.0f} tok/s"
            else:
                line += f": {running} running"
            seen["stats"] = (tokens, now)
        return line

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._live is not None:
            self._live.stop()
