"""`tailrl eval`: score a model on held-out prompts with n samples each: pass@1 (the mean over n), pass@k (the
unbiased estimator of Chen et al. 2021), maj@k, mean length and the truncated share, and a JSONL of completions.

Invariants:
- For a run or a checkpoint, the defaults are the run's: its eval set, system prompt, max_tokens, accuracy
  verifier, engine dtype and engine settings, so `--n 1` at temperature 0 reproduces the run's `eval/accuracy`
  (the trainer's evaluation is greedy decoding of the eval prompts through the same path).
- At temperature 0 the n samples of a prompt are one greedy completion (decoding is deterministic), so it is
  generated once and counted n times.
- A sample is correct when its reward is at least 1 (full credit; the verifiers give 0 or 1). A prompt the engine
  rejects is left out of the scores, as the trainer's evaluation leaves it out, and is counted."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from math import comb
from pathlib import Path

from ..config import Config, ConfigError, load_config
from .actor.lora_io import is_adapter, load_any
from .checkpoint.store import candidates
from .data import fit_prompts, load_datasets, peek_rows, read_table, to_examples
from .rewards.builtin import accuracy_name, extract_answer
from ..tasks import TASKS, chat_prompt
from .rewards.verl import adopt_verl

log = logging.getLogger(__name__)


@dataclass
class Source:
    model: str  # what load_model takes
    cfg: Config  # the run's config (the defaults for a bare model)
    label: str  # what was found, for the console
    run_dir: Path | None = None
    ckpt: Path | None = None


def resolve_source(path: str) -> Source:
    """A run folder (its latest checkpoint), a checkpoint folder, an HF folder, a .gguf or a known model name."""
    p = Path(path)
    if (p / "checkpoints").is_dir():
        found = [c for c in candidates(p / "checkpoints") if _has_model(c / "model")]
        if not found:
            raise ValueError(f"run folder {path!r} has no checkpoint yet (checkpoints/ is empty)")
        return _from_checkpoint(found[0], p, f"run {p}, checkpoint {found[0].name}")
    if _has_model(p / "model") and (p / "config.json").is_file():
        return _from_checkpoint(p, p.parent.parent if p.parent.name == "checkpoints" else None, f"checkpoint {p}")
    from ..model import resolve_model_path

    if not is_adapter(p):  # an adapter folder (PEFT's) names its base; load_any checks it
        resolve_model_path(path)  # a missing model fails before anything is read or written
    return Source(path, Config(), f"model {path}")


def _has_model(folder: Path) -> bool:
    """An HF export, or a LoRA run's adapter (PEFT's format)."""
    return (folder / "config.json").is_file() or is_adapter(folder)


def _from_checkpoint(ckpt: Path, run_dir: Path | None, label: str) -> Source:
    try:  # the run's config.json is YAML too
        cfg = load_config(str(ckpt / "config.json"))
    except ConfigError as e:
        log.warning("%s: the run's config does not load (%s): using the defaults", ckpt / "config.json", e)
        cfg = Config()
    return Source(str(ckpt / "model"), cfg, label, run_dir, ckpt)


def eval_set(cfg: Config, data: str | None, limit: int | None) -> tuple[list, list[str], str]:
    """(examples, notes, label): the run's held-out prompts by default, a dataset file (read with the run's keys,
    verl's format found by itself) or a built-in task's held-out split. Changes cfg.data/cfg.reward in place for a
    verl file, as a run would."""
    notes: list[str] = []
    d = cfg.data
    if data is None or data in TASKS:
        if data is not None:  # the task's own held-out split, whatever the run trained on
            d.task, d.levels, d.train_file, d.eval_file = data, d.levels if data == d.task else [], "", ""
        if limit and not (data is None and d.train_file):
            d.num_eval = limit  # a task's first n held-out prompts: its split's own first n
        examples = load_datasets(dataclasses.replace(d, num_train=0) if not d.train_file else d)[1]
        label = f"{d.task} held-out" if not d.train_file or data else "the run's eval set"
    elif Path(data).is_file():
        notes = adopt_verl(d, cfg.reward, peek_rows(data))
        examples, label = to_examples(read_table(data), d.prompt_key, d.answer_key, data), Path(data).name
    else:
        raise ValueError(f"--data {data!r}: not a file, nor a built-in task ({', '.join(TASKS)})")
    return (examples[:limit] if limit else examples), notes, label


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def _norm(answer: str | None) -> str | None:
    return None if answer is None else answer.replace(",", "").replace("$", "").strip().rstrip(".").strip()


def majority_correct(texts: list[str], correct: list[bool]) -> bool:
    """maj@k: the most frequent final answer (#### or \\boxed{}) among the samples is a correct one (ties: the
    answer seen first); samples without an answer do not vote."""
    preds = [_norm(extract_answer(t)) for t in texts]
    votes = Counter(p for p in preds if p)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(p for p in preds if p and votes[p] == top)
    return correct[preds.index(winner)]


def summarize(groups: list[list[dict]], n: int) -> dict:
    """Scores over prompts from their samples' rows (reward, correct, length, finish_reason)."""
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, n) if k <= n})
    out = {"prompts": len(groups), "samples": n}
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(r["correct"] for r in g), k) for g in groups) / max(len(groups), 1)
    if n > 1:
        out[f"maj@{n}"] = sum(majority_correct([r["completion"] for r in g], [r["correct"] for r in g])
                              for g in groups) / max(len(groups), 1)
    rows = [r for g in groups for r in g]
    out["mean_reward"] = sum(r["reward"] for r in rows) / max(len(rows), 1)
    out["mean_length"] = sum(r["length"] for r in rows) / max(len(rows), 1)
    out["truncated"] = sum(r["finish_reason"] == "length" for r in rows) / max(len(rows), 1)
    return out


