"""LoRA on the policy (Hu et al. 2021, arXiv:2106.09685) through PEFT's adapter layers: each target projection
computes W x + (alpha / r) B A x, W frozen, A and B trained.

Invariants:
- The base is frozen in the compute dtype (bf16 under `train_compute=bfloat16`): no fp32 master copy, no AdamW
  moments and no gradients for it. The adapters are fp32 (the optimizer's master weights) and compute in the base's
  dtype: over a bf16 base their products are bf16 with the weights cast per use (`ComputeCast`), as the full
  model's bf16 compute copy does; over an fp32 base, fp32.
- The rollout engine runs an ordinary model: `merge_into` writes W + (alpha / r) B A, formed in fp32 and rounded
  once to the engine's dtype, into the engine's own copy once per sync. Speculation, the batch-invariant passes and
  the drafter see plain weights, so their exactness arguments hold unchanged; the policy's W is never written
  (merging touches the engine copy only), so "unmerging" is exact by construction.
- The KL reference is the policy with its adapters switched off (`BaseReference`): the base itself, no second
  copy of the weights.
- Over N FSDP2 ranks (`trainer.world_size > 1`, fsdp.apply_fsdp_lora) the adapters are DTensor shards between
  steps: what reads them whole (`delta`, `merged_layers`, lora_io's saving) gathers them, a collective that every
  rank runs in the same order."""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn

from ...config.actor import LoraCfg


def targets(model: nn.Module, lora: LoraCfg) -> dict[str, nn.Linear]:
    """{module name: layer} of the layers `lora.target_modules` names (PEFT's rule: the name ends with a target).
    ValueError naming a target the model lacks, or a rank above a layer's width."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    found = {}
    for t in lora.target_modules:
        hit = {n: m for n, m in linears.items() if n == t or n.endswith("." + t)}
        if not hit:
            kinds = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise ValueError(f"actor.lora.target_modules: the model has no layer named {t!r} (its linear layers: "
                             f"{', '.join(kinds)})")
        found.update(hit)
    for n, m in found.items():
        if lora.rank > min(m.in_features, m.out_features):
            raise ValueError(f"actor.lora.rank={lora.rank} is above the width of {n} ({m.in_features} -> "
                             f"{m.out_features}): a rank-{lora.rank} update of that layer does not exist; use "
                             f"a rank <= {min(m.in_features, m.out_features)}")
    return found


def peft_config(lora: LoraCfg, base_path: str = ""):
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=base_path or None)


def add_adapters(model: nn.Module, lora: LoraCfg) -> nn.Module:
    """Freezes the model and injects fp32 LoRA adapters into the target layers (in place; returns the model). A and B
    are initialised as PEFT does (A Kaiming-uniform from torch's RNG, B zero): the adapted model starts equal to
    the base. Over a bf16 base the adapters compute in bf16 (`ComputeCast`)."""
    from peft import inject_adapter_in_model

    targets(model, lora)
    model.requires_grad_(False)
    inject_adapter_in_model(peft_config(lora), model)
    for n, p in model.named_parameters():
        if ".lora_" in n:
            p.data = p.data.float()  # PEFT puts them in the base's dtype; the master precision is fp32
            p.requires_grad_(True)
    if model.dtype == torch.bfloat16:
        for layer in lora_layers(model).values():
            layer.cast_input_dtype_enabled = False  # x stays bf16: PEFT would cast it to the adapters' fp32
            for name in layer.active_adapters:
                for m in (layer.lora_A[name], layer.lora_B[name]):
                    m.__class__ = ComputeCast
            if type(layer).__name__ == "Linear" and not layer.use_dora.get(layer.active_adapters[0], False):
                layer.forward = types.MethodType(_lean_forward, layer)
    return model


def _lean_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """PEFT's LoRA Linear forward for one plain adapter, with the sum fused: W x + (s B) (A x) as one addmm onto the
    base's output (s B is an out x r matrix formed per use), instead of PEFT's product, scaling multiply and add,
    two passes over the [tokens, out] output. Adapters off or merged: the base alone, as PEFT."""
    result = self.base_layer(x, *args, **kwargs)
    if self.disable_adapters or self.merged or not self.active_adapters:
        return result
    name = self.active_adapters[0]
    a, b = self.lora_A[name].weight, self.lora_B[name].weight
    h = self.lora_dropout[name](x)
    h = nn.functional.linear(h, a.to(x.dtype))
    sb = (b * self.scaling[name]).to(x.dtype)
    out = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]), sb.t())
    return out.view(result.shape)


class ComputeCast(nn.Linear):
    """An adapter matrix whose fp32 weight is the master and whose product runs in its input's dtype: over a bf16 base,
    x A^T and (x A^T) B^T are bf16 products (fp32 accumulation inside, as the full model's bf16 compute copy does:
    precision.py), so no [tokens, width] activation is cast to fp32 and back at each of the seven projections, and
    the product's gradient reaches the fp32 weight through the cast. The cast per use is of an r x width matrix."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{HF module name: PEFT LoRA layer}."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_adapters(model: nn.Module) -> bool:
    return bool(lora_layers(model))


def full(t: torch.Tensor) -> torch.Tensor:
    """t detached, gathered whole when it is an FSDP2 shard (a collective: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def delta(layer) -> torch.Tensor:
    """(alpha / r) B A of a PEFT layer's active adapter, fp32 (gathered whole over FSDP2 ranks)."""
    name = layer.active_adapters[0]
    a, b = full(layer.lora_A[name].weight), full(layer.lora_B[name].weight)
    return (b.float() @ a.float()) * layer.scaling[name]


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base's tensors under HF names (PEFT's `.base_layer` dropped, adapters left out)."""
    return {n.replace(".base_layer.", "."): t for n, t in model.state_dict().items() if ".lora_" not in n}


def merged_state(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The HF state dict of the merged model: W + (alpha / r) B A on adapted layers (fp32 sum, one rounding to
    dtype), the other tensors as they are (cast to dtype)."""
    out = base_state(model)
    for name, layer in lora_layers(model).items():
        w = layer.get_base_layer().weight
        out[name + ".weight"] = w.detach().float() + delta(layer)
    if dtype is not None:
        out = {n: t.to(dtype) for n, t in out.items()}
    return out


