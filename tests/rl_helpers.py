"""Helpers for training tests: a tiny task file, a tiny training config and reward functions that the
reward worker imports by name (`tests.rl_helpers:count_a`)."""

import json
import os
import time

from tailrl.config import load_config


def count_a(prompts, completions, **_):
    """Trivially learnable: the share of 'a' among the words of a completion."""
    return [c.split().count("a") / max(len(c.split()), 1) for c in completions]


def hangs_and_counts(prompts, completions, **_):
    """Appends a line to $TAILRL_TEST_CALLS per call, then hangs: counts how often a hanging function is called."""
    with open(os.environ["TAILRL_TEST_CALLS"], "a") as f:
        f.write(f"{len(completions)}\n")
    time.sleep(600)
    return [0.0] * len(completions)


def write_task(path, n: int = 64, extra_rows=()) -> str:
    rows = [{"prompt": f"{i % 10} + {(i * 3) % 10} =", "answer": str(i % 10 + (i * 3) % 10)} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in [*rows, *extra_rows]) + "\n")
    return str(path)


# tests extend a run (2 steps, then resumed to 3) and compare it with a run of 3 steps: under the default cosine
# schedule over trainer.steps the two take other rates, so these runs train at a constant rate (test_trainer.py has
# the cosine run's own resume check, at one trainer.steps)
PIN_LR = ("algo.lr_schedule=constant",)


def tiny_cfg(tiny_chat, task_file, out, *extra):
    return load_config(None, [
        f"model.path={tiny_chat}", f"data.train_file={task_file}", "data.num_eval=4", f"trainer.out_dir={out}",
        "reward.functions=[tests.rl_helpers:count_a]", "reward.weights=[1.0]", "rollout.n=8",
        "rollout.max_tokens=8", "trainer.prompts_per_step=4", "algo.lr=0.02", "algo.mini_batch_size=16",
        "algo.micro_batch_size=8", "trainer.eval_every=0", "trainer.save_every=1", "rollout.spec.mode=auto",
        "rollout.kv_cache_gb=0.1", "trainer.report=false", *PIN_LR, *extra])


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
