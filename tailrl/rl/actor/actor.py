"""The actor role: the policy's weights (full fine-tuning's fp32 master, full_weights.py, or LoRA's adapters over a
frozen base, lora_weights.py), the compute precision (precision.py), AdamW, the frozen reference, the update
(update.py), the checkpointed state and the weights export.

At `trainer.world_size=1` it is the one-process trainer of before (no process group, no Ray). At N it runs once
in each of N ranks (group.py starts them), its modules sharded with FSDP2 (fsdp.py; with LoRA the adapters only,
the frozen base whole on every rank: fsdp.apply_fsdp_lora) and the update data-parallel (ranks.py); the step loop
talks to `ActorGroup`, which has this class's methods, and never knows. Which weights, and over how many ranks, is
chosen once (`weights_kind`); the Actor calls the same methods on every kind and never asks which it has.

Invariants: the optimizer, its state and checkpoints only ever see the fp32 master; after `update` every rank
holds its shards of the same weights (one rank's NaN skips the step on all: ranks.py)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from ...config import Config
from ...model import load_model
from ..checkpoint.store import non_finite_params
from .fsdp import local_bytes
from .forward import Batch
from .full_weights import FullWeights, ShardedWeights
from .logprobs import Warp
from .lora_weights import LoraWeights, ShardedLoraWeights
from .precision import make_adamw, resolve_mode
from .ranks import SINGLE, Ranks
from ..algos import lr_at
from .update import policy_update


def device_of(cfg: Config) -> str:
    return cfg.model.device or ("cuda" if torch.cuda.is_available() else "cpu")


def weights_kind(cfg: Config, ranks: Ranks) -> type:
    """The class of the policy's weights: full or LoRA (actor.lora.rank > 0), in one process or over N ranks."""
    lora, sharded = cfg.actor.lora.rank > 0, ranks.world > 1
    return {(False, False): FullWeights, (False, True): ShardedWeights,
            (True, False): LoraWeights, (True, True): ShardedLoraWeights}[lora, sharded]


