"""A smoke run: the tiny chat model (model/tiny.py) trained for a few steps in seconds on a CPU, on one-digit sums
(words the tiny tokenizer has) with a trivially learnable reward. What the tests' training runs and
benchmarks/sharding.py's CPU update rate run:

    from tailrl.model.tiny import make_tiny_chat_model
    from tailrl.rl.run import train
    from tailrl.rl.smoke import tiny_cfg, write_task
    train(tiny_cfg(make_tiny_chat_model("tiny"), write_task(Path("sums.jsonl")), "runs/smoke", "trainer.steps=2"))
"""

from __future__ import annotations

import json

from ..config import load_config


def count_a(prompts, completions, **_):
    """Trivially learnable: the share of 'a' among the words of a completion."""
    return [c.split().count("a") / max(len(c.split()), 1) for c in completions]


def write_task(path, n: int = 64, extra_rows=()) -> str:
    """n rows of one-digit sums ("3 + 9 =", answer "12"), then `extra_rows`, as JSONL at `path` (a Path)."""
    rows = [{"prompt": f"{i % 10} + {(i * 3) % 10} =", "answer": str(i % 10 + (i * 3) % 10)} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in [*rows, *extra_rows]) + "\n")
    return str(path)


# tests extend a run (2 steps, then resumed to 3) and compare it with a run of 3 steps: under the default cosine
# schedule over trainer.steps the two take other rates, so these runs train at a constant rate (test_trainer.py has
# the cosine run's own resume check, at one trainer.steps)
PIN_LR = ("algo.lr_schedule=constant",)


def tiny_cfg(tiny_chat, task_file, out, *extra):
    """The smoke run's config: 4 prompts x 8 samples of 8 tokens a step, `count_a` as the reward, speculation auto,
    a checkpoint every step; `extra` are dotted overrides on top."""
    return load_config(None, [
        f"model.path={tiny_chat}", f"data.train_file={task_file}", "data.num_eval=4", f"trainer.out_dir={out}",
        "reward.functions=[tailrl.rl.smoke:count_a]", "reward.weights=[1.0]", "rollout.n=8",
        "rollout.max_tokens=8", "trainer.prompts_per_step=4", "algo.lr=0.02", "algo.mini_batch_size=16",
        "algo.micro_batch_size=8", "trainer.eval_every=0", "trainer.save_every=1", "rollout.spec.mode=auto",
        "rollout.kv_cache_gb=0.1", "trainer.report=false", *PIN_LR, *extra])
