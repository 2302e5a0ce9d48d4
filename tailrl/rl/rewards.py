"""Rewards: final-answer math verification, format, Countdown, and user functions named `module:function`.

A user function has TRL's signature: f(prompts, completions, answer=..., **extra_columns) -> list[float].
It runs in a worker process with a time limit; a call that raises or runs over gives the affected samples
a reward of 0 and a counted warning, and the run goes on."""

from __future__ import annotations

import ast
import importlib
import logging
import math
import multiprocessing as mp
import operator
import re
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The text after the last '####' (to the end of its line), else the last \\boxed{...}, else None."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip().splitlines()
        return tail[0].strip() if tail and tail[0].strip() else None
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
    return None


def _to_number(s: str) -> float | None:
    m = _NUM.search(s.replace("$", "").replace("\\,", ""))
    if not m:
        return None
    tok = m.group(0).replace(",", "")
    try:
        if "/" in tok:
            a, b = tok.split("/")
            return float(a) / float(b)
        return float(tok)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(pred: str, gold: str) -> bool:
    if not any(c in pred + gold for c in "\\{^"):
        a, b = _to_number(pred), _to_number(gold)
        if a is not None and b is not None:
            return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    try:  # symbolic forms (fractions, radicals, LaTeX): math-verify where it serves
        from math_verify import parse, verify

        return bool(verify(parse(f"${gold}$"), parse(f"${pred}$")))
    except Exception:
        return pred.strip() == gold.strip()


def math_reward(completion: str, answer: str, **_) -> float:
    pred = extract_answer(completion)
    return 1.0 if pred is not None and answers_match(pred, str(answer)) else 0.0


def math_partial_reward(completion: str, answer: str, **_) -> float:
    """1 for a correct answer line; 0.5 for a correct last number without one, so that a policy that solves
    the problem but ignores the format still earns more than one that writes '#### <wrong number>'."""
    if math_reward(completion, answer):
        return 1.0
    if extract_answer(completion) is None:
        nums = _NUM.findall(completion.replace("$", ""))
        if nums and answers_match(nums[-1], str(answer)):
            return 0.5
    return 0.0


def format_reward(completion: str, **_) -> float:
    """Partial credit for ending with an answer line: '#### <number>' (or a \\boxed{} answer)."""
    pred = extract_answer(completion)
    return 1.0 if pred is not None and _to_number(pred) is not None else 0.0


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval_expr(node, used: list[int]) -> float:
    if isinstance(node, ast.Expression):
        return _eval_expr(node.body, used)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_expr(node.left, used), _eval_expr(node.right, used))
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        used.append(node.value)
        return float(node.value)
    raise ValueError("only integers, + - * / and parentheses are allowed")


def countdown_reward(completion: str, answer: str, numbers: list[int] | None = None, **_) -> float:
    expr = extract_answer(completion)
    if expr is None or numbers is None:
        return 0.0
    expr = expr.split("=")[0].strip()
    try:
        used: list[int] = []
        value = _eval_expr(ast.parse(expr, mode="eval"), used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return 0.0
    return 1.0 if Counter(used) == Counter(numbers) and math.isclose(value, float(answer), abs_tol=1e-6) else 0.0


BUILTIN = {"math": math_reward, "math_partial": math_partial_reward, "format": format_reward,
           "countdown": countdown_reward}


def _call_user(spec: str, prompts, completions, columns: dict) -> list[float]:
    fn = load_function(spec)
    return [float(x) for x in fn(prompts=prompts, completions=completions, **columns)]


def load_function(spec: str):
    if ":" not in spec:
        raise ValueError(f"reward function {spec!r}: expected a built-in ({', '.join(BUILTIN)}) or 'module:function'")
    module, name = spec.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward function {spec!r} cannot be loaded: {e}") from e
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    return fn


@dataclass
class RewardStats:
    errors: int = 0
    timeouts: int = 0
    per_fn: dict[str, float] = field(default_factory=dict)  # mean of each function this step


class RewardRunner:
    def __init__(self, names: list[str], weights: list[float] | None = None, timeout_s: float = 10.0):
        if not names:
            raise ValueError("at least one reward function is needed")
        self.names = list(names)
        self.weights = list(weights) if weights else [1.0] * len(names)
        if len(self.weights) != len(self.names):
            raise ValueError(f"{len(self.weights)} reward weights for {len(self.names)} reward functions")
        for n in self.names:
            if n not in BUILTIN:
                load_function(n)  # fail at start-up on a name that does not resolve, not mid-run
        self.timeout_s = timeout_s
        self._pool = None
        self.total_errors = self.total_timeouts = 0

    def _worker(self):
        if self._pool is None:
            self._pool = mp.get_context("spawn").Pool(1)
        return self._pool

    def _kill_worker(self):
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None

    def close(self):
        self._kill_worker()

    def _user(self, spec, prompts, completions, columns, stats: RewardStats) -> list[float]:
        try:
            out = self._worker().apply_async(_call_user, (spec, prompts, completions, columns)).get(self.timeout_s)
            if len(out) != len(completions):
                raise ValueError(f"returned {len(out)} rewards for {len(completions)} completions")
            return [x if math.isfinite(x) else 0.0 for x in out]
        except mp.TimeoutError:
            self._kill_worker()
            if len(completions) == 1:
                stats.timeouts += 1
                log.warning("reward %s ran over %.1fs on one sample: reward 0", spec, self.timeout_s)
                return [0.0]
        except Exception as e:
            if len(completions) == 1:
                stats.errors += 1
                log.warning("reward %s raised on one sample (%s: %s): reward 0", spec, type(e).__name__, e)
                return [0.0]
        # the batch call failed: isolate the bad samples one by one
        return [self._user(spec, prompts[i : i + 1], completions[i : i + 1],
                           {k: v[i : i + 1] for k, v in columns.items()}, stats)[0] for i in range(len(completions))]

    def __call__(self, prompts: list, completions: list[str], columns: dict[str, list]) -> tuple[list[float], RewardStats]:
        """columns: 'answer' and any extra dataset columns, one value per completion."""
        stats = RewardStats()
        total = [0.0] * len(completions)
        for name, w in zip(self.names, self.weights):
            if name in BUILTIN:
                fn, vals = BUILTIN[name], []
                for i, c in enumerate(completions):
                    try:
                        vals.append(float(fn(c, **{k: v[i] for k, v in columns.items()})))
                    except Exception as e:
                        stats.errors += 1
                        log.warning("reward %s raised (%s): reward 0", name, e)
                        vals.append(0.0)
            else:
                vals = self._user(name, prompts, completions, columns, stats)
            stats.per_fn[name] = sum(vals) / max(len(vals), 1)
            total = [t + w * v for t, v in zip(total, vals)]
        self.total_errors += stats.errors
        self.total_timeouts += stats.timeouts
        return total, stats
