"""Run metrics: one JSON line per step (metrics.jsonl), a few sampled completions at chosen steps (samples.jsonl),
and the other loggers of trainer.loggers (loggers.py: TensorBoard, W&B); the console is console.py.

A line cut off by a killed run (the last one) is skipped with a warning naming the file and line, by the
reader and by a resuming writer, which rewrites the file whole (tmp + rename) before appending."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class MetricsWriter:
    """metrics.jsonl and samples.jsonl (with `jsonl` in loggers), and the other loggers of trainer.loggers."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None, loggers=("jsonl", "tensorboard"),
                 config: dict | None = None, project: str = "", run_name: str = ""):
        from .loggers import make_loggers

        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = "jsonl" in loggers
        self.path = self.dir / "metrics.jsonl"
        self.samples = self.dir / "samples.jsonl"
        if self.jsonl:
            restart_jsonl(self.path, resume_step)
            restart_jsonl(self.samples, resume_step)
        self.loggers = make_loggers(list(loggers), self.dir, resume_step, config or {}, project, run_name)

    def log(self, step: int, metrics: dict) -> None:
        if self.jsonl:
            row = {"step": step, **metrics}
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
        for lg in self.loggers:
            lg.log(step, metrics)

    def log_samples(self, rows: list[dict]) -> None:
        """A few completions of a step (rl/samples.py) to samples.jsonl."""
        if rows and self.jsonl:
            with self.samples.open("a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))

    def where(self) -> dict[str, str]:
        """Each logger's output (a file, a folder, a W&B page), for the console's header."""
        return {**({"jsonl": str(self.path)} if self.jsonl else {}), **{lg.name: lg.where for lg in self.loggers}}

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def restart_jsonl(path: Path, resume_step: int | None) -> None:
    """A fresh run starts the file anew; a resumed one drops the rows a killed run logged after its checkpoint."""
    if not path.is_file():
        return
    if resume_step is None:
        path.unlink()
        return
    keep = [r for r in read_jsonl(path) if r.get("step", 0) <= resume_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a metrics file; a line that does not parse (a cut-off last line) is skipped with a warning."""
    rows = []
    for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            log.warning("%s:%d skipped: not a complete JSON row (a run killed while writing it?)", path, lineno)
            continue
        rows.append(row)
    return rows


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    return read_jsonl(path)
