"""Helpers for training tests: the smoke run's task file and config (tailrl/rl/smoke.py: `write_task`, `tiny_cfg`,
its reward `tailrl.rl.smoke:count_a`), a cheaper step, and reward functions that the reward worker imports by name
(`tests.rl_helpers:hangs_and_counts`, `tests.rl_helpers:odd_prompts_only`)."""

import os
import time

from tailrl.rl.smoke import PIN_LR, tiny_cfg, write_task  # noqa: F401 (the tests' names for them)


def hangs_and_counts(prompts, completions, **_):
    """Appends a line to $TAILRL_TEST_CALLS per call, then hangs: counts how often a hanging function is called."""
    with open(os.environ["TAILRL_TEST_CALLS"], "a") as f:
        f.write(f"{len(completions)}\n")
    time.sleep(600)
    return [0.0] * len(completions)


def odd_prompts_only(prompts, completions, **_):
    """Informative only for prompts that start with an odd digit: the others' groups all get 0."""
    return [(sum(map(ord, c)) % 97) / 97 if p.strip()[:1] in "13579" else 0.0 for p, c in zip(prompts, completions)]


def small_cfg(tiny_chat, task_file, out, *extra):
    """A cheaper step (2 prompts x 4 samples of 6 tokens) for tests about what happens around a step."""
    return tiny_cfg(tiny_chat, task_file, out, "rollout.n=4", "trainer.prompts_per_step=2", "rollout.max_tokens=6",
                    "algo.mini_batch_size=8", *extra)


def check_rounds(r: dict, want: int, max_rounds: int) -> None:
    """What dynamic sampling guarantees of a step on every CPU, whatever its draws: the update holds at most `want`
    informative groups, and fewer only when the rounds ran out, which the step reports (rollout/round_limit)."""
    kept, limit = r["rollout/informative_groups"], r["rollout/round_limit"]
    assert 0 <= kept <= want and 1 <= r["rollout/gen_rounds"] <= max_rounds, r
    assert limit == float(kept < want), r
    assert not limit or r["rollout/gen_rounds"] == max_rounds, r
    assert ("actor/pg_loss" in r) == (kept > 0), r  # the update trains on the groups found, and on none without one
