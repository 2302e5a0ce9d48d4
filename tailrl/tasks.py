"""Verifiable tasks generated locally: arithmetic word problems with a difficulty spread, and Countdown.

Rows are {"prompt", "answer", "task", "level"}; easy levels give a small starting policy some reward, hard
levels make long responses (the long tail of rollout lengths). Also a prompt as chat messages (`chat_prompt`) and
the audits' workload (`audit_prompts`): the rollout and its vLLM gate use them, so this module imports nothing of
ours."""

from __future__ import annotations

import json
import random
from pathlib import Path

INSTRUCTION = "Give the final answer after ####."
NAMES = ["Ana", "Ben", "Carla", "Dev", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Jade"]
ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stickers", "cookies", "stamps"]


def arithmetic_row(rng: random.Random) -> dict:
    level = rng.choices([1, 2, 3, 4], weights=[4, 3, 2, 1])[0]
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if level == 1:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        q, ans = f"What is {a} + {b}?", a + b
    elif level == 2:
        a, b = rng.randint(10, 60), rng.randint(2, 30)
        q, ans = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
    elif level == 3:
        a, b, c = rng.randint(5, 40), rng.randint(2, 20), rng.randint(2, 9)
        q = f"{name} has {a} {item}, gives away {b}, then the rest is multiplied by {c}. How many {item} are there?"
        ans = (a - b) * c if a > b else (b - a) * c
        if a <= b:
            q = f"{name} has {b} {item}, gives away {a}, then the rest is multiplied by {c}. How many {item} are there?"
    else:
        a, b, c, d = rng.randint(2, 12), rng.randint(2, 12), rng.randint(10, 90), rng.randint(2, 5)
        q = (f"{name} buys {a} boxes with {b} {item} each, already had {c} {item}, and then shares all of them "
             f"equally with {d} friends, keeping the remainder. How many {item} does each friend get? Show your steps.")
        ans = (a * b + c) // d
    return {"prompt": f"{q} {INSTRUCTION}", "answer": str(ans), "task": "arithmetic", "level": level}


def countdown_row(rng: random.Random) -> dict:
    k = rng.choices([2, 3, 4], weights=[3, 2, 1])[0]
    nums = [rng.randint(1, 25) for _ in range(k)]
    # a reachable target: combine the numbers left to right with random + - *
    target = nums[0]
    for x in nums[1:]:
        op = rng.choice("+-*")
        target = target + x if op == "+" else target - x if op == "-" else target * x
    prompt = (f"Using the numbers {nums}, each exactly once, and + - * / with parentheses, make {target}. "
              f"Write the expression after ####.")
    return {"prompt": prompt, "answer": str(target), "task": "countdown", "level": k - 1, "numbers": nums}


TOOL_SYSTEM = ("You can use a calculator: write <calc>expression</calc> and you will get <result>value</result>. "
               "Then write the final answer after ####.")
TOOL_SHOTS = (("What is 482 * 17?", "482*17"), ("What is 1234 + 5678?", "1234+5678"))


def tool_prefix() -> list[dict]:
    """The few-shot prefix that makes SmolLM2-135M call the calculator: a system line and two exchanges (question ->
    <calc> -> <result> -> answer). From a system line alone it calls it in 0 of 16 samples, after two few-shot turns
    in 16 of 16 (measured; docs/agents.md); with the result in a user turn it then answers right."""
    out = [{"role": "system", "content": TOOL_SYSTEM}]
    for q, e in TOOL_SHOTS:
        v = eval(e, {"__builtins__": {}})  # two constant expressions of ours
        out += [{"role": "user", "content": q}, {"role": "assistant", "content": f"<calc>{e}</calc>"},
                {"role": "user", "content": f"<result>{v}</result>"}, {"role": "assistant", "content": f"#### {v}"}]
    return out


def tool_arithmetic_row(rng: random.Random) -> dict:
    """Arithmetic with 3-4 digit operands, where a 135M model is wrong without a calculator (ToRL's setting: a correct
    final answer is 1). Level 1: sums and differences; 2: products of a 3-4 digit and a 2 digit number; 3: products
    of two 3 digit numbers."""
    level = rng.choice([1, 2, 3])
    if level == 1:
        a, b, op = rng.randint(100, 9999), rng.randint(100, 9999), rng.choice("+-")
    elif level == 2:
        a, b, op = rng.randint(100, 9999), rng.randint(11, 99), "*"
    else:
        a, b, op = rng.randint(100, 999), rng.randint(100, 999), "*"
    ans = a + b if op == "+" else a - b if op == "-" else a * b
    q = f"What is {a} {op} {b}?"
    return {"prompt": tool_prefix() + [{"role": "user", "content": q}], "answer": str(ans), "task": "tool_arithmetic",
            "level": level, "question": q}


CHAIN_SYSTEM = ("You can use a calculator: write <calc>expression</calc> and you will get <result>value</result>. "
                "Work one step at a time, one calculation per turn, then write the final answer after ####.")
CHAIN_SHOTS = (("First multiply 23 by 48, then add 595 to the result.", ("23*48", "1104+595")),
               ("First multiply 124 by 16, then multiply 37 by 21, then subtract the second result from the first.",
                ("124*16", "37*21", "1984-777")))


def chain_prefix() -> list[dict]:
    """A system line and two worked exchanges of chained calls (one calculation per turn, each result used in the
    next call): a 135M model imitates the shape; carrying each result into the next call is what RL can improve."""
    out = [{"role": "system", "content": CHAIN_SYSTEM}]
    for q, steps in CHAIN_SHOTS:
        out.append({"role": "user", "content": q})
        v = None
        for e in steps:
            v = eval(e, {"__builtins__": {}})  # constant expressions of ours
            out += [{"role": "assistant", "content": f"<calc>{e}</calc>"},
                    {"role": "user", "content": f"<result>{v}</result>"}]
        out.append({"role": "assistant", "content": f"#### {v}"})
    return out


def tool_chain_row(rng: random.Random) -> dict:
    """Instructions of two or three calculations, each on earlier results: the multi-call workload (ReTool/ToRL's
    multi-turn setting at a 135M model's scale). Level 1: a*b then + or - c (two calls); 2: a*b, c*d, then their sum
    or difference (three)."""
    a, b, c, d = rng.randint(11, 99), rng.randint(11, 99), rng.randint(11, 99), rng.randint(11, 99)
    op = rng.choice("+-")
    word = {"+": "add", "-": "subtract"}[op]
    if rng.random() < 0.5:
        e = rng.randint(100, 999)
        q = f"First multiply {a} by {b}, then {word} {e} {'to' if op == '+' else 'from'} the result."
        ans, level = (a * b + e if op == "+" else a * b - e), 1
    else:
        q = (f"First multiply {a} by {b}, then multiply {c} by {d}, then {word} the second result "
             f"{'to' if op == '+' else 'from'} the first.")
        ans, level = (a * b + c * d if op == "+" else a * b - c * d), 2
    return {"prompt": chain_prefix() + [{"role": "user", "content": q}], "answer": str(ans), "task": "tool_chain",
            "level": level, "question": q}


TASKS = {"arithmetic": arithmetic_row, "countdown": countdown_row, "tool_arithmetic": tool_arithmetic_row,
         "tool_chain": tool_chain_row}


def _key(row: dict) -> str:
    return row["prompt"] if isinstance(row["prompt"], str) else json.dumps(row["prompt"])


def make_rows(task: str, n: int, seed: int = 0, levels=()) -> list[dict]:
    """n rows of a built-in task, from the given difficulty levels (all when empty)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    rng, out = random.Random(f"{task}-{seed}"), []
    for _ in range(50 * n + 1000):
        if len(out) == n:
            return out
        r = TASKS[task](rng)
        if not levels or r["level"] in levels:
            out.append(r)
    raise ValueError(f"task {task!r} gave only {len(out)} of {n} rows at levels {list(levels)}")


def split_rows(task: str, num_train: int, num_eval: int, levels=()) -> tuple[list[dict], list[dict]]:
    """Train and eval rows with distinct prompts, and no eval prompt among the train ones (held out), from the given
    difficulty levels (all when empty). Raises when the task has fewer distinct prompts than asked for."""
    evals = distinct_rows(task, num_eval, seed=1, levels=levels)
    return distinct_rows(task, num_train, seed=0, exclude={_key(r) for r in evals}, levels=levels), evals


def distinct_rows(task: str, n: int, seed: int, exclude: set[str] = frozenset(), levels=()) -> list[dict]:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    rng, seen, out = random.Random(f"{task}-{seed}"), set(exclude), []
    for _ in range(50 * n + 1000):
        if len(out) == n:
            break
        r = TASKS[task](rng)
        if levels and r["level"] not in levels:
            continue
        if _key(r) not in seen:
            seen.add(_key(r))
            out.append(r)
    if len(out) < n:
        raise ValueError(f"task {task!r} gave only {len(out)} distinct prompts of the {n} asked for")
    return out


def write_rows(rows: list[dict], out: str | Path) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def chat_prompt(prompt, system_prompt: str = "") -> list[dict]:
    msgs = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if system_prompt and not (msgs and msgs[0].get("role") == "system"):
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    return msgs


def audit_prompts(encode, k: int, seed: int = 0) -> list[list[int]]:
    """k arithmetic prompts of levels 2-3 through the chat template: the default run's workload, what `tailrl audit`
    and the vLLM gate's audit (rollout/vllm/audit.py) sample."""
    return [encode(chat_prompt(r["prompt"])) for r in make_rows("arithmetic", k, seed=seed, levels=(2, 3))]
