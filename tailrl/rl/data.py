"""Prompt datasets (JSONL or Parquet, or a built-in task) and a resumable shuffling loader."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

from .tasks import make_rows

log = logging.getLogger(__name__)


@dataclass
class Example:
    prompt: object  # text or chat messages
    answer: str
    columns: dict = field(default_factory=dict)  # every other column, passed to reward functions


def read_table(path: str) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset {path!r} not found")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError("reading Parquet needs pyarrow: pip install pyarrow") from e
        return pq.read_table(p).to_pylist()
    rows = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            log.warning("%s:%d skipped: not valid JSON (%s)", path, lineno, e.msg)
            rows.append(None)
    return rows


def to_examples(rows: list, prompt_key: str, answer_key: str, source: str) -> list[Example]:
    out, bad = [], 0
    for i, row in enumerate(rows, 1):
        why = None
        if not isinstance(row, dict):
            why = "not an object"
        elif not row.get(prompt_key):
            why = f"no {prompt_key!r}"
        elif row.get(answer_key) is None:
            why = f"no {answer_key!r}"
        elif not isinstance(row[prompt_key], (str, list)):
            why = f"{prompt_key!r} must be text or a list of chat messages"
        if why:
            bad += 1
            if row is not None:
                log.warning("%s row %d skipped: %s", source, i, why)
            continue
        cols = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
        out.append(Example(row[prompt_key], str(row[answer_key]), cols))
    if not out:
        raise ValueError(f"{source}: no usable rows (each needs {prompt_key!r} and {answer_key!r})")
    if bad:
        log.warning("%s: %d of %d rows skipped", source, bad, len(rows))
    return out


def load_datasets(cfg) -> tuple[list[Example], list[Example]]:
    """cfg: DataCfg. A train file (and optional eval file), or the built-in task split into train and eval."""
    if cfg.train_file:
        train = to_examples(read_table(cfg.train_file), cfg.prompt_key, cfg.answer_key, cfg.train_file)
        if cfg.eval_file:
            evals = to_examples(read_table(cfg.eval_file), cfg.prompt_key, cfg.answer_key, cfg.eval_file)
        else:
            evals, train = train[: cfg.num_eval], train[cfg.num_eval :] or train
        return train, evals
    train = to_examples(make_rows(cfg.task, cfg.num_train, seed=0), "prompt", "answer", cfg.task)
    evals = to_examples(make_rows(cfg.task, cfg.num_eval, seed=1), "prompt", "answer", cfg.task)
    return train, evals


def chat_prompt(prompt, system_prompt: str = "") -> list[dict]:
    msgs = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if system_prompt and not (msgs and msgs[0].get("role") == "system"):
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    return msgs


class Loader:
    """Reshuffles every epoch from (seed, epoch); its position is two integers, saved with checkpoints."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self.epoch, self.index = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        order = list(range(self.n))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        return order

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.index >= self.n:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffle()
            out.append(self._order[self.index])
            self.index += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffle()
