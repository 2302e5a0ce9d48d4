"""verl's dataset format as it is, and verl's rule-based rewards routed by `data_source`.

A verl dataset (what `examples/data_preprocess/gsm8k.py` and `math_dataset.py` write) has the columns
`data_source`, `prompt` (chat messages), `ability`, `reward_model: {style, ground_truth}` and `extra_info`. When a
train file looks like that and data.prompt_key/answer_key are at their defaults, `adopt_verl` takes the answer from
`reward_model.ground_truth`, drops the built-in task's system prompt (verl's prompts carry their instruction) and,
when reward.functions is the default, scores with `verl_reward`, which routes as verl's `default_compute_score`:

- `openai/gsm8k`: the strict rule, the last `#### <number>` equal to the ground truth as text (commas and `$`
  dropped), as verl's gsm8k.compute_score;
- MATH sources and DAPO's (`math_dapo`, `aime*`): the last `\\boxed{...}` (for DAPO's prompt also a final
  `Answer: ...` line) checked against the ground truth by math-verify;
- any other source raises a ValueError naming it: that sample gets 0, counted in `reward/errors`.

Rewards are 1/0 (verl's math_dapo gives -1 for a wrong answer; with std-normalised GRPO advantages the two scales
give the same update)."""

from __future__ import annotations

import logging
import re
import threading

from ...config import DataCfg, RewardCfg

log = logging.getLogger(__name__)

VERL_ANSWER_KEY = "reward_model.ground_truth"
GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGMU/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "BytedTsinghua-SIA/DAPO-Math-17k")
_GSM8K = re.compile(r"#### (\-?[0-9\.\,]+)")
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_CLIP_CHARS = 300  # verl scores only a response's last 300 characters (a regex over a long response is slow)


def rule_for(source) -> str:
    """'gsm8k' | 'math' | 'dapo' for a data_source; a ValueError naming an unknown one."""
    if source in GSM8K_SOURCES:
        return "gsm8k"
    if source in MATH_SOURCES:
        return "math"
    if source in DAPO_SOURCES or (isinstance(source, str) and source.startswith("aime")):
        return "dapo"
    raise ValueError(f"no verl reward rule for data_source {source!r} (known: {', '.join(known_sources())}, aime*)")


def known_sources() -> tuple[str, ...]:
    return GSM8K_SOURCES + MATH_SOURCES + DAPO_SOURCES


def gsm8k_score(completion: str, ground_truth: str) -> float:
    found = _GSM8K.findall(completion[-_CLIP_CHARS:])
    return 1.0 if found and found[-1].replace(",", "").replace("$", "") == str(ground_truth) else 0.0


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None when there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def math_equal(pred: str, ground_truth: str) -> bool:
    """math-verify's equivalence of two LaTeX answers (its signal-based time limit only works in the main thread)."""
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()
    limit = 5 if main else None
    gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=limit)
    got = parse(f"\\boxed{{{pred}}}", parsing_timeout=limit)
    if not gold or not got:
        return pred.strip() == str(ground_truth).strip()
    return bool(verify(gold, got, timeout_seconds=limit))


def math_score(completion: str, ground_truth: str, answer_line: bool = False) -> float:
    pred = last_boxed(completion)
    if pred is None and answer_line:  # DAPO's prompt asks for a last line 'Answer: $Answer'
        found = _ANSWER_LINE.findall(completion[-_CLIP_CHARS:])
        pred = found[-1].strip().strip("$").strip() if found else None
    return 1.0 if pred is not None and math_equal(pred, str(ground_truth)) else 0.0


def verl_reward(completion: str, answer: str, data_source=None, **_) -> float:
    """verl's default_compute_score for the sources above; a ValueError for any other (the runner counts it)."""
    rule = rule_for(data_source)
    if rule == "gsm8k":
        return gsm8k_score(completion, answer)
    return math_score(completion, answer, answer_line=rule == "dapo")


def looks_verl(rows: list) -> bool:
    """Rows with verl's columns: data_source, prompt as chat messages, reward_model {.., ground_truth}."""
    rows = [r for r in rows if isinstance(r, dict)]
    return bool(rows) and all(
        "data_source" in r and isinstance(r.get("prompt"), list) and isinstance(r.get("reward_model"), dict)
        and "ground_truth" in r["reward_model"] for r in rows)


def adopt_verl(data, reward, rows: list) -> list[str]:
    """For a verl-format file (rows: its first few) with the keys left at their defaults: the answer from
    reward_model.ground_truth, no built-in system prompt, and the `verl` reward when reward.functions is the
    default. Changes `data` and `reward` (DataCfg, RewardCfg) in place; returns one line per change made."""
    if not (looks_verl(rows) and data.prompt_key == "prompt" and data.answer_key == "answer"):
        return []
    notes = [f"data: verl's format (data_source, prompt messages, reward_model, extra_info): answers from "
             f"{VERL_ANSWER_KEY}; data_source and extra_info reach reward functions"]
    data.answer_key = VERL_ANSWER_KEY
    if data.system_prompt == DataCfg().system_prompt:
        data.system_prompt = ""
        notes.append("data: no system prompt added (verl's prompts carry their instruction)")
    if reward.functions == RewardCfg().functions:
        reward.functions = ["verl"]
        notes.append("reward: verl (by data_source, as verl's default_compute_score: openai/gsm8k -> strict '#### "
                     "<number>'; MATH and DAPO sources -> \\boxed{} checked by math-verify)")
    if reward.accuracy == "auto" and "verl" in reward.functions:
        reward.accuracy = "verl"
    return notes


def unknown_sources(examples) -> dict:
    """{data_source: rows} of the sources verl_reward has no rule for."""
    out: dict = {}
    for ex in examples:
        src = ex.columns.get("data_source")
        try:
            rule_for(src)
        except ValueError:
            out[src] = out.get(src, 0) + 1
    return out


def warn_unknown_sources(functions: list[str], examples) -> None:
    """Says at start which rows the `verl` reward cannot score (each of their samples counts in reward/errors)."""
    unknown = unknown_sources(examples) if "verl" in functions else {}
    if unknown:
        log.warning("reward verl has no rule for data_source %s: their samples get 0 (reward/errors); known: %s",
                    ", ".join(f"{s!r} ({n} rows)" for s, n in unknown.items()), ", ".join(known_sources()))
