"""Help for the config: "did you mean" for an unknown key or choice, the groups for `tailrl train --help`, and the
resolved config as YAML with each key's one-line doc (`tailrl config show`).

A key's doc is the comment on its dataclass field (the trailing one, else the comment block right above it), so
the docs cannot drift from the code. Nothing here imports tailrl.config (which imports this): it walks any
dataclass it is given."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import io
import textwrap
import tokenize

import yaml

from ..cluster.config import PLACEMENTS
from ..loggers import LOGGERS
from ..speculative.config import MODES

# other trainers' names for our keys (TRL's GRPOConfig, verl's ppo_trainer.yaml), matched by a key's last part
ALIASES = {
    "learning_rate": "algo.lr", "num_generations": "rollout.n", "max_completion_length": "rollout.max_tokens",
    "max_response_length": "rollout.max_tokens", "max_prompt_length": "data.max_prompt_tokens",
    "max_new_tokens": "rollout.max_tokens", "beta": "algo.kl_coef", "kl_loss_coef": "algo.kl_coef",
    "kl_loss_type": "algo.kl_type", "epsilon": "algo.clip_low", "clip_ratio": "algo.clip_low",
    "clip_ratio_low": "algo.clip_low", "epsilon_high": "algo.clip_high", "clip_ratio_high": "algo.clip_high",
    "loss_type": "algo.loss_agg", "loss_agg_mode": "algo.loss_agg", "adv_estimator": "algo.advantage",
    "scale_rewards": "algo.advantage", "num_iterations": "algo.ppo_epochs", "ppo_mini_batch_size": "algo.mini_batch_size",
    "ppo_micro_batch_size_per_gpu": "algo.micro_batch_size", "per_device_train_batch_size": "algo.micro_batch_size",
    "max_grad_norm": "algo.grad_clip", "max_steps": "trainer.steps", "total_training_steps": "trainer.steps",
    "train_batch_size": "trainer.prompts_per_step", "eval_steps": "trainer.eval_every", "test_freq": "trainer.eval_every",
    "save_steps": "trainer.save_every", "save_freq": "trainer.save_every", "output_dir": "trainer.out_dir",
    "default_local_dir": "trainer.out_dir", "report_to": "trainer.loggers", "logger": "trainer.loggers",
    "project_name": "trainer.project", "experiment_name": "trainer.run_name", "model_name_or_path": "model.path",
    "train_files": "data.train_file", "val_files": "data.eval_file", "reward_funcs": "reward.functions",
    "reward_weights": "reward.weights", "dataset": "data.train_file", "dtype": "model.dtype",
    "mask_truncated_completions": "algo.mask_truncated", "loss_mode": "algo.loss", "policy_loss_type": "algo.loss",
    "overlong_buffer_len": "reward.overlong_buffer", "overlong_penalty_factor": "reward.overlong_penalty",
    "lr_scheduler_type": "algo.lr_schedule", "warmup_steps": "algo.lr_warmup_steps",
    "filter_groups": "algo.dynamic_sampling", "max_num_gen_batches": "algo.max_gen_rounds",
}

# keys that existed, and why they are gone (an old config gets the reason, not a guess)
_TAIL = "the long tail has one definition, at most a quarter of the rollout's sequences running (engine/tail.py)"
REMOVED = {"drafter.spot_batch": _TAIL, "drafter.spot_frac": _TAIL}

GROUPS = {
    "model": "the policy: a known name, HF folder or .gguf; device; engine dtype and the update's compute",
    "data": "a JSONL/Parquet (verl's format too) or a built-in task; prompt/answer columns; system prompt",
    "rollout": "sampling (n, max_tokens, temperature), KV cache, Ray workers",
    "rollout.spec": "speculative decoding: mode (auto/off/history/ngram/learned/self), budgets, history and self drafters",
    "algo": "GRPO/DAPO: advantages, policy loss (ppo/gspo/cispo), clipping, loss aggregation, KL, batches, lr, TIS",
    "reward": "reward functions (built-ins, verl's data_source routing, module:function), weights, timeouts, overlong penalty",
    "trainer": "steps, prompts per step, eval/save cadence, run folder, resume, loggers (console/jsonl/tensorboard/wandb)",
    "drafter": "the learned EAGLE drafter (off by default): warm start, online spot training",
    "cluster": "several rollout workers (rollout.workers > 1): Ray address, placement, migration",
    "agent": "multi-turn tool rollouts (docs/agents.md): tools, turns, call format, observation truncation, tool pool",
}


# keys whose value is one of a few names (a list-valued key: each item)
CHOICES = {
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.train_compute": ("auto", "float32", "autocast", "bfloat16"),
    "rollout.spec.mode": MODES,
    "rollout.spec.das": ("share", "extend"),
    "rollout.backend": ("tailrl", "vllm"),
    "rollout.vllm_spec": ("auto", "tailrl", "ngram", "suffix", "off"),
    "algo.advantage": ("grpo", "dr_grpo"),
    "algo.loss_agg": ("auto", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
    "algo.filter_metric": ("acc", "reward"),
    "algo.loss": ("ppo", "gspo", "cispo"),
    "algo.lr_schedule": ("constant", "cosine"),
    "algo.kl_type": ("k1", "k3"),
    "agent.format": ("tags", "hermes"),
    "agent.truncate_side": ("left", "right", "middle"),
    "reward.accuracy": ("auto", "math", "math_strict", "countdown", "verl"),
    "cluster.placement": PLACEMENTS,
    "trainer.loggers": LOGGERS,
}


def choice_problem(cfg) -> str | None:
    """Why a value is outside its key's choices (listing them, and the nearest one), or None."""
    for key, choices in CHOICES.items():
        value = functools.reduce(getattr, key.split("."), cfg)
        for v in value if isinstance(value, list) else [value]:
            if v not in choices:
                return f"bad value {v!r} for {key}: {choice_hint(v, choices)}"
    return None

