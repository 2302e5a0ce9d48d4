"""A few sampled completions per chosen step, for `samples.jsonl` and the report: what the model wrote at the
first, middle and last steps, with its reward.

Invariant: the choice depends only on (step, total steps, rewards), so a resumed run logs the rows the original
would have; each logged step has its best and its worst completion (ties: the earliest), then others."""

from __future__ import annotations

SAMPLES_PER_STEP = 4


def sample_steps(total: int) -> set[int]:
    """The steps (1-based) whose completions are logged: first, middle, last."""
    return {1, max(1, (total + 1) // 2), total}


def prompt_text(prompt) -> str:
    """A row's prompt as text: chat messages -> the last user message."""
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1] if users else prompt)
    return str(prompt)


def pick_samples(step: int, prompts: list, comps, rewards: list[float], correct: list[bool],
                 k: int = SAMPLES_PER_STEP) -> list[dict]:
    """Rows {step, prompt, completion, reward, correct, length, finish_reason}: the best and the worst completion
    of the step, then the step's others in order, up to k rows."""
    if not comps:
        return []
    order = range(len(comps))
    best = max(order, key=lambda i: (rewards[i], -i))
    worst = min(order, key=lambda i: (rewards[i], i))
    picks = list(dict.fromkeys([best, worst, *order]))[:k]
    return [{"step": step, "prompt": prompt_text(prompts[i]), "completion": comps[i].text, "reward": float(rewards[i]),
             "correct": bool(correct[i]), "length": len(comps[i].token_ids), "finish_reason": comps[i].finish_reason,
             # partial rollouts: which policy version drew which tokens, as [version, tokens] runs
             **({"policy_versions": comps[i].stats["policy_versions"]} if "policy_versions" in (comps[i].stats or {})
                else {}),
             # multi-turn: the conversation (prompt, model turns, observations) and the tool calls made
             **(getattr(comps[i], "trajectory", None) or {})}
            for i in picks]
