"""The GRPO/DAPO step: rollout (speculative engine) -> rewards -> advantages -> policy update -> weights to the
engine; checkpoints of the trainer's state and resume from them (`run.train` is the run around the steps).

Invariants: a resumed run continues exactly as the run that was never stopped (rollout seeds are keyed by
(seed, step, prompt); RNG, optimizer and data position are in the checkpoint); a group of samples the engine
rejected (finish_reason "error") is left out of the update and counted in `rollout/rejected`."""

from __future__ import annotations

import copy
import json
import logging
import random
import time
from pathlib import Path

import torch

from ..config import Config, to_dict
from ..drafter.compose import make_speculator
from ..drafter.eagle import EagleDrafter, load_drafter
from ..drafter.propose import LearnedDrafter
from ..drafter.train import DrafterTrainer, SpotLender, SpotTrainer
from ..engine import Engine, EngineConfig, SamplingParams
from ..model import load_model
from ..model.load import resolve_dtype
from .algos import group_advantages
from .checkpoint import config_changes, load_checkpoint, save_checkpoint
from .data import Example, Loader, fit_prompts, load_datasets, peek_rows
from .forward import make_batch
from .guards import StepGuard, check_rollout_labels
from .multi_worker import cluster_rollout, make_cluster
from .precision import Precision, make_adamw, resolve_mode
from .reward_runner import RewardRunner
from .rewards import accuracy_verifier
from .samples import pick_samples, sample_steps
from .state_check import check_checkpoint, python_rng
from .update import policy_update
from .verl import adopt_verl, warn_unknown_sources
from .weights import push_weights

log = logging.getLogger(__name__)


