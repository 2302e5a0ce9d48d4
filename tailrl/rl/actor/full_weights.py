"""Full fine-tuning's weights: every parameter of the policy trained, an fp32 master of each. `FullWeights` in one
process, `ShardedWeights` over N FSDP2 ranks (fsdp.py). The Actor (actor.py) holds one of these or of LoRA's
(lora_weights.py), chosen once, and calls the same methods on either:

- `policy`, `engine_model` (the module the in-process engine runs, None over N ranks), `prec` (precision.py), `ref`
  (the frozen KL reference, None without KL), set up in the constructor;
- `sync_to(rollout)`, `weights()`, `layers(dtype, adapted_only)`: the weights out to the rollout;
- `write_model(folder, final, tokenizer)`, `shapes(dcp)`, `load(model_sd, optimizer_sd, optimizer)`: checkpoints.

Invariants: the optimizer, its state and checkpoints only ever see the fp32 master; the compute copy and the
engine's copy are functions of it (refreshed after each step, or the same module)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from ...config import Config
from ...model import save_pretrained
from ...model.load import save_layers
from .fsdp import apply_fsdp, full_layers
from .precision import Precision
from .ranks import Ranks


class FullWeights:
    """One process: the fp32 master is the policy; the engine runs it (fp32) or its own copy in the rollout dtype,
    and a bf16 compute copy is that engine copy when both are bf16."""

    @staticmethod
    def dtype(mode: str) -> torch.dtype:
        """The dtype the policy is loaded in: the fp32 master."""
        return torch.float32

    def __init__(self, cfg: Config, policy: torch.nn.Module, mode: str, rollout_dtype: torch.dtype, ranks: Ranks):
        self.cfg, self.ranks, self.policy = cfg, ranks, policy
        self.engine_model = policy if rollout_dtype == torch.float32 else copy.deepcopy(policy).to(rollout_dtype)
        # a bf16 compute copy and the bf16 engine hold the same weights after every update: one module serves both
        self.prec = Precision(policy, mode, self.engine_model if self.engine_model.dtype == torch.bfloat16 else None)
        self.ref = copy.deepcopy(self.prec.model).requires_grad_(False) if cfg.algo.kl_coef > 0 else None

    def sync_to(self, rollout) -> int:
        """The policy into the rollout; 0 bytes when the engine runs the policy or its bf16 compute copy, which the
        optimizer step updated in place."""
        if not rollout.streams_policy and (self.engine_model is self.policy or self.engine_model is self.prec.model):
            return 0
        return rollout.load_policy(self.policy)

    def weights(self) -> dict:
        return self.policy.state_dict()

    def layers(self, dtype: torch.dtype | None = None, adapted_only: bool = False):
        """The policy's own tensors, at once (adapted_only is LoRA's)."""
        yield {n: p.detach() if dtype is None else p.detach().to(dtype) for n, p in self.policy.named_parameters()}

    def write_model(self, folder: Path, final: bool, tokenizer=None) -> None:
        """The HF export (config.json + safetensors) into folder/model."""
        save_pretrained(self.policy, folder / "model")

    def shapes(self, dcp: bool = False) -> dict:
        """{name: shape} of the policy's state dict (a DTensor shard's shape is the whole tensor's)."""
        return {n: tuple(t.shape) for n, t in self.policy.state_dict().items()}

    def load(self, model_sd: dict, optimizer_sd: dict | None, optimizer: torch.optim.Optimizer) -> None:
        """A one-process checkpoint's weights (HF names, the tied head saved once) and optimizer state."""
        sd = dict(model_sd)
        if self.policy.config.tie_word_embeddings:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        self.policy.load_state_dict(sd)
        self.prec.after_step()
        if optimizer_sd is not None:
            optimizer.load_state_dict(optimizer_sd)


class ShardedWeights(FullWeights):
    """N ranks: the policy (and the reference) sharded with FSDP2, whose MixedPrecisionPolicy does what the bf16
    compute copy does in one process; the rollout holds its own model, and the weights reach it streamed."""

    def __init__(self, cfg: Config, policy: torch.nn.Module, mode: str, rollout_dtype: torch.dtype, ranks: Ranks):
        t = cfg.trainer
        self.cfg, self.ranks, self.policy = cfg, ranks, policy
        self.engine_model = None
        self.ref = copy.deepcopy(policy).requires_grad_(False) if cfg.algo.kl_coef > 0 else None
        apply_fsdp(policy, mode, t.offload, t.activation_checkpointing)
        if self.ref is not None:
            apply_fsdp(self.ref, mode)
        self.prec = Precision(policy, "float32" if mode == "bfloat16" else mode)
        self.prec.mode = mode

    def layers(self, dtype: torch.dtype | None = None, adapted_only: bool = False):
        """Every rank: the full tensors a layer at a time (fsdp.full_layers)."""
        yield from full_layers(self.policy, dtype)

    def write_model(self, folder: Path, final: bool, tokenizer=None) -> None:
        """Every rank gathers the layers in turn; rank 0 writes the HF export into folder/model."""
        save_layers(self.layers(None), folder / "model", self.policy.config, self.ranks.rank == 0)
