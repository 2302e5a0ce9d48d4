"""LoRA's weights (lora.py): fp32 adapters trained over a frozen base held in the compute dtype, no fp32 master of
the base. `LoraWeights` in one process, `ShardedLoraWeights` over N ranks (the adapters sharded with FSDP2, the base
whole on every rank: fsdp.apply_fsdp_lora). The same methods as full_weights.py's, which the Actor calls on either.

Invariants: the optimizer and checkpoints see the adapters only (PEFT's names in a one-process checkpoint and in
folder/model, the module's in dcp/); the engine runs an ordinary model into which every sync merges
W + (alpha/r) B A (lora.merge_into); the KL reference is the base itself, the adapters off (lora.BaseReference)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from ...config import Config
from ...model.load import save_layers
from .fsdp import apply_fsdp_lora
from .lora import BaseReference, add_adapters, merge_into, merged_layers
from .precision import Precision
from .ranks import Ranks


class LoraWeights:
    """One process: the engine runs its own ordinary copy of the base in the rollout dtype, into which every sync
    merges the adapters."""

    @staticmethod
    def dtype(mode: str) -> torch.dtype:
        """The dtype the base is loaded (and frozen) in: the compute dtype."""
        return torch.bfloat16 if mode == "bfloat16" else torch.float32

    def __init__(self, cfg: Config, policy: torch.nn.Module, mode: str, rollout_dtype: torch.dtype, ranks: Ranks):
        self.cfg, self.ranks, self.policy, self.lora = cfg, ranks, policy, cfg.actor.lora
        self.engine_model = self._engine_copy(rollout_dtype)
        add_adapters(policy, self.lora)
        self._shard()
        self.prec = Precision(policy, "float32")  # the base is already in its compute dtype
        self.prec.mode = mode
        self.ref = BaseReference(policy) if cfg.algo.kl_coef > 0 else None  # no second copy of the base

    def _engine_copy(self, rollout_dtype: torch.dtype) -> torch.nn.Module | None:
        """The engine's ordinary copy of the base, taken before the adapters go in."""
        return copy.deepcopy(self.policy).requires_grad_(False).to(rollout_dtype)

    def _shard(self) -> None:
        """One process: nothing to shard."""

    def sync_to(self, rollout) -> int:
        """The merged weights into the engine's copy, then on to an engine that takes them streamed."""
        moved = merge_into(self.policy, self.engine_model)
        return rollout.load_policy(self.engine_model) if rollout.streams_policy else moved

    def weights(self) -> dict:
        """The merged model's tensors by name."""
        merge_into(self.policy, self.engine_model)
        return self.engine_model.state_dict()

    def layers(self, dtype: torch.dtype | None = None, adapted_only: bool = False):
        """The merged model's tensors, at once (the engine's copy, merged into)."""
        merge_into(self.policy, self.engine_model)
        merged = self.engine_model.named_parameters()
        yield {n: p.detach() if dtype is None else p.detach().to(dtype) for n, p in merged}

    def _base_path(self) -> str:
        from ...model import resolve_model_path

        return str(Path(resolve_model_path(self.cfg.model.path)).resolve())

    def write_model(self, folder: Path, final: bool, tokenizer=None) -> None:
        """The adapter in PEFT's format into folder/model (and, with actor.lora.merged_export, the merged model in
        folder/merged at the end)."""
        from .lora_io import save_adapter, save_merged

        save_adapter(self.policy, folder / "model", self.lora, self._base_path())
        if final and self.lora.merged_export:
            save_merged(self.policy, folder / "merged", tokenizer)

    def shapes(self, dcp: bool = False) -> dict:
        """{name: shape} of the adapters by PEFT's names, or by the module's as dcp/ saves them (dcp=True); a DTensor
        shard's shape is the whole tensor's."""
        from .lora_io import adapter_state, module_names

        shapes = {n: tuple(t.shape) for n, t in adapter_state(self.policy).items()}
        return module_names(shapes) if dcp else shapes

    def load(self, model_sd: dict, optimizer_sd: dict | None, optimizer: torch.optim.Optimizer) -> None:
        """A one-process checkpoint's adapter (PEFT's names) and optimizer state."""
        from .lora_io import load_adapter_state

        load_adapter_state(self.policy, model_sd, "the checkpoint's adapter")
        self.prec.after_step()
        if optimizer_sd is not None:
            optimizer.load_state_dict(optimizer_sd)


class ShardedLoraWeights(LoraWeights):
    """N ranks: the adapters sharded, the frozen base whole on every rank; the rollout holds its own model, and the
    merged weights reach it streamed (lora.merged_layers)."""

    def _engine_copy(self, rollout_dtype: torch.dtype) -> None:
        return None  # the rollout loads its own

    def _shard(self) -> None:
        """The adapters sharded, the frozen base whole on every rank (fsdp.apply_fsdp_lora)."""
        t = self.cfg.trainer
        apply_fsdp_lora(self.policy, t.offload, t.activation_checkpointing)

    def layers(self, dtype: torch.dtype | None = None, adapted_only: bool = False):
        """Every rank gathers a layer's adapters; rank 0 streams (group.py). adapted_only: the merged adapted layers
        alone."""
        yield from merged_layers(self.policy, dtype, adapted_only)

    def write_model(self, folder: Path, final: bool, tokenizer=None) -> None:
        """Every rank gathers the adapters (and the merged layers); rank 0 writes."""
        from .lora_io import adapter_state, save_adapter

        base = self._base_path()
        state = adapter_state(self.policy, gather=True)
        if self.ranks.rank == 0:
            save_adapter(self.policy, folder / "model", self.lora, base, state)
        if final and self.lora.merged_export:
            save_layers(merged_layers(self.policy, torch.float32), folder / "merged", self.policy.config,
                        self.ranks.rank == 0, tokenizer)

    def load(self, model_sd: dict, optimizer_sd: dict | None, optimizer: torch.optim.Optimizer) -> None:
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
            optimizer.load_state_dict({"state": state, "param_groups": optimizer_sd["param_groups"]})