def step_seed(seed: int, step: int, prompt: int) -> int:
    """Rollout seeds depend only on (run seed, step, prompt): a resumed run samples what the original would."""
    return (seed * 1_000_003 + step) * 1_000_033 + prompt * 997


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.out = Path(cfg.trainer.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        random.seed(cfg.trainer.seed)
        torch.manual_seed(cfg.trainer.seed)
        device = cfg.model.device or ("cuda" if torch.cuda.is_available() else "cpu")
        rollout_dtype = resolve_dtype(cfg.model.dtype, device)
        # the policy is the fp32 master (optimizer, checkpoints); the engine runs its own copy in rollout_dtype
        self.policy, self.tokenizer = load_model(cfg.model.path, device=device, dtype=torch.float32)
        if self.tokenizer is None:
            raise ValueError(f"model {cfg.model.path!r} has no tokenizer; training needs one for prompts and rewards")
        self._check_context()
        self.policy.requires_grad_(True)
        engine_model = self.policy if rollout_dtype == torch.float32 else copy.deepcopy(self.policy).to(rollout_dtype)
        mode = resolve_mode(cfg.model.train_compute, rollout_dtype)
        # a bf16 compute copy and the bf16 engine hold the same weights after every update: one module serves both
        self.prec = Precision(self.policy, mode, engine_model if engine_model.dtype == torch.bfloat16 else None)
        self.ref = copy.deepcopy(self.prec.model).requires_grad_(False) if cfg.algo.kl_coef > 0 else None
        self.samples: list[dict] = []  # rows for samples.jsonl from the last step (first, middle and last steps)
        r = cfg.rollout
        self.head, self.drafter_trainer, self.spot = self._build_drafter(engine_model)
        self.lender = None
        if self.spot is not None:
            tail = max(cfg.drafter.spot_batch, int(cfg.drafter.spot_frac * r.n * cfg.trainer.prompts_per_step))
            self.lender = SpotLender(self.spot, self.drafter_trainer.buffer, cfg.drafter, tail)
        self.engine = Engine(engine_model, self.tokenizer, EngineConfig(
            kv_cache_gb=r.kv_cache_gb, max_num_seqs=r.max_num_seqs, seed=cfg.trainer.seed, spec=r.spec,
            cuda_graphs=r.cuda_graphs, batch_invariant=r.batch_invariant,
            max_model_len=min(cfg.data.max_prompt_tokens + r.max_tokens, engine_model.config.max_position_embeddings)),
            make_speculator(r.spec, LearnedDrafter(self.head, cfg.drafter) if self.head is not None else None))
        self.last_step_s = 0.0
        self.notes = adopt_verl(cfg.data, cfg.reward, peek_rows(cfg.data.train_file))  # [] unless verl's format
        self.train_set, self.eval_set = load_datasets(cfg.data)
        warn_unknown_sources(cfg.reward.functions, self.train_set + self.eval_set)
        d = cfg.data
        self.train_set = fit_prompts(self.train_set, self.engine.encode, d.system_prompt, d.max_prompt_tokens, "train")
        self.eval_set = fit_prompts(self.eval_set, self.engine.encode, d.system_prompt, d.max_prompt_tokens, "eval")
        self.loader = Loader(len(self.train_set), cfg.trainer.seed)
        self.optimizer = make_adamw(self.policy.parameters(), lr=cfg.algo.lr, weight_decay=cfg.algo.weight_decay,
                                    betas=(0.9, 0.99))
        self.rewards = RewardRunner(cfg.reward.functions, cfg.reward.weights, cfg.reward.timeout_s,
                                    cfg.reward.max_failed_steps)
        self.verifier = accuracy_verifier(cfg.reward.accuracy, cfg.reward.functions)
        self.guard = StepGuard(cfg.trainer.max_skipped_steps)
        self.skip_reason: str | None = None  # why the last step did not update the policy
        self.phase: tuple[str, float] | None = None  # (rollout | update | eval, since): for the console's progress line
        self.step = 0
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.cluster = make_cluster(cfg, self.engine.config)  # rollout.workers > 1: Ray rollout workers
        self.cluster_metrics: dict = {}

    def _check_context(self) -> None:
        ctx, c = self.policy.config.max_position_embeddings, self.cfg
        if c.rollout.max_tokens >= ctx:
            raise ValueError(f"rollout.max_tokens={c.rollout.max_tokens} does not fit the context of {c.model.path!r} "
                             f"({ctx} tokens, its max_position_embeddings), which also holds the prompt: lower it")
        if c.rollout.max_tokens + c.data.max_prompt_tokens > ctx:
            log.warning("data.max_prompt_tokens + rollout.max_tokens = %d exceeds the model's context (%d): responses "
                        "to the longest prompts are cut short", c.rollout.max_tokens + c.data.max_prompt_tokens, ctx)

    def _build_drafter(self, target):
        """The learned drafter: the engine's head (drafts), a trainer with its own copy (online training when
        drafter.spot is on; otherwise the head stays as loaded: a frozen drafter)."""
        d = self.cfg.drafter
        if not (d.enabled or d.path):
            return None, None, None
        # target: the engine's model; the head drafts inside the engine, on its hidden states and in its dtype
        if d.path:
            head = load_drafter(d.path, target)
        else:
            head = EagleDrafter(target.config).to(device=target.device, dtype=target.dtype).bind(target)
        trainer = DrafterTrainer(head, d, seed=self.cfg.trainer.seed) if d.spot else None
        spot = SpotTrainer(trainer, d) if trainer is not None else None
        return head, trainer, spot

    @property
    def history(self):
        """The engine's history drafter (its index is part of checkpoints), or None."""
        spec = self.engine.speculator
        return spec.drafters.get("history") if spec is not None else None

    def close(self) -> None:
        self.rewards.close()
        if self.cluster is not None:
            self.cluster.shutdown()
        if self.spot is not None:
            self.spot.close()

    # ---- one step --------------------------------------------------------------------------------------

    def rollout(self, examples: list[Example], step: int):
        r = self.cfg.rollout
        params = [SamplingParams(n=r.n, max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                                 top_k=r.top_k, seed=step_seed(self.cfg.trainer.seed, step, i)) for i in range(len(examples))]
        if self.cluster is not None:  # this step's weights (and drafter head) to the workers, then their rollout
            comps, self.cluster_metrics = cluster_rollout(self.cluster, self.policy, [ex.ids for ex in examples], params,
                                                          head=self.head)
            return comps
        if self.spot is None:
            return self.engine.generate([ex.ids for ex in examples], params)
        self.drafter_trainer.model.sync_head()
        self.lender.begin_step(step, self.last_step_s)
        col = self.engine.collector(self.engine.add_requests([ex.ids for ex in examples], params))
        try:
            while self.engine.has_work():  # between steps: feed the drafter buffer, lend threads in the long tail
                out = self.engine.step()
                col.add(out)
                self.lender.on_engine_step(self.engine.num_running, out.finished)
        finally:
            self.lender.stop()
        self.engine.end_rollout(col.stats)
        return col.result()

    def score(self, examples: list[Example], comps, group_size: int) -> tuple[torch.Tensor, dict, list[bool]]:
        prompts = [examples[c.prompt_index].prompt for c in comps]
        texts = [c.text for c in comps]
        columns = {"answer": [examples[c.prompt_index].answer for c in comps]}
        for key in examples[0].columns:
            columns[key] = [examples[c.prompt_index].columns.get(key) for c in comps]
        total, st = self.rewards(prompts, texts, columns)
        correct = [self.verifier(t, **{k: v[i] for k, v in columns.items()}) for i, t in enumerate(texts)]
        rewards = torch.tensor(total)
        groups = rewards.view(-1, group_size)
        metrics = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
                   "reward/frac_zero_std": float((groups.std(-1) == 0).float().mean()) if group_size > 1 else 0.0,
                   "acc/mean": sum(correct) / len(correct), "reward/errors": st.errors, "reward/timeouts": st.timeouts,
                   "reward/invalid": st.invalid}
        for name, v in st.per_fn.items():
            metrics[f"reward/{name.split(':')[-1]}/mean"] = v
        return rewards, metrics, correct

    def evaluate(self) -> dict:
        self.phase = ("eval", time.perf_counter())
        comps = self.engine.generate([ex.ids for ex in self.eval_set],
                                     SamplingParams(temperature=0, max_tokens=self.cfg.rollout.max_tokens))
        comps = [c for c in comps if c.finish_reason != "error"]
        if not comps:
            return {"eval/accuracy": float("nan"), "eval/reward": float("nan")}
        rewards, m, _ = self.score(self.eval_set, comps, group_size=1)
        return {"eval/accuracy": m["acc/mean"], "eval/reward": float(rewards.mean())}

    def _accepted(self, comps, n: int) -> tuple[list, int]:
        """The completions of groups the engine finished (a rejected prompt's group is dropped whole)."""
        groups = [comps[i : i + n] for i in range(0, len(comps), n)]
        bad = [g for g in groups if any(c.finish_reason == "error" for c in g)]
        if bad:
            log.warning("step %d: %d of %d prompts rejected by the engine (%s): left out of the update (rollout/rejected)",
                        self.step + 1, len(bad), len(groups), next((c.error for c in bad[0] if c.error), "no reason given"))
        return [c for g in groups if g not in bad for c in g], len(bad)

    def train_step(self) -> dict:
        cfg = self.cfg
        t_step = time.perf_counter()
        self.samples = []
        idx = self.loader.next(cfg.trainer.prompts_per_step)
        examples = [self.train_set[i] for i in idx]
        timing = {}
        t = time.perf_counter()
        self.phase = ("rollout", t)
        all_comps = self.rollout(examples, self.step)
        timing["timing_s/gen"] = time.perf_counter() - t
        check_rollout_labels(examples, all_comps, cfg.rollout.n)
        comps, rejected = self._accepted(all_comps, cfg.rollout.n)
        metrics = {"rollout/rejected": rejected, "rollout/batch_invariant": float(self.engine.runner.invariant)}
        self.phase = ("update", time.perf_counter())
        if comps:
            metrics.update(self._learn(examples, comps, timing))
        else:
            self.skip_reason = "every prompt of the step was rejected by the engine"
            metrics["train/skipped_steps"] = 1
        t = time.perf_counter()
        self._sync_engine()
        metrics.update(self._drafter_sync())
        timing["timing_s/sync"] = time.perf_counter() - t
        if self.cluster is not None:  # the workers got this step's weights before its rollout
            timing["timing_s/sync"] += self.cluster_metrics.pop("timing_s/sync", 0.0)
            metrics.update(self.cluster_metrics)
        lens = torch.tensor([len(c.token_ids) for c in comps or all_comps], dtype=torch.float)
        st = all_comps.stats
        metrics.update({
            "response_length/mean": float(lens.mean()), "response_length/max": float(lens.max()),
            "response_length/min": float(lens.min()),
            "response_length/clip_ratio": sum(c.finish_reason == "length" for c in comps) / max(len(comps), 1),
            "perf/gen_tokens_per_s": st.tokens_per_s, **st.metrics(),
        })
        metrics["response_lengths"] = lens.int().tolist()
        self.step += 1
        if cfg.trainer.eval_every and self.step % cfg.trainer.eval_every == 0:
            t = time.perf_counter()
            metrics.update(self.evaluate())
            timing["timing_s/eval"] = time.perf_counter() - t
        timing["timing_s/step"] = self.last_step_s = time.perf_counter() - t_step
        metrics.update(timing)
        self.phase = None
        return metrics

    def _learn(self, examples: list[Example], comps, timing: dict) -> dict:
        """Rewards -> advantages -> policy update; no optimizer step on a non-finite reward or advantage."""
        n = self.cfg.rollout.n
        t = time.perf_counter()
        rewards, metrics, correct = self.score(examples, comps, n)
        if self.step + 1 in sample_steps(self.cfg.trainer.steps):
            self.samples = pick_samples(self.step + 1, [examples[c.prompt_index].prompt for c in comps], comps,
                                        rewards.tolist(), correct)
        timing["timing_s/reward"] = time.perf_counter() - t
        adv = group_advantages(rewards, n, norm_std=self.cfg.algo.advantage == "grpo")
        bad = "reward" if not torch.isfinite(rewards).all() else "advantage" if not torch.isfinite(adv).all() else None
        if bad:
            self.skip_reason = f"non-finite {bad}"
            metrics["train/skipped_steps"] = 1
            return metrics
        rng = random.Random(f"{self.cfg.trainer.seed}-update-{self.step}")
        actor, self.skip_reason = policy_update(self.prec, self.optimizer, self.ref, make_batch(comps, self.pad), adv,
                                                self.cfg.algo, self.cfg.rollout.temperature, rng, timing)
        metrics.update(actor)
        return metrics

    def _sync_engine(self) -> None:
        """The master's weights to the engine, cast to its dtype (a bf16 compute copy that is the engine's model
        took them after each optimizer step already)."""
        if self.engine.model is not self.prec.model:
            push_weights(self.policy, self.engine.model)

    def _drafter_sync(self) -> dict:
        """Between steps: the trained head's weights (and, once known, its draft vocabulary) go to the engine,
        and both heads re-read the policy's new LM head rows."""
        if self.head is None:
            return {}
        if self.drafter_trainer is None or self.cluster is not None:  # with workers: merged in cluster_rollout
            self.head.sync_head()
            return {}
        tr = self.drafter_trainer
        tr.maybe_set_vocab(None, self.policy.config.eos_token_id)
        tr.publish(self.head)
        m = {"drafter/train_steps": tr.steps, "drafter/spot_steps": self.spot.steps_this_rl_step,
             "drafter/spot_s": self.spot.used_s, "drafter/buffer_tokens": tr.buffer.tokens}
        m.update({k: v for k, v in tr.last.items() if k.startswith("drafter/")})
        return m

    # ---- checkpoints -----------------------------------------------------------------------------------

    def save(self, final: bool = False) -> Path:
        t = self.cfg.trainer
        state = {"step": self.step, "optimizer": self.optimizer.state_dict() if t.save_optimizer_final or not final else None,
                 "loader": self.loader.state_dict(), "python_rng": random.getstate(), "torch_rng": torch.get_rng_state(),
                 "history": self.history.state_dict() if self.history is not None else None,
                 "drafter": self.drafter_trainer.state_dict() if self.drafter_trainer is not None else None}
        return save_checkpoint(self.out / "checkpoints", self.step, self.policy, self.tokenizer, state, self._config(),
                               self.head, t.keep_checkpoints)

    def _config(self) -> dict:
        return json.loads(json.dumps(to_dict(self.cfg)))

    def resume(self) -> bool:
        """Loads the newest usable checkpoint (see checkpoint.py for the fallbacks) and says what it did. Each is
        checked against this trainer first (state_check.py), so that what follows cannot fail half way."""
        root = self.out / "checkpoints"
        got = load_checkpoint(root, lambda c: check_checkpoint(c, self.policy, self.optimizer, self.drafter_trainer,
                                                               self.head), self.cfg.trainer.trust_pickled_state)
        if got is None:
            print(f"no checkpoint in {root}: starting fresh")
            return False
        sd = dict(got.model)
        if self.policy.config.tie_word_embeddings:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        self.policy.load_state_dict(sd)
        self.prec.after_step()
        self._sync_engine()
        state = got.state
        self.step = state["step"]
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            log.warning("%s has no optimizer state (trainer.save_optimizer_final=false): Adam starts afresh", got.path)
        kernels = {k: self.optimizer.defaults.get(k) for k in ("fused", "foreach")}
        for g in self.optimizer.param_groups:  # settings given now win over the checkpoint's (and its kernel choice)
            g["lr"], g["weight_decay"] = self.cfg.algo.lr, self.cfg.algo.weight_decay
            g.update(kernels)
        self.loader.load_state_dict(state["loader"])
        random.setstate(python_rng(state["python_rng"]))
        torch.set_rng_state(state["torch_rng"])
        if self.history is not None:  # exactly the checkpoint's index: none if its run kept none (SD off)
            self.history.load_state_dict(state.get("history") or {"prompts": []})
        if self.head is not None and got.drafter is not None:
            self.head.set_vocab(got.drafter.vocab)
            self.head.fc.load_state_dict(got.drafter.fc.state_dict())
            self.head.layer.load_state_dict(got.drafter.layer.state_dict())
            self.head.sync_head()
        if state.get("drafter") is not None and self.drafter_trainer is not None:
            self.drafter_trainer.load_state_dict(state["drafter"])
        print(f"resumed from step {self.step} ({got.path})")
        changes = config_changes(got.config, self._config())
        if changes:
            print("config differs from the checkpoint's (the values given now apply):\n  " + "\n  ".join(changes))
        return True
