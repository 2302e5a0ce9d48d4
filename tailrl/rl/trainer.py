"""The GRPO/DAPO step loop over three roles: the rollout (rollout/engine.py: engine or Ray workers, speculator, learned
drafter) samples, the rewards (rewards/rewarder.py) score, the actor (actor/actor.py, or N sharded ranks: actor/group.py)
updates the policy, whose new weights then go to the rollout; checkpoints of the whole state and resume from
them (`run.train` is the run around the steps).

Invariants: a resumed run continues exactly as the run that was never stopped (rollout seeds are keyed by
(seed, step, prompt); RNG, optimizer and data position are in the checkpoint); a group of samples the engine
rejected (finish_reason "error") is left out of the update and counted in `rollout/rejected`; the loop is the
same whatever `trainer.world_size` (the actor's ranks are behind one object)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random
import time
from pathlib import Path

import torch

from ..config import PARTIAL_TIS_CAP, Config, to_dict
from ..model.load import resolve_dtype
from .actor.actor import device_of
from .algos import group_advantages
from .checkpoint.store import config_changes, load_checkpoint, save_checkpoint
from .data import Loader, fit_prompts, load_datasets, peek_rows
from .dynamic import Gathered
from .actor.forward import make_batch, mask_truncated
from .guards import StepGuard, check_rollout_labels
from .rewards.rewarder import Rewarder
from ..rollout.base import Rollout
from ..rollout.base import step_params
from ..rollout.engine import make_rollout
from ..rollout.partial import Horizon, PartialBuffer, launch_count, staleness, version_runs
from ..tasks import chat_prompt
from .samples import pick_samples, sample_steps
from .checkpoint.state_check import check_checkpoint, python_rng
from .rewards.verl import adopt_verl, warn_unknown_sources

log = logging.getLogger(__name__)


def make_actor(cfg: Config, rollout_dtype: torch.dtype):
    """(actor, the engine's model, tokenizer): at world_size=1 the Actor in process, whose fp32 master (or bf16
    copy) the engine runs; at N an ActorGroup of N sharded ranks, and the engine loads its own model."""
    if cfg.trainer.world_size == 1:
        from .actor.actor import Actor

        actor = Actor(cfg, rollout_dtype)
        return actor, actor.engine_model, actor.tokenizer
    from ..model import load_model
    from .actor.group import ActorGroup

    model, tokenizer = load_model(cfg.model.path, device=device_of(cfg), dtype=rollout_dtype)
    if tokenizer is None:
        raise ValueError(f"model {cfg.model.path!r} has no tokenizer; training needs one for prompts and rewards")
    return ActorGroup(cfg, rollout_dtype), model, tokenizer


def response_metrics(comps: list, all_comps: list) -> dict:
    """Lengths of the step's responses (the accepted ones; all of them when none was), in the model's own tokens: a
    multi-turn trajectory's tool observations and template tokens (response_mask 0) are counted apart, in
    `response_length/trajectory_mean` (everything after the prompt, which rollout.max_tokens bounds)."""
    use = comps or all_comps
    masks = [getattr(c, "response_mask", None) for c in use]
    lens = torch.tensor([len(c.token_ids) if m is None else sum(m) for c, m in zip(use, masks)], dtype=torch.float)
    out = {"response_length/mean": float(lens.mean()), "response_length/max": float(lens.max()),
           "response_length/min": float(lens.min()),
           "response_length/clip_ratio": sum(c.finish_reason == "length" for c in comps) / max(len(comps), 1),
           "response_lengths": lens.int().tolist()}
    if any(m is not None for m in masks):
        out["response_length/trajectory_mean"] = sum(len(c.token_ids) for c in use) / max(len(use), 1)
    return out


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        if cfg.rollout.partial and cfg.algo.tis_cap == 0:  # carried tokens come from older policies: weigh them
            cfg.algo.tis_cap = PARTIAL_TIS_CAP
        self.out = Path(cfg.trainer.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        random.seed(cfg.trainer.seed)
        torch.manual_seed(cfg.trainer.seed)
        rollout_dtype = resolve_dtype(cfg.model.dtype, device_of(cfg))
        # the actor holds the fp32 master (optimizer, checkpoints); the engine runs its own copy in rollout_dtype
        self.actor, engine_model, self.tokenizer = make_actor(cfg, rollout_dtype)
        # world_size > 1: the ranks hold shards, and the engine's model (same names and shapes) stands for the policy
        self.policy = self.actor.policy if cfg.trainer.world_size == 1 else engine_model
        self._check_context(engine_model.config.max_position_embeddings)
        self.samples: list[dict] = []  # rows for samples.jsonl from the last step (first, middle and last steps)
        self.rollout: Rollout = make_rollout(cfg, engine_model, self.tokenizer)
        self.last_step_s = 0.0
        self.notes = adopt_verl(cfg.data, cfg.reward, peek_rows(cfg.data.train_file))  # [] unless verl's format
        self.train_set, self.eval_set = load_datasets(cfg.data)
        warn_unknown_sources(cfg.reward.functions, self.train_set + self.eval_set)
        d = cfg.data
        self.train_set = fit_prompts(self.train_set, self.rollout.encode, d.system_prompt, d.max_prompt_tokens, "train")
        self.eval_set = fit_prompts(self.eval_set, self.rollout.encode, d.system_prompt, d.max_prompt_tokens, "eval")
        self.loader = Loader(len(self.train_set), cfg.trainer.seed)
        self.rewards = Rewarder(cfg)
        self.guard = StepGuard(cfg.trainer.max_skipped_steps)
        self.skip_reason: str | None = None  # why the last step did not update the policy
        self.phase: tuple[str, float] | None = None  # (rollout | update | eval, since): for the console's progress line
        self.step = 0
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # rollout.partial: the groups carried between steps (unfinished responses, their tokens, logprobs, versions)
        self.partial = PartialBuffer(cfg.rollout.n, cfg.rollout.partial_max_staleness) if cfg.rollout.partial else None

    def _check_context(self, ctx: int) -> None:
        c = self.cfg
        if c.rollout.max_tokens >= ctx:
            raise ValueError(f"rollout.max_tokens={c.rollout.max_tokens} does not fit the context of {c.model.path!r} "
                             f"({ctx} tokens, its max_position_embeddings), which also holds the prompt: lower it")
        if c.rollout.max_tokens + c.data.max_prompt_tokens > ctx:
            log.warning("data.max_prompt_tokens + rollout.max_tokens = %d exceeds the model's context (%d): responses "
                        "to the longest prompts are cut short", c.rollout.max_tokens + c.data.max_prompt_tokens, ctx)

    # the roles' parts, for tests and tools that inspect a trainer; the trainer's own code calls the roles only
    engine = property(lambda self: self.rollout.engine)
    head = property(lambda self: self.rollout.head)
    spot = property(lambda self: self.rollout.spot)
    drafter_trainer = property(lambda self: self.rollout.drafter_trainer)
    optimizer = property(lambda self: self.actor.optimizer)

    def close(self) -> None:
        for role in (self.rewards, self.rollout, self.actor):
            if role is not None and hasattr(role, "close"):
                role.close()

    # ---- one step --------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _phase(self, name: str, timing: dict, console: str | None = None):
        """Times a phase of the step into timing_s/<name>; console: the phase the progress line shows."""
        t = time.perf_counter()
        if console:
            self.phase = (console, t)
        try:
            yield
        finally:
            timing[f"timing_s/{name}"] = timing.get(f"timing_s/{name}", 0.0) + time.perf_counter() - t

    def train_step(self) -> dict:
        """One RL step, in its order: generate and score (rounds of them with dynamic sampling), update (_learn),
        sync the weights, evaluate."""
        cfg, timing, metrics = self.cfg, {}, {}
        t_step = time.perf_counter()
        self.samples, self.skip_reason = [], None
        got = self._rollout(timing)
        metrics.update(got.metrics())
        if self.partial is not None:  # over the trained tokens, whichever round (or the buffer) gave them
            metrics.update(staleness(got.comps, self.step))
        self.phase = ("update", time.perf_counter())
        self.rollout.sleep()
        if got.comps:
            metrics.update(self._learn(got, timing))
        elif not got.all_comps:
            self.skip_reason = "every prompt of the step was rejected by the engine"
            metrics["train/skipped_steps"] = 1
        else:  # dynamic sampling found no informative group: nothing to learn from, no error
            hint = (f"; {got.reward_only} groups' rewards differed: with a reward reward.accuracy cannot judge (shaped "
                    "or custom), set algo.filter_metric=reward") if got.reward_only else ""
            (log.warning if hint else log.info)("step %d: no informative group in %d rounds (algo.filter_metric=%s): "
                                                "no update%s", self.step + 1, got.rounds, got.metric, hint)
        with self._phase("sync", timing):
            metrics["sync/bytes"] = self.actor.sync_to(self.rollout)
            metrics.update(self.rollout.drafter_sync())
        self.rollout.wake()
        timing["timing_s/sync"] += metrics.pop("timing_s/sync", 0.0)  # Ray workers took this step's weights
        metrics.update(response_metrics(got.all_comps, got.sampled))
        self.step += 1
        if cfg.trainer.eval_every and self.step % cfg.trainer.eval_every == 0:
            with self._phase("eval", timing):
                metrics.update(self.evaluate())
        timing["timing_s/step"] = self.last_step_s = time.perf_counter() - t_step
        metrics.update(timing)
        self.phase = None
        return metrics

    def _rollout(self, timing: dict) -> Gathered:
        """Samples and scores rounds of `prompts_per_step` prompts: one round, or with `algo.dynamic_sampling`
        until that many groups with a spread of rewards are in hand or `algo.max_gen_rounds` ran (dynamic.py)."""
        cfg, n = self.cfg, self.cfg.rollout.n
        want = cfg.trainer.prompts_per_step
        got = Gathered(n, want if cfg.algo.dynamic_sampling else 0, cfg.algo.filter_metric)
        for r in range(cfg.algo.max_gen_rounds if cfg.algo.dynamic_sampling else 1):
            t = time.perf_counter()
            if self.partial is not None:  # complete groups only, some begun in earlier steps (partial.py)
                with self._phase("gen", timing, "rollout"):
                    examples, all_comps, m, tokens = self._partial_round(want - len(got.examples) if got.want else want, r)
            else:
                examples = [self.train_set[i] for i in self.loader.next(want)]
                with self._phase("gen", timing, "rollout"):
                    all_comps = self.rollout.generate(examples, self.step, self.actor.weights, self.last_step_s,
                                                      gen_round=r)
                check_rollout_labels(examples, all_comps, n)
                m, tokens = self.rollout.metrics(), sum(len(c.token_ids) for c in all_comps)
            gen_s = time.perf_counter() - t
            got.sampled += all_comps
            comps, bad = self._accepted(all_comps, n)
            got.rollout_metrics.append(({**m, "rollout/rejected": bad + m.get("rollout/rejected", 0)}, tokens, gen_s))
            rewards, correct = None, []
            if comps:
                with self._phase("reward", timing):
                    rewards, m, correct = self.rewards.score(examples, comps, n)
                got.reward_metrics.append((m, len(comps)))
            got.add(examples, comps, rewards, correct)
            if got.full:
                break
        return got

    def _partial_round(self, need: int, gen_round: int) -> tuple[list, list, dict, int]:
        """One round of partial rollouts: stale responses restart, new groups are launched up to
        rollout.partial_oversample x need in flight, the carried ones continue, and the rollout ends once `need`
        groups are complete; returns (their examples, their completions in (group, sample) order, metrics, tokens
        drawn)."""
        cfg, buf, v = self.cfg, self.partial, self.step
        r = cfg.rollout
        buf.restart_stale(v)
        carried = list(buf.groups)
        new = []
        for j, i in enumerate(self.loader.next(launch_count(r.partial_oversample, need, len(buf.groups)))):
            params = step_params(r, cfg.trainer.seed, self.step, j, gen_round)
            new.append((buf.launch(i, self.train_set[i].ids, params, v, self.rollout.start_state), params))
        m, stop = {}, None
        if buf.complete_count() < need:
            horizon = Horizon(buf, need)
            # agent.tools: each group's conversation, which its trajectories (new or carried) start from
            messages = {g.gid: chat_prompt(self.train_set[g.index].prompt, cfg.data.system_prompt)
                        for g in buf.groups} if cfg.agent.enabled else None
            comps, left, lost = self.rollout.generate_partial(
                [self.train_set[g.index].ids for g, _ in new], [p for _, p in new], [g.gid for g, _ in new],
                buf.unfinished(carried), self.step, self.last_step_s, horizon, self.actor.weights, messages=messages)
            buf.settle(comps, left, horizon, v)
            buf.restart(lost, v)
            stop = horizon.stop if horizon.stop is not None else r.max_tokens
            m = self.rollout.metrics()
        tokens = buf.counts["drawn"]
        groups = buf.take(need)
        m.update(buf.metrics(stop))
        examples = [self.train_set[g.index] for g in groups]
        comps = [dataclasses.replace(resp.comp, prompt_index=k, sample_index=j,
                                     stats={**resp.comp.stats, "policy_versions": version_runs(resp.versions)})
                 for k, g in enumerate(groups) for j, resp in enumerate(g.responses)]
        return examples, comps, m, tokens

    def evaluate(self) -> dict:
        self.phase = ("eval", time.perf_counter())
        comps = self.rollout.greedy(self.eval_set)
        if not comps:
            return {"eval/accuracy": float("nan"), "eval/reward": float("nan")}
        rewards, m, _ = self.rewards.score(self.eval_set, comps, group_size=1)
        return {"eval/accuracy": m["acc/mean"], "eval/reward": float(rewards.mean())}

    def _accepted(self, comps, n: int) -> tuple[list, int]:
        """The completions of groups the engine finished (a rejected prompt's group is dropped whole)."""
        groups = [comps[i : i + n] for i in range(0, len(comps), n)]
        bad = [g for g in groups if any(c.finish_reason == "error" for c in g)]
        if bad:
            log.warning("step %d: %d of %d prompts rejected by the engine (%s): left out of the update (rollout/rejected)",
                        self.step + 1, len(bad), len(groups), next((c.error for c in bad[0] if c.error), "no reason given"))
        return [c for g in groups if g not in bad for c in g], len(bad)

    def _learn(self, got: Gathered, timing: dict) -> dict:
        """Advantages -> policy update on the gathered groups; no optimizer step on a non-finite reward or
        advantage."""
        n, metrics = self.cfg.rollout.n, {}
        comps, rewards = got.comps, torch.tensor(got.rewards)
        if self.step + 1 in sample_steps(self.cfg.trainer.steps):
            self.samples = pick_samples(self.step + 1, [got.examples[c.prompt_index].prompt for c in comps], comps,
                                        got.rewards, got.correct)
        adv = group_advantages(rewards, n, norm_std=self.cfg.algo.advantage == "grpo")
        bad = "reward" if not torch.isfinite(rewards).all() else "advantage" if not torch.isfinite(adv).all() else None
        if bad:
            self.skip_reason = f"non-finite {bad}"
            metrics["train/skipped_steps"] = 1
            return metrics
        batch = make_batch(comps, self.pad)
        if self.cfg.algo.mask_truncated:  # the share masked is response_length/clip_ratio
            adv = mask_truncated(batch, adv, [c.finish_reason == "length" for c in comps])
        actor, self.skip_reason = self.actor.update(batch, adv, self.step, timing)
        metrics.update(actor)
        return metrics

    # ---- checkpoints -----------------------------------------------------------------------------------

    def save(self, final: bool = False) -> Path:
        t = self.cfg.trainer
        state = {"step": self.step, "optimizer": self.actor.optimizer_state(final), "loader": self.loader.state_dict(),
                 "python_rng": random.getstate(), "torch_rng": torch.get_rng_state(), **self.rollout.state(),
                 "partial": self.partial.state_dict() if self.partial is not None else None}
        return save_checkpoint(self.out / "checkpoints", self.step, self.actor, self.tokenizer, state, self._config(),
                               self.rollout.head, t.keep_checkpoints, final)

    def _config(self) -> dict:
        return json.loads(json.dumps(to_dict(self.cfg)))

    def resume(self) -> bool:
        """Loads the newest usable checkpoint (see checkpoint/store.py for the fallbacks) and says what it did. Each is
        checked against this trainer first (checkpoint/state_check.py), so that what follows cannot fail half way."""
        root = self.out / "checkpoints"
        r = self.rollout
        opt = self.actor.optimizer if self.cfg.trainer.world_size == 1 else None  # N ranks: DCP checks the shards
        got = load_checkpoint(root, lambda c: check_checkpoint(c, self.actor.shapes(dcp=c.sharded is not None), opt,
                                                               r.drafter_trainer, r.head, self.actor.tied),
                              self.cfg.trainer.trust_pickled_state)
        if got is None:
            print(f"no checkpoint in {root}: starting fresh")
            return False
        state = got.state
        if got.sharded is not None:  # written by N ranks: any world size reads it (checkpoint/sharded_io.py)
            has_opt = self.actor.load_sharded(got.sharded)
        else:
            self.actor.load(got.model, state.get("optimizer"))
            has_opt = state.get("optimizer") is not None
        self.actor.sync_to(r)
        self.step = state["step"]
        if not has_opt:
            log.warning("%s has no optimizer state (trainer.save_optimizer_final=false): Adam starts afresh", got.path)
        self.loader.load_state_dict(state["loader"])
        random.setstate(python_rng(state["python_rng"]))
        torch.set_rng_state(state["torch_rng"])
        r.load_state(state, got.drafter)
        carried = (state.get("partial") or {}).get("groups") or []
        if self.partial is not None:
            self.partial.load_state_dict(state.get("partial"))
            bad = [g.gid for g in self.partial.groups
                   if g.index >= len(self.train_set) or len(g.responses) != self.cfg.rollout.n]
            if bad:
                raise ValueError(f"the checkpoint carries partial-rollout groups {bad[:5]} that do not fit this run "
                                 f"({len(self.train_set)} train prompts, rollout.n={self.cfg.rollout.n}): resume with "
                                 "the data and rollout.n it was saved with")
        elif carried:
            log.warning("the checkpoint carries %d partial-rollout groups and rollout.partial is off now: they are "
                        "dropped (their prompts come back with the data loader's epochs)", len(carried))
        print(f"resumed from step {self.step} ({got.path})")
        changes = config_changes(got.config, self._config())
        if changes:
            print("config differs from the checkpoint's (the values given now apply):\n  " + "\n  ".join(changes))
        return True