def run_eval(src: Source, examples: list, n: int, temperature: float, max_tokens: int, reward: str | None,
             seed: int, out: Path, device: str | None = None, progress: bool = False) -> dict:
    """Generates n samples per example with the speculative engine, scores them and writes the JSONL to out."""
    import torch

    from ..drafter.compose import make_speculator
    from ..engine import Engine, EngineConfig, SamplingParams
    from ..engine.stats import progress_bar
    from ..rollout.base import requests_of
    from ..rollout.turns import TurnLoop
    from .rewards.runner import RewardRunner

    cfg = src.cfg
    device = device or cfg.model.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_any(src.model, device=device, dtype=cfg.model.dtype)  # an adapter folder: merged
    if tokenizer is None:
        raise ValueError(f"model {src.model!r} has no tokenizer; evaluation needs one for prompts and rewards")
    r, d = cfg.rollout, cfg.data
    spec = r.spec if r.spec.mode != "learned" else dataclasses.replace(r.spec, mode="auto")  # no learned head here
    try:
        engine = Engine(model, tokenizer, EngineConfig(
            kv_cache_gb=r.kv_cache_gb, max_num_seqs=r.max_num_seqs, seed=seed, spec=spec, cuda_graphs=r.cuda_graphs,
            batch_invariant=r.batch_invariant, prefix_cache=r.prefix_cache,
            max_model_len=min(d.max_prompt_tokens + max_tokens, model.config.max_position_embeddings)),
            make_speculator(spec))
    except RuntimeError as e:  # batch_invariant=true where the engine's start-up probe found the kernels vary
        raise ValueError(str(e)) from e
    # one turn loop for both (rollout/turns.py): with agent.tools the held-out prompts run the tools as in training
    loop = TurnLoop(cfg.agent, tokenizer)
    encode = loop.encode_prompt if loop.turns is not None else engine.encode
    examples = fit_prompts(examples, encode, d.system_prompt, d.max_prompt_tokens, "eval")
    gen_n = 1 if temperature == 0 else n  # greedy: one completion stands for the n samples
    params = [SamplingParams(n=gen_n, max_tokens=max_tokens, temperature=temperature, top_p=r.top_p if temperature else 1.0,
                             top_k=r.top_k if temperature else 0, seed=seed * 1_000_003 + i) for i in range(len(examples))]
    msgs = [chat_prompt(ex.prompt, d.system_prompt) for ex in examples]
    try:
        with progress_bar(gen_n * len(examples), progress and loop.turns is None) as bar:
            comps, _, agent_metrics, _ = loop.run(engine, requests_of([ex.ids for ex in examples], params, msgs),
                                                  on_step=lambda out: bar.update(len(out.finished)))
    finally:
        loop.close()
    if loop.turns is None:  # the rollout ended: the history drafter keeps its responses, as Engine.generate does
        engine.end_rollout(comps.stats)
    name = reward or accuracy_name(cfg.reward.accuracy, cfg.reward.functions)
    runner = RewardRunner([name], timeout_s=cfg.reward.timeout_s, max_failed_steps=10**9)
    try:
        ok = [c for c in comps if c.finish_reason != "error"]
        cols = {"answer": [examples[c.prompt_index].answer for c in ok]}
        for key in examples[0].columns if examples else ():
            cols[key] = [examples[c.prompt_index].columns.get(key) for c in ok]
        rewards, stats = runner([examples[c.prompt_index].prompt for c in ok], [c.text for c in ok], cols)
    finally:
        runner.close()
    scored = dict(zip((id(c) for c in ok), rewards))
    groups, rejected = [], 0
    for i, ex in enumerate(examples):
        mine = comps[i * gen_n : (i + 1) * gen_n]
        if any(c.finish_reason == "error" for c in mine):
            rejected += 1
            continue
        rows = [{"index": i, "sample": j, "prompt": ex.prompt, "answer": ex.answer, "completion": c.text,
                 "reward": scored[id(c)], "correct": scored[id(c)] >= 1.0,
                 "length": sum(c.response_mask) if c.response_mask is not None else len(c.token_ids),
                 "finish_reason": c.finish_reason, "pred": extract_answer(c.text),
                 **({"tool_calls": c.trajectory["tool_calls"]} if c.trajectory else {})}
                for j, c in enumerate(mine * (n // gen_n))]
        groups.append(rows)
    _write_jsonl(out, [r for g in groups for r in g])
    summary = summarize(groups, n)
    summary.update({"reward": name, "rejected": rejected, "reward_errors": stats.errors + stats.timeouts,
                    "tokens_per_s": comps.stats.tokens_per_s, "accept_length": comps.stats.metrics().get("spec/accept_length")})
    if loop.turns is not None:
        summary.update({k.split("/", 1)[1]: agent_metrics[k] for k in ("agent/tool_calls", "agent/turns",
                                                                       "agent/tool_errors") if k in agent_metrics})
    return summary


def _write_jsonl(out: Path, rows: list[dict]) -> None:
    tmp = out.with_name(f".{out.name}.tmp")
    with tmp.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, out)  # readers never see half a file
