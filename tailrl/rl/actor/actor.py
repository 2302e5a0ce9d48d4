"""The actor role: the policy's fp32 master weights, the compute precision (precision.py), AdamW, the frozen
reference, the update (update.py), the checkpointed state and the weights export.

At `trainer.world_size=1` it is the one-process trainer of before (no process group, no Ray). At N it runs once
in each of N ranks (group.py starts them), its modules sharded with FSDP2 (fsdp.py; with LoRA the adapters only,
the frozen base whole on every rank: fsdp.apply_fsdp_lora) and the update data-parallel (ranks.py); the step loop
talks to `ActorGroup`, which has this class's methods, and never knows.

Invariants: the optimizer, its state and checkpoints only ever see the fp32 master; after `update` every rank
holds its shards of the same weights (one rank's NaN skips the step on all: ranks.py)."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import torch

from ...config import Config
from ...model import load_model, save_pretrained
from ...model.load import save_layers
from ..checkpoint.store import non_finite_params
from .fsdp import apply_fsdp, apply_fsdp_lora, full_layers, local_bytes
from .forward import Batch
from .logprobs import Warp
from .precision import Precision, make_adamw, resolve_mode
from .ranks import SINGLE, Ranks
from ..algos import lr_at
from .update import policy_update
from .lora import BaseReference, add_adapters, merge_into, merged_layers


def device_of(cfg: Config) -> str:
    return cfg.model.device or ("cuda" if torch.cuda.is_available() else "cpu")


class Actor:
    def __init__(self, cfg: Config, rollout_dtype: torch.dtype, ranks: Ranks = SINGLE):
        self.cfg, self.ranks = cfg, ranks
        self.lora = cfg.actor.lora if cfg.actor.lora.rank > 0 else None
        mode = resolve_mode(cfg.model.train_compute, rollout_dtype)
        # LoRA: the frozen base in the compute dtype (no fp32 master of it), fp32 adapters (lora.py)
        base_dtype = torch.bfloat16 if self.lora and mode == "bfloat16" else torch.float32
        self.policy, self.tokenizer = load_model(cfg.model.path, device=device_of(cfg), dtype=base_dtype)
        if self.tokenizer is None:
            raise ValueError(f"model {cfg.model.path!r} has no tokenizer; training needs one for prompts and rewards")
        self.policy.requires_grad_(True)
        t = cfg.trainer
        if self.lora:
            # the engine runs its own ordinary copy, into which every sync merges W + (alpha/r) B A (lora.py); over N
            # ranks the rollout holds its own model, and the merged weights reach it streamed (merged_layers)
            self.engine_model = (copy.deepcopy(self.policy).requires_grad_(False).to(rollout_dtype)
                                 if ranks.world == 1 else None)
            add_adapters(self.policy, self.lora)
            if ranks.world > 1:  # the adapters sharded, the frozen base whole on every rank (fsdp.apply_fsdp_lora)
                apply_fsdp_lora(self.policy, t.offload, t.activation_checkpointing)
            self.prec = Precision(self.policy, "float32")  # the base is already in its compute dtype
            self.prec.mode = mode
            self.ref = BaseReference(self.policy) if cfg.algo.kl_coef > 0 else None  # no second copy of the base
        elif ranks.world > 1:
            self.engine_model = None  # the rollout holds its own model; weights reach it streamed
            self.ref = copy.deepcopy(self.policy).requires_grad_(False) if cfg.algo.kl_coef > 0 else None
            apply_fsdp(self.policy, mode, t.offload, t.activation_checkpointing)
            if self.ref is not None:
                apply_fsdp(self.ref, mode)
            # FSDP2's MixedPrecisionPolicy does what the bf16 compute copy does at one rank (fsdp.py)
            self.prec = Precision(self.policy, "float32" if mode == "bfloat16" else mode)
            self.prec.mode = mode
        else:
            self.engine_model = (self.policy if rollout_dtype == torch.float32
                                 else copy.deepcopy(self.policy).to(rollout_dtype))
            # a bf16 compute copy and the bf16 engine hold the same weights after every update: one module serves both
            self.prec = Precision(self.policy, mode,
                                  self.engine_model if self.engine_model.dtype == torch.bfloat16 else None)
            self.ref = copy.deepcopy(self.prec.model).requires_grad_(False) if cfg.algo.kl_coef > 0 else None
        self.mode = mode
        self.optimizer = make_adamw([p for p in self.policy.parameters() if p.requires_grad], lr=cfg.algo.lr, weight_decay=cfg.algo.weight_decay,
                                    betas=(0.9, 0.99))

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
        policy or its bf16 compute copy, which the optimizer step updated in place)."""
        if self.lora:  # the merged weights into the engine's copy, then on to an engine that takes them streamed
            moved = merge_into(self.policy, self.engine_model)
            return rollout.load_policy(self.engine_model) if rollout.streams_policy else moved
        if not rollout.streams_policy and (self.engine_model is self.policy or self.engine_model is self.prec.model):
            return 0
        return rollout.load_policy(self.policy)

    def weights(self) -> dict:
        """The policy's tensors by name (for Ray rollout workers): with LoRA, the merged ones."""
        if self.lora:
            merge_into(self.policy, self.engine_model)
            return self.engine_model.state_dict()
        return self.policy.state_dict()

    def layers(self, dtype: torch.dtype | None = None, adapted_only: bool = False):
        """Every rank: the full tensors a layer at a time (fsdp.full_layers); one rank: the policy's own. adapted_only
        (LoRA at N ranks): the merged adapted layers alone (lora.merged_layers)."""
        if self.lora and self.ranks.world > 1:  # every rank gathers a layer's adapters; rank 0 streams (group.py)
            yield from merged_layers(self.policy, dtype, adapted_only)
            return
        if self.lora:
            merge_into(self.policy, self.engine_model)
            merged = self.engine_model.named_parameters()
            yield {n: p.detach() if dtype is None else p.detach().to(dtype) for n, p in merged}
            return
        if self.ranks.world == 1:
            yield {n: p.detach() if dtype is None else p.detach().to(dtype) for n, p in self.policy.named_parameters()}
            return
        yield from full_layers(self.policy, dtype)

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
        format there (and, with actor.lora.merged_export, the merged model in folder/merged at the end)."""
        if self.lora:
            from ...model import resolve_model_path
            from .lora_io import adapter_state, save_adapter, save_merged

            base = str(Path(resolve_model_path(self.cfg.model.path)).resolve())
            if self.ranks.world > 1:  # every rank gathers the adapters (and the merged layers); rank 0 writes
                state = adapter_state(self.policy, gather=True)
                if self.ranks.rank == 0:
                    save_adapter(self.policy, folder / "model", self.lora, base, state)
                if final and self.lora.merged_export:
                    save_layers(merged_layers(self.policy, torch.float32), folder / "merged", self.policy.config,
                                self.ranks.rank == 0, self.tokenizer)
                return
            save_adapter(self.policy, folder / "model", self.lora, base)
            if final and self.lora.merged_export:
                save_merged(self.policy, folder / "merged", self.tokenizer)
            return
        save_pretrained(self.policy, folder / "model")

    def keeps_optimizer(self, final: bool) -> bool:
        return self.cfg.trainer.save_optimizer_final or not final

    def optimizer_state(self, final: bool) -> dict | None:
        """For the trainer state of a one-process checkpoint."""
        return self.optimizer.state_dict() if self.keeps_optimizer(final) else None

    def shapes(self, dcp: bool = False) -> dict:
        """{name: shape} of the policy's state dict (global shapes), for checking a checkpoint before loading it, named
        as a checkpoint saves them: LoRA's adapters by PEFT's names, or by the module's in dcp/ (dcp=True)."""
        if self.lora:  # a DTensor shard's shape is the whole tensor's
            from .lora_io import adapter_state, module_names

            shapes = {n: tuple(t.shape) for n, t in adapter_state(self.policy).items()}
            return module_names(shapes) if dcp else shapes
        return {n: tuple(t.shape) for n, t in self.policy.state_dict().items()}

    @property
    def tied(self) -> bool:
        return bool(self.policy.config.tie_word_embeddings)

    def load(self, model_sd: dict, optimizer_sd: dict | None) -> None:
        """A one-process checkpoint's weights (HF names, tied head saved once) and optimizer state."""
        if self.lora and self.ranks.world > 1:  # the whole adapter and moments, cut into this rank's shards
            self._load_lora_shards(model_sd, optimizer_sd)
            self.apply_settings()
            return
        if self.lora:
            from .lora_io import load_adapter_state

            load_adapter_state(self.policy, model_sd, "the checkpoint's adapter")
        else:
            sd = dict(model_sd)
            if self.policy.config.tie_word_embeddings:
                sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
            self.policy.load_state_dict(sd)
        self.prec.after_step()
        if optimizer_sd is not None:
            self.optimizer.load_state_dict(optimizer_sd)
        self.apply_settings()

    def _load_lora_shards(self, model_sd: dict, optimizer_sd: dict | None) -> None:
        """Every rank: a one-process LoRA checkpoint (the adapter under PEFT's names, AdamW's state by parameter
        position, as the one process's optimizer holds the same parameters in the same order) into this rank's
        shards of the adapters and of their moments (each rank cuts its own shard from the whole tensor)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        from .lora_io import param_name

        def shard(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
            t = t.to(like.dtype)
            return distribute_tensor(t, like.device_mesh, like.placements, src_data_rank=None) if isinstance(
                like, DTensor) else t

        live = {n: p for n, p in self.policy.named_parameters() if p.requires_grad}
        model = {param_name(k): t for k, t in model_sd.items()}
        missing, extra = sorted(live.keys() - model.keys()), sorted(model.keys() - live.keys())
        bad = [n for n in live.keys() & model.keys() if tuple(model[n].shape) != tuple(live[n].shape)]
        if missing or extra or bad:
            raise ValueError(f"the checkpoint's adapter does not fit this model's adapters: missing {missing[:3]}, "
                             f"unexpected {extra[:3]}, other shapes {bad[:3]}")
        with torch.no_grad():
            for n, p in live.items():
                s = shard(model[n], p)
                (p.to_local() if isinstance(p, DTensor) else p).copy_(s.to_local() if isinstance(s, DTensor) else s)
        if optimizer_sd is not None:
            params = list(live.values())
            state = {int(i): {k: shard(v, params[int(i)]) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                              for k, v in st.items()} for i, st in optimizer_sd["state"].items()}
            self.optimizer.load_state_dict({"state": state, "param_groups": optimizer_sd["param_groups"]})

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
