"""Prompt datasets (JSONL or Parquet, or a built-in task) and a resumable shuffling loader.

data.prompt_key and data.answer_key may be dotted paths into nested columns (verl's `reward_model.ground_truth`);
every top-level column other than the prompt's and the answer's reaches reward functions (`data_source`,
`extra_info`, ...)."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

from ..tasks import chat_prompt, split_rows

log = logging.getLogger(__name__)


ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Example:
    prompt: object  # text or chat messages
    answer: str
    columns: dict = field(default_factory=dict)  # every other column, passed to reward functions
    source: str = ""  # file:line (or task row) it came from, for warnings
    ids: list[int] = field(default_factory=list)  # the tokenized chat prompt (the trainer fills it)


def read_table(path: str) -> list[tuple[str, object]]:
    """(where, row) per row of a JSONL or Parquet file; `where` is 'file:line' (or 'file row N'). A line that
    is not UTF-8 or not JSON gives row None (and a warning naming it), so one bad line fails alone."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset {path!r} not found")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError("reading Parquet needs pyarrow: pip install pyarrow") from e
        return [(f"{path} row {i}", r) for i, r in enumerate(pq.read_table(p).to_pylist(), 1)]
    rows = []
    for lineno, raw in enumerate(p.read_bytes().splitlines(), 1):
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            log.warning("%s skipped: not UTF-8 (byte %d)", where, e.start)
            rows.append((where, None))
            continue
        if not line.strip():
            continue
        try:
            rows.append((where, json.loads(line)))
        except json.JSONDecodeError as e:
            log.warning("%s skipped: not valid JSON (%s)", where, e.msg)
            rows.append((where, None))
    return rows


def peek_rows(path: str, k: int = 8) -> list:
    """The first k rows of a JSONL or Parquet file without reading it all (bad lines are left out)."""
    p = Path(path)
    if not p.is_file():
        return []
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(p).iter_batches(batch_size=k), None)
        return batch.to_pylist() if batch is not None else []
    rows = []
    with p.open("rb") as f:
        for raw in f:
            try:
                rows.append(json.loads(raw))
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if len(rows) == k:
                break
    return rows


_MISSING = object()


def get_path(row: dict, key: str, default=None):
    """row[key], or for a dotted key that is not a column itself, the nested value (row['a']['b'] for 'a.b')."""
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


def _message_problem(i: int, m) -> str | None:
    if not isinstance(m, dict):
        return f"chat message {i} is a {type(m).__name__}, not {{'role': ..., 'content': ...}}"
    if m.get("role") not in ROLES:
        return f"chat message {i} has role {m.get('role')!r} (one of {', '.join(ROLES)})"
    if not isinstance(m.get("content"), str):
        return f"chat message {i} has no text 'content'"
    return None


def row_problem(row, prompt_key: str, answer_key: str) -> str | None:
    """Why a row cannot be used (None when it can)."""
    if not isinstance(row, dict):
        return "not an object"
    prompt, answer = get_path(row, prompt_key), get_path(row, answer_key)
    if not prompt:
        return f"no {prompt_key!r}"
    if answer is None:
        return f"no {answer_key!r}"
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        return f"{answer_key!r} is a {type(answer).__name__}, not text or a number"
    if isinstance(prompt, list):
        return next((p for i, m in enumerate(prompt, 1) if (p := _message_problem(i, m))), None)
    if not isinstance(prompt, str):
        return f"{prompt_key!r} is a {type(prompt).__name__}, not text or a list of chat messages"
    return None


def to_examples(rows: list[tuple[str, object]], prompt_key: str, answer_key: str, source: str) -> list[Example]:
    """Good rows as Examples; each bad row is skipped with a warning naming its file and line."""
    dicts = [r for _, r in rows if isinstance(r, dict)]
    for key, setting in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        if dicts and not any(get_path(r, key, _MISSING) is not _MISSING for r in dicts):
            cols = sorted({k for r in dicts for k in r})
            raise ValueError(f"{source}: no usable rows: no column {key!r} (columns: {', '.join(cols)}); set {setting} to the column "
                             f"that holds the {'prompts' if key == prompt_key else 'answers'}")
    out, bad = [], 0
    for where, row in rows:
        why = row_problem(row, prompt_key, answer_key)
        if why:
            bad += 1
            if row is not None:  # None rows were reported when read
                log.warning("%s skipped: %s", where, why)
            continue
        cols = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
        out.append(Example(get_path(row, prompt_key), str(get_path(row, answer_key)), cols, where))
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
        elif len(train) > cfg.num_eval:
            evals, train = train[: cfg.num_eval], train[cfg.num_eval :]
        else:  # too few rows to hold some out: evaluate on the train prompts, and say so
            log.warning("%s: %d rows, not more than data.num_eval=%d: eval uses the train prompts (not held out); give "
                        "data.eval_file or lower data.num_eval", cfg.train_file, len(train), cfg.num_eval)
            evals = train[: cfg.num_eval]
        return train, evals
    train, evals = split_rows(cfg.task, cfg.num_train, cfg.num_eval, cfg.levels)
    return _task_examples(cfg.task, train, "train"), _task_examples(cfg.task, evals, "eval")


def _task_examples(task: str, rows: list[dict], split: str) -> list[Example]:
    return to_examples([(f"{task} {split} row {i}", r) for i, r in enumerate(rows, 1)], "prompt", "answer", task) if rows else []


def fit_prompts(examples: list[Example], encode, system_prompt: str, max_tokens: int, split: str) -> list[Example]:
    """Tokenizes each prompt (Example.ids) with `encode`; a prompt that does not tokenize or is longer than
    max_tokens is skipped with a warning naming its row. Raises when no prompt of a non-empty split is left."""
    keep = []
    for ex in examples:
        try:
            ex.ids = encode(chat_prompt(ex.prompt, system_prompt))
        except Exception as e:  # a chat template may reject what the row validation let through
            log.warning("%s skipped: the prompt does not tokenize (%s: %s)", ex.source or split, type(e).__name__, e)
            continue
        if len(ex.ids) > max_tokens:
            log.warning("%s skipped: prompt of %d tokens (data.max_prompt_tokens=%d)", ex.source or split,
                        len(ex.ids), max_tokens)
            continue
        keep.append(ex)
    if examples and not keep:
        raise ValueError(f"no {split} prompt fits data.max_prompt_tokens={max_tokens}")
    return keep


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