# docs for fields that carry no comment in their own module
DOCS = {
    "rollout.spec.init_depth": "a request's first draft depth", "rollout.spec.min_depth": "the adaptive depth's floor",
    "rollout.spec.match_offset": "history: see match_factor", "rollout.spec.max_match": "history: longest suffix matched",
    "rollout.spec.seed": "draft sampling seed", "drafter.weight_decay": "AdamW weight decay of the head",
    "drafter.warmup_steps": "lr warm-up steps", "drafter.grad_clip": "gradient norm clip",
    "drafter.hidden_weight": "weight of the SmoothL1 term on the next hidden state",
    "drafter.ce_weight": "weight of the soft cross-entropy term",
}


def _similar(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def did_you_mean(key: str, keys: list[str], n: int = 3) -> list[str]:
    """The valid keys nearest an unknown one, best first: another trainer's name for it (ALIASES), keys with the
    same last part (verl's `actor_rollout_ref.actor.optim.lr` -> `algo.lr`), then close spellings of the whole key
    or of its last part. Empty when nothing is close."""
    leaf = key.rsplit(".", 1)[-1]
    section = key.rsplit(".", 1)[0] if "." in key else ""
    out = [ALIASES[leaf]] if ALIASES.get(leaf) in keys else []
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    out += sorted(same_leaf, key=lambda k: not k.startswith(section + "."))
    out += [k for k in keys if k.startswith(key) and "." in key]  # a key cut short: algo.kl -> algo.kl_coef
    if out:  # another trainer's name, the same last part or a key cut short: no guessing beyond them
        return list(dict.fromkeys(out))[:n]
    scored = [(max(_similar(key, k), _similar(leaf, k.rsplit(".", 1)[-1]) - 0.05), k) for k in keys]
    # a misspelt name from another trainer (algo.learning_rat, num_generation) is answered with the key it means
    scored += [(_similar(leaf, alias), ALIASES[alias]) for alias in ALIASES if ALIASES[alias] in keys]
    scored.sort(reverse=True)
    if scored and scored[0][0] >= 0.6:
        best = scored[0][0]
        out += [k for s, k in scored if s >= max(0.6, best - 0.06)]
    return list(dict.fromkeys(out))[:n]


def choice_hint(value, choices) -> str:
    """', choose one of a, b, c' plus the nearest choice when the value looks like a typo of it."""
    near = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"choose one of {', '.join(map(str, choices))}" + (f" (did you mean {near[0]}?)" if near else "")


def or_list(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


@functools.lru_cache(maxsize=None)
def field_docs(cls) -> dict[str, str]:
    """{field: one-line doc} from the comments on a dataclass's fields (trailing, else the block above)."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments = {t.start[0]: t.string.lstrip("#").strip() for t in tokenize.generate_tokens(io.StringIO(src).readline)
                if t.type == tokenize.COMMENT}
    lines = src.splitlines()
    docs = {}
    for node in ast.parse(src).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        text = comments.get(node.lineno)
        if text is None:  # the comment block right above the field
            block, ln = [], node.lineno - 1
            while ln >= 1 and lines[ln - 1].strip().startswith("#"):
                block.insert(0, comments.get(ln, ""))
                ln -= 1
            text = " ".join(block)
        docs[node.target.id] = _one_line(text)
    return docs


def _one_line(text: str, width: int = 110) -> str:
    """The first sentence, cut at a word boundary to `width` characters."""
    text = " ".join(text.split())
    text = text.split(". ", 1)[0]
    return text if len(text) <= width else text[: width - 3].rsplit(" ", 1)[0] + " ..."


def _scalar(v) -> str:
    if isinstance(v, tuple):
        v = list(v)
    return yaml.safe_dump(v, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def show_yaml(cfg, prefix: str = "", indent: int = 0) -> str:
    """The config as YAML that `tailrl train` reads back, each key with its doc as a comment."""
    docs = field_docs(type(cfg))
    out = []
    for f in dataclasses.fields(cfg):
        v, pad, name = getattr(cfg, f.name), "  " * indent, prefix + f.name
        if dataclasses.is_dataclass(v):
            about = GROUPS.get(name) or docs.get(f.name, "")
            out.append(f"{pad}{f.name}:" + (f"  # {about}" if about else ""))
            out.append(show_yaml(v, name + ".", indent + 1))
        else:
            doc = docs.get(f.name) or DOCS.get(name, "")
            out.append(f"{pad}{f.name}: {_scalar(v)}" + (f"  # {doc}" if doc else ""))
    return "\n".join(out)


def groups_help() -> str:
    """The config groups, for `tailrl train --help`."""
    width = max(map(len, GROUPS))
    rows = "\n".join(f"  {g:<{width}}  {about}" for g, about in GROUPS.items())
    return (f"config groups (set any key as group.key=value; `tailrl config show` lists every key with its doc):\n{rows}\n\n"
            "examples:\n  tailrl train my.yaml algo.lr=1e-5 rollout.n=16\n"
            "  tailrl train data.train_file=gsm8k/train.parquet data.eval_file=gsm8k/test.parquet trainer.loggers=[console,wandb]")
