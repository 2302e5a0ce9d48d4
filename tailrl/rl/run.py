"""`train`: the run around the RL steps. It claims the run folder (lock; refuses to replace a run unless
asked), resumes, logs metrics, evaluates and saves periodically, and stops cleanly on SIGINT/SIGTERM.

Invariant: whatever ends the run (the last step, an error, a signal), the reward worker, the spot trainer
and the folder lock are released; a signal never interrupts a checkpoint or a metrics line being written."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from ..config import Config, to_dict
from ..loggers import check_loggers
from ..console import RunConsole, header_lines
from ..metrics import MetricsWriter
from .checkpoint import run_dir
from .checkpoint.store import disk_warning, latest_name
from .stop import Interrupted, StopOnSignal
from .trainer import Trainer

log = logging.getLogger(__name__)


def train(cfg: Config, console=None) -> Path:
    """Runs cfg.trainer.steps steps (from the last checkpoint with trainer.resume); returns the run folder.
    Raises Interrupted (with the step and latest checkpoint) on SIGINT/SIGTERM. console: a rich Console for the
    run's lines (default: stdout)."""
    out = Path(cfg.trainer.out_dir)
    check_loggers(cfg.trainer.loggers)  # a missing package fails now, not at step 1
    lock = run_dir.claim(out, cfg.trainer.resume, cfg.trainer.overwrite)
    trainer = writer = view = None
    try:
        with StopOnSignal() as stop:
            try:
                view = RunConsole(console, steps="console" in cfg.trainer.loggers)
                trainer = Trainer(cfg)
                low = disk_warning(out / "checkpoints", trainer.policy, cfg.trainer.keep_checkpoints)
                if low:
                    log.warning(low)
                resumed = cfg.trainer.resume and trainer.resume()
                (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
                t = cfg.trainer
                writer = MetricsWriter(out, trainer.step if resumed else None, t.loggers, to_dict(cfg), t.project,
                                       t.run_name)
                view.header(header_lines(trainer, writer.where(), resumed))
                view.watch(trainer)
                _loop(trainer, writer, view, stop)
            except Interrupted as e:
                e.step = trainer.step if trainer is not None else None
                e.latest = latest_name(out / "checkpoints")
                raise
    finally:
        for closer in (view, writer, trainer):
            if closer is not None:
                closer.close()
        lock.release()
    return out


def _loop(trainer: Trainer, writer: MetricsWriter, view: RunConsole, stop: StopOnSignal) -> None:
    cfg = trainer.cfg
    if trainer.step == 0 and cfg.trainer.eval_every:
        t = time.perf_counter()
        m = trainer.evaluate()
        m["timing_s/eval"] = time.perf_counter() - t
        with stop.critical():
            writer.log(0, m)
        view.eval(0, m)
    stale: dict[str, int] = {}  # drafter -> rollouts in which its acceptance collapsed (after a weight sync)
    rested = 0  # steps whose rollout SD auto decoded plainly: the one before it was estimated slower (ledger.py)
    while trainer.step < cfg.trainer.steps:
        metrics = trainer.train_step()
        for k, v in metrics.items():
            if k.startswith("spec/stale/") and v:
                name = k.removeprefix("spec/stale/")
                stale[name] = stale.get(name, 0) + 1
        rested += metrics.get("spec/rested", 0) > 0
        with stop.critical():
            writer.log(trainer.step, metrics)
            writer.log_samples(trainer.samples)
        view.step(trainer.step, cfg.trainer.steps, metrics)
        trainer.guard.after_step(trainer.step, metrics, trainer.skip_reason)
        last = trainer.step == cfg.trainer.steps
        if (cfg.trainer.save_every and trainer.step % cfg.trainer.save_every == 0) or last:
            t = time.perf_counter()
            with stop.critical():
                trainer.save(final=last)
            log.info("checkpoint at step %d (%.1fs)", trainer.step, time.perf_counter() - t)
    if stale:  # the normal cost of a moving policy, summed once per run: spec/stale/<drafter> has it per step
        log.info("drafters re-measured after their acceptance fell (weight syncs): %s",
                 ", ".join(f"{d} in {n} of {trainer.step} steps" for d, n in sorted(stale.items())))
    if rested:
        log.info("SD auto decoded plainly in %d of %d steps: a rollout before each was estimated slower than SD off "
                 "(spec/rested, speculative/ledger.py)", rested, trainer.step)