class Actor:
    def __init__(self, cfg: Config, rollout_dtype: torch.dtype, ranks: Ranks = SINGLE):
        self.cfg, self.ranks = cfg, ranks
        self.mode = mode = resolve_mode(cfg.model.train_compute, rollout_dtype)
        kind = weights_kind(cfg, ranks)
        policy, self.tokenizer = load_model(cfg.model.path, device=device_of(cfg), dtype=kind.dtype(mode))
        if self.tokenizer is None:
            raise ValueError(f"model {cfg.model.path!r} has no tokenizer; training needs one for prompts and rewards")
        policy.requires_grad_(True)
        # the policy, the engine's model, the compute precision and the reference (full_weights.py, lora_weights.py)
        self.held = kind(cfg, policy, mode, rollout_dtype, ranks)
        self.optimizer = make_adamw([p for p in self.policy.parameters() if p.requires_grad], lr=cfg.algo.lr, weight_decay=cfg.algo.weight_decay,
                                    betas=(0.9, 0.99))

    policy = property(lambda self: self.held.policy)
    engine_model = property(lambda self: self.held.engine_model)  # the in-process engine's model (None over N ranks)
    prec = property(lambda self: self.held.prec)
    ref = property(lambda self: self.held.ref)

    def update(self, batch: Batch, advantages: torch.Tensor, step: int, timing: dict) -> tuple[dict, str | None]:
        """The policy update of RL step `step` (0-based): (actor metrics, why no optimizer step was taken or None)."""
        rng = random.Random(f"{self.cfg.trainer.seed}-update-{step}")
        a = self.cfg.algo
        lr = lr_at(a.lr, a.lr_schedule, step, self.cfg.trainer.steps, a.lr_warmup_steps, a.lr_min_ratio)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        r = self.cfg.rollout
        metrics, reason = policy_update(self.prec, self.optimizer, self.ref, batch, advantages, a,
                                        Warp(r.temperature, r.top_k, r.top_p), rng, timing, self.ranks)
        metrics["actor/lr"] = lr
        return metrics, reason

    # ---- weights out ---------------------------------------------------------------------------------------

    def sync_to(self, rollout) -> int:
        """The new weights into the rollout (rollout/base.py); returns the bytes moved (0 when our engine runs the
        policy or its bf16 compute copy, which the optimizer step updated in place; with LoRA, the merged weights)."""
        return self.held.sync_to(rollout)

    def weights(self) -> dict:
        """The policy's tensors by name (for Ray rollout workers): with LoRA, the merged ones."""
        return self.held.weights()

    def layers(self, dtype: torch.dtype | None = None, adapted_only: bool = False):
        """Every rank: the full tensors a layer at a time (fsdp.full_layers); one rank: the policy's own. adapted_only
        (LoRA at N ranks): the merged adapted layers alone (lora.merged_layers)."""
        yield from self.held.layers(dtype, adapted_only)

    def memory(self) -> dict:
        """Bytes this rank holds of the parameters and of the optimizer state."""
        return local_bytes(self.policy, self.optimizer)

    # ---- checkpoints --------------------------------------------------------------------------------------

    def non_finite(self) -> list[str]:
        """Names of the parameters holding NaN/inf (over every rank's shards)."""
        bad = non_finite_params(self.policy)
        if self.ranks.world > 1:
            names = [n for n, _ in self.policy.named_parameters()]
            flags = self.ranks.all_reduce_(torch.tensor([float(n in bad) for n in names]))
            bad = [n for n, f in zip(names, flags.tolist()) if f > 0]
        return bad

    def write_model(self, folder: Path, final: bool) -> None:
        """The HF export of the policy (config.json + safetensors) into folder/model; with LoRA, the adapter in PEFT's
        format there (and, with actor.lora.merged_export, the merged model in folder/merged at the end). Over N ranks
        every rank calls it (rank 0 writes)."""
        self.held.write_model(folder, final, self.tokenizer)

    def keeps_optimizer(self, final: bool) -> bool:
        return self.cfg.trainer.save_optimizer_final or not final

    def optimizer_state(self, final: bool) -> dict | None:
        """For the trainer state of a one-process checkpoint."""
        return self.optimizer.state_dict() if self.keeps_optimizer(final) else None

    def shapes(self, dcp: bool = False) -> dict:
        """{name: shape} of the policy's state dict (global shapes), for checking a checkpoint before loading it, named
        as a checkpoint saves them: LoRA's adapters by PEFT's names, or by the module's in dcp/ (dcp=True)."""
        return self.held.shapes(dcp)

    @property
    def tied(self) -> bool:
        return bool(self.policy.config.tie_word_embeddings)

    def load(self, model_sd: dict, optimizer_sd: dict | None) -> None:
        """A one-process checkpoint's weights (HF names, tied head saved once) and optimizer state; LoRA over N ranks:
        the whole adapter and moments, cut into this rank's shards."""
        self.held.load(model_sd, optimizer_sd, self.optimizer)
        self.apply_settings()

    def apply_settings(self) -> None:
        """Settings given now win over a checkpoint's (and its kernel choice)."""
        kernels = {k: self.optimizer.defaults.get(k) for k in ("fused", "foreach")}
        for g in self.optimizer.param_groups:
            g["lr"], g["weight_decay"] = self.cfg.algo.lr, self.cfg.algo.weight_decay
            g.update(kernels)

    def save_sharded(self, folder: Path, final: bool) -> None:
        """Every rank: its shards of the weights (and AdamW's moments) into folder (checkpoint/sharded_io.py)."""
        from ..checkpoint.sharded_io import save_sharded

        save_sharded(folder, self.policy, self.optimizer, self.keeps_optimizer(final))  # LoRA: the adapters only

    def load_sharded(self, folder: Path) -> bool:
        """Every rank: a sharded checkpoint written at any world size. Returns whether it held optimizer state."""
        from ..checkpoint.sharded_io import load_sharded

        got = load_sharded(folder, self.policy, self.optimizer)
        self.prec.after_step()
        self.apply_settings()
        return got
