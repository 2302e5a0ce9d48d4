"""The GRPO/DAPO loop: rollout (speculative engine) -> rewards -> advantages -> policy update -> weights to
the engine -> metrics, with periodic evaluation and checkpoints that a killed run resumes from exactly."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import random
import shutil
import time
from pathlib import Path

import torch

from ..config import Config, to_dict
from ..drafter.eagle import EagleDrafter, load_drafter, save_drafter
from ..drafter.propose import LearnedDrafter
from ..drafter.train import DrafterTrainer, SpotTrainer
from ..engine import Engine, EngineConfig, SamplingParams
from ..metrics import MetricsWriter
from ..model import load_model, save_pretrained
from .algos import aggregate, group_advantages, kl_penalty, policy_loss, token_logprobs
from .data import Example, Loader, chat_prompt, load_datasets
from .rewards import BUILTIN, RewardRunner, math_reward

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def step_seed(seed: int, step: int, prompt: int) -> int:
    """Rollout seeds depend only on (run seed, step, prompt): a resumed run samples what the original would."""
    return (seed * 1_000_003 + step) * 1_000_033 + prompt * 997


def push_weights(policy: torch.nn.Module, engine_model: torch.nn.Module) -> None:
    """New policy weights into the rollout engine, in process (nothing to do when they share the module)."""
    if policy is engine_model:
        return
    with torch.no_grad():
        for (name, dst), src in zip(engine_model.state_dict().items(), policy.state_dict().values()):
            dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


def pad_batch(seqs: list[list[int]], pad: int) -> torch.Tensor:
    L = max(len(s) for s in seqs)
    return torch.tensor([s + [pad] * (L - len(s)) for s in seqs])


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.out = Path(cfg.trainer.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        random.seed(cfg.trainer.seed)
        torch.manual_seed(cfg.trainer.seed)
        dtype = DTYPES[cfg.model.dtype]
        self.policy, self.tokenizer = load_model(cfg.model.path, device=cfg.model.device, dtype=dtype)
        if self.tokenizer is None:
            raise ValueError(f"model {cfg.model.path!r} has no tokenizer; training needs one for prompts and rewards")
        self.policy.requires_grad_(True)
        self.ref = copy.deepcopy(self.policy).requires_grad_(False) if cfg.algo.kl_coef > 0 else None
        r = cfg.rollout
        self.head, self.drafter_trainer, self.spot = self._build_drafter()
        self.engine = Engine(self.policy, self.tokenizer, EngineConfig(
            kv_cache_gb=r.kv_cache_gb, max_num_seqs=r.max_num_seqs, seed=cfg.trainer.seed, spec=r.spec),
            learned=LearnedDrafter(self.head, cfg.drafter) if self.head is not None else None)
        self.threads = torch.get_num_threads()
        self._lent = False  # threads lent to the spot trainer
        self.last_step_s = 0.0
        self.train_set, self.eval_set = load_datasets(cfg.data)
        self.train_set = self._fit_prompts(self.train_set, "train")
        self.eval_set = self._fit_prompts(self.eval_set, "eval")
        self.loader = Loader(len(self.train_set), cfg.trainer.seed)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.algo.lr, weight_decay=cfg.algo.weight_decay,
                                           betas=(0.9, 0.99))
        self.rewards = RewardRunner(cfg.reward.functions, cfg.reward.weights, cfg.reward.timeout_s)
        self.step = 0
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def _build_drafter(self):
        """The learned drafter: the engine's head (drafts), a trainer with its own copy (online training when
        drafter.spot is on; otherwise the head stays as loaded: a frozen drafter)."""
        d = self.cfg.drafter
        if not (d.enabled or d.path):
            return None, None, None
        if d.path:
            head = load_drafter(d.path, self.policy)
        else:
            head = EagleDrafter(self.policy.config).to(device=self.policy.device, dtype=self.policy.dtype).bind(self.policy)
        trainer = DrafterTrainer(head, d, seed=self.cfg.trainer.seed) if d.spot else None
        spot = SpotTrainer(trainer, d) if trainer is not None else None
        return head, trainer, spot

    def _on_engine_step(self, running, done) -> None:
        """During a rollout: feed finished sequences to the drafter buffer; run the spot trainer while at most
        drafter.spot_batch sequences are left (the long tail), on threads taken from the rollout."""
        for s in done:
            if s.finish_reason != "error" and s.hidden:
                self.drafter_trainer.buffer.add(s.prompt_ids, s.output_ids, s.hidden_rows(0, s.cache_len), self.step)
        d = self.cfg.drafter
        tail = 0 < len(running) <= max(d.spot_batch, int(d.spot_frac * self.cfg.rollout.n * self.cfg.trainer.prompts_per_step))
        if tail and not self.spot.running and not self._lent and self.spot.resume():
            torch.set_num_threads(max(self.threads - self.cfg.drafter.spot_threads, 1))
            self._lent = True
        elif self._lent and not (tail and self.spot.running):  # the batch grew, or the trainer spent its share
            self._stop_spot()

    def _stop_spot(self) -> None:
        """Waits for the spot trainer's micro-batch in progress, then gives the rollout its threads back."""
        self.spot.pause(wait=True)
        torch.set_num_threads(self.threads)
        self._lent = False

    def _fit_prompts(self, examples: list[Example], split: str) -> list[Example]:
        keep = []
        for ex in examples:
            ex.ids = self.engine.encode(chat_prompt(ex.prompt, self.cfg.data.system_prompt))
            if len(ex.ids) > self.cfg.data.max_prompt_tokens:
                log.warning("%s prompt of %d tokens skipped (data.max_prompt_tokens=%d)", split, len(ex.ids),
                            self.cfg.data.max_prompt_tokens)
                continue
            keep.append(ex)
        if not keep:
            raise ValueError(f"no {split} prompt fits data.max_prompt_tokens={self.cfg.data.max_prompt_tokens}")
        return keep

    # ---- one step --------------------------------------------------------------------------------------

    def rollout(self, examples: list[Example], step: int):
        r = self.cfg.rollout
        params = [SamplingParams(n=r.n, max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                                 top_k=r.top_k, seed=step_seed(self.cfg.trainer.seed, step, i)) for i in range(len(examples))]
        if self.spot is None:
            return self.engine.generate([ex.ids for ex in examples], params)
        self.drafter_trainer.model.sync_head()
        self.spot.begin_step(step, self.last_step_s)
        self.engine.on_step = self._on_engine_step
        try:
            return self.engine.generate([ex.ids for ex in examples], params)
        finally:
            self.engine.on_step = None
            self._stop_spot()

    def score(self, examples: list[Example], comps, group_size: int) -> tuple[torch.Tensor, dict]:
        prompts = [examples[c.prompt_index].prompt for c in comps]
        texts = [c.text for c in comps]
        columns = {"answer": [examples[c.prompt_index].answer for c in comps]}
        for key in examples[0].columns:
            columns[key] = [examples[c.prompt_index].columns.get(key) for c in comps]
        total, st = self.rewards(prompts, texts, columns)
        # accuracy: the task's strict verifier, whatever the shaped reward is
        verifier = BUILTIN["countdown"] if "countdown" in self.cfg.reward.functions else math_reward
        correct = [verifier(t, **{k: v[i] for k, v in columns.items()}) for i, t in enumerate(texts)]
        rewards = torch.tensor(total)
        groups = rewards.view(-1, group_size)
        metrics = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
                   "reward/frac_zero_std": float((groups.std(-1) == 0).float().mean()) if group_size > 1 else 0.0,
                   "acc/mean": sum(correct) / len(correct), "reward/errors": st.errors, "reward/timeouts": st.timeouts}
        for name, v in st.per_fn.items():
            metrics[f"reward/{name.split(':')[-1]}/mean"] = v
        return rewards, metrics

    def _batch(self, comps) -> dict:
        seqs = [c.prompt_token_ids + c.token_ids for c in comps]
        tokens = pad_batch(seqs, self.pad)
        start = min(len(c.prompt_token_ids) for c in comps) - 1  # first position whose logits predict a response token
        T = tokens.shape[1] - 1 - start
        mask = torch.zeros(len(comps), T)
        for i, c in enumerate(comps):
            p = len(c.prompt_token_ids) - 1 - start
            mask[i, p : p + len(c.token_ids)] = 1.0 if c.finish_reason != "error" else 0.0
        return {"tokens": tokens, "targets": tokens[:, start + 1 :], "start": start, "mask": mask}

    def _logprobs(self, model, batch, idx, grad: bool):
        toks = batch["tokens"][idx].to(model.device)
        with torch.set_grad_enabled(grad):
            logits, _ = model.forward_full(toks[:, :-1], logits_start=batch["start"])
            return token_logprobs(logits, batch["targets"][idx].to(model.device), self.cfg.rollout.temperature)

    def _no_grad_logprobs(self, model, batch) -> torch.Tensor:
        mb = self.cfg.algo.micro_batch_size
        B = batch["tokens"].shape[0]
        with torch.inference_mode():
            return torch.cat([self._logprobs(model, batch, list(range(i, min(i + mb, B))), False)[0] for i in range(0, B, mb)])

    def update(self, batch, advantages: torch.Tensor, timing: dict) -> dict:
        a = self.cfg.algo
        B = advantages.shape[0]
        n_updates = a.ppo_epochs * -(-B // a.mini_batch_size)
        t = time.perf_counter()
        # old logprobs are needed once the policy moves within the batch; a single on-policy update uses its own
        old = self._no_grad_logprobs(self.policy, batch) if n_updates > 1 else None
        timing["timing_s/old_log_prob"] = time.perf_counter() - t
        t = time.perf_counter()
        ref = self._no_grad_logprobs(self.ref, batch) if self.ref is not None else None
        timing["timing_s/ref"] = time.perf_counter() - t
        t = time.perf_counter()
        self.policy.train()
        rng = random.Random(f"{self.cfg.trainer.seed}-update-{self.step}")
        mask = batch["mask"]
        sums = {"actor/pg_loss": 0.0, "actor/entropy": 0.0, "actor/kl": 0.0, "actor/pg_clipfrac": 0.0,
                "actor/ppo_kl": 0.0, "actor/grad_norm": 0.0}
        count = 0
        for _ in range(a.ppo_epochs):
            order = list(range(B))
            rng.shuffle(order)
            for m0 in range(0, B, a.mini_batch_size):
                mini = order[m0 : m0 + a.mini_batch_size]
                tokens_in_mini = float(mask[mini].sum().clamp_min(1))
                self.optimizer.zero_grad(set_to_none=True)
                for u0 in range(0, len(mini), a.micro_batch_size):
                    micro = mini[u0 : u0 + a.micro_batch_size]
                    m = mask[micro].to(self.policy.device)
                    logp, ent = self._logprobs(self.policy, batch, micro, True)
                    old_lp = old[micro].to(logp.device) if old is not None else logp.detach()
                    loss, info = policy_loss(logp, old_lp, advantages[micro].to(logp.device), m, a.clip_low,
                                             a.clip_high, a.loss_agg)
                    kl = aggregate(kl_penalty(logp, ref[micro].to(logp.device), a.kl_type), m, a.loss_agg) if ref is not None else None
                    if kl is not None:
                        loss = loss + a.kl_coef * kl
                    # weight micro losses so their sum is the mini-batch loss under the aggregation mode
                    w = float(m.sum()) / tokens_in_mini if a.loss_agg == "token-mean" else len(micro) / len(mini)
                    (loss * w).backward()
                    sums["actor/pg_loss"] += float(loss.detach()) * w
                    sums["actor/entropy"] += float(aggregate(ent.detach(), m, "token-mean")) * w
                    sums["actor/kl"] += float(kl.detach()) * w if kl is not None else 0.0
                    sums["actor/pg_clipfrac"] += info["pg_clipfrac"] * w
                    sums["actor/ppo_kl"] += info["ppo_kl"] * w
                grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), a.grad_clip)
                sums["actor/grad_norm"] += float(grad_norm)
                self.optimizer.step()
                count += 1
        self.policy.eval()
        self.optimizer.zero_grad(set_to_none=True)
        timing["timing_s/update"] = time.perf_counter() - t
        out = {k: v / count for k, v in sums.items()}
        out["actor/lr"] = a.lr
        return out

    def evaluate(self) -> dict:
        comps = self.engine.generate([ex.ids for ex in self.eval_set],
                                     SamplingParams(temperature=0, max_tokens=self.cfg.rollout.max_tokens))
        rewards, m = self.score(self.eval_set, comps, group_size=1)
        return {"eval/accuracy": m["acc/mean"], "eval/reward": float(rewards.mean())}

    def train_step(self) -> dict:
        cfg = self.cfg
        t_step = time.perf_counter()
        idx = self.loader.next(cfg.trainer.prompts_per_step)
        examples = [self.train_set[i] for i in idx]
        timing = {}
        t = time.perf_counter()
        comps = self.rollout(examples, self.step)
        timing["timing_s/gen"] = time.perf_counter() - t
        t = time.perf_counter()
        rewards, metrics = self.score(examples, comps, cfg.rollout.n)
        timing["timing_s/reward"] = time.perf_counter() - t
        adv = group_advantages(rewards, cfg.rollout.n, norm_std=cfg.algo.advantage == "grpo")
        batch = self._batch(comps)
        metrics.update(self.update(batch, adv, timing))
        t = time.perf_counter()
        push_weights(self.policy, self.engine.model)
        metrics.update(self._drafter_sync())
        timing["timing_s/sync"] = time.perf_counter() - t
        lens = torch.tensor([len(c.token_ids) for c in comps], dtype=torch.float)
        st = comps.stats
        metrics.update({
            "response_length/mean": float(lens.mean()), "response_length/max": float(lens.max()),
            "response_length/min": float(lens.min()),
            "response_length/clip_ratio": sum(c.finish_reason == "length" for c in comps) / len(comps),
            "perf/gen_tokens_per_s": st.tokens_per_s, "spec/accept_length": st.mean_accept_length,
            "spec/speedup_est": st.speedup_est, "spec/tail_tokens_per_s": st.tail_tokens_per_s,
        })
        for name in st.drafters:
            metrics[f"spec/accept_length/{name}"] = st.accept_length(name)
        metrics["response_lengths"] = lens.int().tolist()
        self.step += 1
        if cfg.trainer.eval_every and self.step % cfg.trainer.eval_every == 0:
            t = time.perf_counter()
            metrics.update(self.evaluate())
            timing["timing_s/eval"] = time.perf_counter() - t
        timing["timing_s/step"] = self.last_step_s = time.perf_counter() - t_step
        metrics.update(timing)
        return metrics

    def _drafter_sync(self) -> dict:
        """Between steps: the trained head's weights (and, once known, its draft vocabulary) go to the engine,
        and both heads re-read the policy's new LM head rows."""
        if self.head is None:
            return {}
        if self.drafter_trainer is None:
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

    def save(self) -> Path:
        root = self.out / "checkpoints"
        final = root / f"step_{self.step:06d}"
        tmp = root / f".tmp_step_{self.step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_pretrained(self.policy, tmp / "model", self.tokenizer)
        state = {"step": self.step, "optimizer": self.optimizer.state_dict(), "loader": self.loader.state_dict(),
                 "python_rng": random.getstate(), "torch_rng": torch.get_rng_state(),
                 "history": self.engine.drafters["history"].state_dict() if "history" in self.engine.drafters else None,
                 "drafter": self.drafter_trainer.state_dict() if self.drafter_trainer is not None else None}
        if self.head is not None:
            save_drafter(self.head, tmp / "drafter", meta={"rl_step": self.step})
        torch.save(state, tmp / "trainer_state.pt")
        (tmp / "config.json").write_text(json.dumps(to_dict(self.cfg), indent=2))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # a checkpoint exists whole or not at all
        (root / "latest").write_text(final.name)
        for old in sorted(p for p in root.glob("step_*") if p != final)[:-1]:  # keep the last two
            shutil.rmtree(old, ignore_errors=True)
        return final

    def resume(self) -> bool:
        latest = self.out / "checkpoints" / "latest"
        if not latest.is_file():
            return False
        ckpt = self.out / "checkpoints" / latest.read_text().strip()
        from safetensors.torch import load_file

        sd = load_file(str(ckpt / "model" / "model.safetensors"))
        if self.policy.config.tie_word_embeddings:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        self.policy.load_state_dict(sd)
        push_weights(self.policy, self.engine.model)
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
        self.step = state["step"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        random.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("history") is not None and "history" in self.engine.drafters:
            self.engine.drafters["history"].load_state_dict(state["history"])
        if self.head is not None and (ckpt / "drafter").is_dir():
            saved = load_drafter(ckpt / "drafter")
            self.head.set_vocab(saved.vocab)
            self.head.fc.load_state_dict(saved.fc.state_dict())
            self.head.layer.load_state_dict(saved.layer.state_dict())
            self.head.sync_head()
        if state.get("drafter") is not None and self.drafter_trainer is not None:
            self.drafter_trainer.load_state_dict(state["drafter"])
        log.info("resumed from %s at step %d", ckpt, self.step)
        return True


def train(cfg: Config, console=None) -> Path:
    """Runs cfg.trainer.steps steps (from the last checkpoint with trainer.resume); returns the run folder."""
    trainer = Trainer(cfg)
    resumed = cfg.trainer.resume and trainer.resume()
    (trainer.out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    writer = MetricsWriter(trainer.out, resume_step=trainer.step if resumed else None)
    view = _LiveView(cfg.trainer.steps, trainer.step, console)
    try:
        if trainer.step == 0 and cfg.trainer.eval_every:
            t = time.perf_counter()
            m = trainer.evaluate()
            m["timing_s/eval"] = time.perf_counter() - t
            writer.log(0, m)
            view.eval(0, m)
        while trainer.step < cfg.trainer.steps:
            metrics = trainer.train_step()
            writer.log(trainer.step, metrics)
            view.update(trainer.step, metrics)
            if (cfg.trainer.save_every and trainer.step % cfg.trainer.save_every == 0) or trainer.step == cfg.trainer.steps:
                t = time.perf_counter()
                trainer.save()
                log.info("checkpoint at step %d (%.1fs)", trainer.step, time.perf_counter() - t)
    finally:
        view.close()
        writer.close()
        trainer.rewards.close()
        if trainer.spot is not None:
            trainer.spot.close()
    return trainer.out


class _LiveView:
    """A rich progress bar with the latest step's numbers; plain lines where there is no terminal."""

    def __init__(self, total: int, start: int, console=None):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console or Console()
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.description}"), console=self.console, transient=False)
        self.task = self.progress.add_task("", total=total, completed=start)
        self.progress.start()

    def update(self, step: int, m: dict) -> None:
        line = (f"step {step}: reward {m['reward/mean']:.3f} acc {m['acc/mean']:.2f} len {m['response_length/mean']:.0f} "
                f"gen {m['timing_s/gen']:.1f}s upd {m['timing_s/update']:.1f}s accept {m['spec/accept_length']:.2f}")
        if "eval/accuracy" in m:
            line += f" eval acc {m['eval/accuracy']:.2f}"
        self.progress.update(self.task, completed=step, description=line)
        self.console.log(line)

    def eval(self, step: int, m: dict) -> None:
        self.console.log(f"step {step}: eval acc {m['eval/accuracy']:.2f} reward {m['eval/reward']:.3f}")

    def close(self) -> None:
        self.progress.stop()
