"""Rewards: final-answer math verification, format, Countdown, and user functions named `module:function`.

A user function has TRL's signature: f(prompts, completions, answer=..., **extra_columns) -> list[float].
`reward_runner.RewardRunner` runs them in a worker process with a time limit."""

from __future__ import annotations

import ast
import math
import operator
import re
from collections import Counter

from ...user_code import load_object
from .verl import verl_reward

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


def math_strict_reward(completion: str, answer: str, **_) -> float:
    """`math`, and `####` written once: with room for 1,024 tokens a policy paid by `math` learned to enumerate
    '#### k = k' lines until the last one matched (responses doubled each epoch; docs/long-responses.md)."""
    return math_reward(completion, answer) if completion.count("####") == 1 else 0.0


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


_ANSWER_LINE = re.compile(r"####[ \t]*(?:" + _NUM.pattern + r")[ \t]*\.?")


def format_reward(completion: str, **_) -> float:
    """1 for a response that ends with one clean answer line, '#### <number>' (and writes '####' nowhere else), or
    with a \\boxed{} answer. Looser checks were gamed: a policy paid for any number after the last '####' learned
    to spam '#### 9 + 2 = 17' lines instead of answering."""
    text = completion.strip()
    if "####" not in text:
        pred = extract_answer(text)  # \boxed{}
        return 1.0 if pred is not None and _to_number(pred) is not None else 0.0
    last = text.splitlines()[-1].strip()
    return 1.0 if text.count("####") == 1 and _ANSWER_LINE.fullmatch(last) else 0.0


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


BUILTIN = {"math": math_reward, "math_strict": math_strict_reward, "math_partial": math_partial_reward,
           "format": format_reward, "countdown": countdown_reward, "verl": verl_reward}


DEFAULT_WEIGHTS = {"format": 0.2}  # a shaping term; every other function counts 1.0 unless reward.weights says


def reward_weights(names: list[str], weights: list[float] | None) -> list[float]:
    """The weight of each reward function: reward.weights when given (one per function), else the default."""
    if weights:
        if len(weights) != len(names):
            raise ValueError(f"{len(weights)} reward weights for {len(names)} reward functions ({', '.join(names)})")
        return [float(w) for w in weights]
    return [DEFAULT_WEIGHTS.get(n, 1.0) for n in names]


def accuracy_name(setting: str, names: list[str]) -> str:
    """reward.accuracy resolved: 'auto' is countdown when the countdown reward is in use, verl when verl is,
    math_strict when it is, else math."""
    if setting == "auto":
        setting = next((n for n in ("countdown", "verl", "math_strict") if n in names), "math")
    if setting not in ("math", "math_strict", "countdown", "verl"):
        raise ValueError(f"reward.accuracy={setting!r}: choose auto, math, math_strict, countdown or verl")
    return setting


def accuracy_verifier(setting: str, names: list[str]):
    """The strict 0/1 verifier behind acc/mean, whatever the shaped reward is: reward.accuracy, where 'auto'
    means the Countdown checker when the countdown reward is in use, verl's routing when `verl` is, and
    final-answer math otherwise. A verifier that raises (verl: an unknown data_source) counts the sample wrong."""
    fn = BUILTIN[accuracy_name(setting, names)]

    def verifier(completion: str, **columns) -> bool:
        try:
            return bool(fn(completion, **columns))
        except Exception:  # counted in reward/errors by the reward runner when the same function scores
            return False

    return verifier


def load_function(spec: str):
    """`module:function`; the module is looked up on sys.path and then in the current directory (as TRL
    users expect). Errors name the function and what went wrong (missing module, syntax error, ...)."""
    if ":" not in spec:
        from ...config.help import choice_hint

        raise ValueError(f"reward function {spec!r}: {choice_hint(spec, list(BUILTIN))} or give 'module:function'")
    fn = load_object(spec, "reward function")
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    return fn

