"""Where a run's metrics go besides metrics.jsonl (trainer.loggers): TensorBoard and Weights & Biases.

Each logger takes the very names and values of metrics.jsonl (numbers only; lists such as response_lengths stay in
the JSONL). A W&B run's id is kept in the run folder (`wandb_run_id`), so a resumed run continues the same W&B
run; `WANDB_MODE=offline` logs to `<run>/wandb/offline-run-*` with no network (`wandb sync` uploads it later)."""

from __future__ import annotations

import math
import os
import secrets
import string
from pathlib import Path

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
WANDB_ID_FILE = "wandb_run_id"


class LoggerError(ValueError):
    """A logger that cannot run (a missing package, W&B that does not start)."""


def check_loggers(names: list[str]) -> None:
    """Fails before any work when a chosen logger's package is missing."""
    if "wandb" in names:
        try:
            import wandb  # noqa: F401
        except ImportError as e:
            raise LoggerError("trainer.loggers has wandb, but the wandb package is not installed: pip install wandb "
                              f"(or tailrl[wandb]), or leave wandb out of trainer.loggers ({e})") from None


def scalars(metrics: dict) -> dict[str, float]:
    return {k: v for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardLogger:
    name = "tensorboard"

    def __init__(self, run_dir: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.where = str(run_dir / "tensorboard")
        self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=None if resume_step is None else resume_step + 1)

    def log(self, step: int, metrics: dict) -> None:
        for k, v in scalars(metrics).items():
            self.tb.add_scalar(k, v, step)
        self.tb.flush()

    def close(self) -> None:
        self.tb.close()


def new_run_id() -> str:
    """8 lowercase letters and digits, as W&B's own ids."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbLogger:
    """A W&B run in the run folder; resumed (same id) when the folder holds one and the run resumes."""

    name = "wandb"

    def __init__(self, run_dir: Path, resume: bool, config: dict, project: str = "", name: str = ""):
        import wandb

        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else new_run_id()
        try:
            self.run = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or "tailrl",
                                  name=name or run_dir.resolve().name, id=run_id, resume="allow", config=config,
                                  dir=str(run_dir), settings=wandb.Settings(console="off", silent=True))
        except Exception as e:  # no API key, no network, a bad project...
            raise LoggerError(f"W&B did not start ({type(e).__name__}: {e}); log in with `wandb login`, or set "
                              "WANDB_MODE=offline to log to the run folder without network") from e
        id_file.write_text(run_id + "\n")
        self.id = run_id

    @property
    def where(self) -> str:
        """The run's page, or its local folder when offline."""
        return self.run.url or f"{Path(self.run.dir).parent} (offline: `wandb sync` uploads it)"

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def make_loggers(names: list[str], run_dir: Path, resume_step: int | None, config: dict, project: str = "",
                 name: str = "") -> list:
    """The loggers of trainer.loggers other than console and jsonl (those are the view's and MetricsWriter's)."""
    out = []
    if "tensorboard" in names:
        try:
            out.append(TensorBoardLogger(run_dir, resume_step))
        except ImportError:  # tensorboard is optional; the JSONL has everything
            pass
    if "wandb" in names:
        out.append(WandbLogger(run_dir, resume_step is not None, config, project, name))
    return out