def merge_into(model: nn.Module, engine_model: nn.Module) -> int:
    """The merged weights into `engine_model` (an ordinary CausalLM of the same config), in place, in its dtype.
    Only the adapted layers change between syncs, so only they are written. Returns the bytes written."""
    dst, moved = engine_model.state_dict(), 0
    with torch.no_grad():
        for name, layer in lora_layers(model).items():
            d = dst[name + ".weight"]
            d.copy_((layer.get_base_layer().weight.float() + delta(layer)).to(d.dtype))
            moved += d.numel() * d.element_size()
    return moved


def merged_layers(model: nn.Module, dtype: torch.dtype | None = None, adapted_only: bool = False):
    """Every rank of an FSDP2 LoRA policy (one process too): per group of fsdp.layer_groups (the root's tensors, then
    one decoder layer at a time), {HF name: tensor} of the merged model, W + (alpha / r) B A on adapted layers (fp32
    sum, one rounding to dtype) and the base's other tensors (cast to dtype): what full fine-tuning's
    fsdp.full_layers streams, so the engine takes it the same way. Only a layer's adapters are gathered, never the
    base (it is whole on every rank). adapted_only: the adapted layers' weights alone (the rest is the base, which an
    engine that loaded the base holds already), a group without one left out."""
    from .fsdp import layer_groups

    layers = lora_layers(model)
    params = dict(model.named_parameters())
    for group in layer_groups(model):
        out = {}
        for n in group:
            if ".lora_" in n:
                continue
            t = params[n].detach()
            if n.endswith(".base_layer.weight"):
                t = t.float() + delta(layers[n.removesuffix(".base_layer.weight")])
            elif adapted_only:
                continue
            out[n.replace(".base_layer.", ".")] = t if dtype is None else t.to(dtype)
        if out:
            yield out


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The model computes as its base while inside (PEFT's disable-adapter switch), restored after."""
    layers = list(lora_layers(model).values())
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)


class BaseReference:
    """The KL reference of a LoRA policy: the same module with its adapters off (TRL and verl do the same). It
    answers what the update asks of a reference module (device, lm_head, forward_shared)."""

    def __init__(self, policy: nn.Module):
        self.policy = policy

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @property
    def lm_head(self) -> nn.Module:
        return self.policy.lm_head

    def forward_shared(self, *args, **kwargs):
        with adapters_off(self.policy):
            return self.policy.forward_shared(*args, **kwargs)

    def reshard(self) -> None:
        if hasattr(self.policy, "reshard"):  # FSDP2 ranks: the adapters' shards back in place (ranks.reshard)
            self.policy.reshard()
