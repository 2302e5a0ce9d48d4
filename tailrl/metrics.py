"""Run metrics: one JSON line per step (metrics.jsonl), TensorBoard scalars, and a console line."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsWriter:
    def __init__(self, run_dir: str | Path, resume_step: int | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        if resume_step is not None and self.path.is_file():  # drop steps a killed run logged after its checkpoint
            keep = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in keep))
        elif resume_step is None and self.path.is_file():
            self.path.unlink()
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tensorboard"), purge_step=None if resume_step is None else resume_step + 1)
        except ImportError:  # tensorboard is optional; the JSONL has everything
            pass

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: v for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
