"""FSDP2 for the actor (torchtitan's order): `fully_shard` on each decoder layer, then on the root (embeddings,
final norm and LM head: one group), one `MixedPrecisionPolicy`. model/, spec/ and engine/ never import this.

Invariants:
- The master weights and AdamW's moments stay fp32 and are sharded (each rank holds about 1/N of them);
  `model.train_compute=bfloat16` (or auto with a bf16 engine) computes in bf16 (`param_dtype`) and reduces
  gradients in fp32 (`reduce_dtype`); float32 computes in fp32; autocast keeps fp32 parameters under
  torch.autocast (forward.py), as at world_size=1.
- Gradients are summed over ranks, not averaged (the loss normalisers are global already: ranks.py).
- `layer_groups` yields a layer's full tensors at a time (gathered shard by shard, cast first, so a layer is
  gathered in the stream's dtype and no rank ever holds the whole model in fp32)."""

from __future__ import annotations

import torch


def apply_fsdp(model: torch.nn.Module, mode: str, offload: bool = False, checkpointing: bool = False) -> None:
    """Shards `model` (a tailrl CausalLM) in place across the default process group."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if mode == "bfloat16" else None, reduce_dtype=torch.float32)
    extra = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    for layer in model.model.layers:
        if checkpointing:
            checkpoint_layer(layer)
        fully_shard(layer, mp_policy=mp, **extra)
    fully_shard(model, mp_policy=mp, **extra)
    # the trainer's forward is forward_shared (packing.py): it gathers the root's shards as forward would
    register_fsdp_forward_method(model, "forward_shared")
    for m in [*model.model.layers, model]:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)


def apply_fsdp_lora(model: torch.nn.Module, offload: bool = False, checkpointing: bool = False) -> None:
    """LoRA over FSDP2 (a model after lora.add_adapters): the same groups as `apply_fsdp` (each decoder layer, then
    the root), each managing only its trainable tensors (the adapters: `ignored_params` is the frozen base), so the
    fp32 adapters, their gradients and AdamW's moments are sharded and the frozen base stays whole on every rank, in
    its compute dtype. Why the base is not sharded: FSDP2 gathers a group in one dtype, and the base (bf16) and the
    adapters (fp32 masters) would then be gathered both in bf16 (param_dtype) -- the adapters rounded before their
    own per-use cast, and the base re-gathered in every forward and backward for nothing it learns. The adapters
    are gathered in fp32 (no param_dtype) and computed as at one rank (lora.ComputeCast, _lean_forward: cast per
    use to the base's dtype), gradients reduced in fp32. A decoder layer's pre-forward hook gathers its adapters
    whatever reads them (the fused `_lean_forward` reads the weights directly, not through the adapter modules'
    forward), and the backward hook gathers them again (reshard after forward)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    extra = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    frozen = {p for p in model.parameters() if not p.requires_grad}
    for layer in model.model.layers:
        if checkpointing:
            checkpoint_layer(layer)
        fully_shard(layer, mp_policy=mp, ignored_params={p for p in layer.parameters() if p in frozen}, **extra)
    fully_shard(model, mp_policy=mp, ignored_params=frozen, **extra)
    register_fsdp_forward_method(model, "forward_shared")
    for m in [*model.model.layers, model]:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)


def checkpoint_layer(layer: torch.nn.Module) -> None:
    """Activation checkpointing of one decoder layer: its activations are recomputed in the backward. The
    layer's forward is wrapped in place, so parameter names (and checkpoints) stay those of the model."""
    from torch.utils.checkpoint import checkpoint

    inner = layer.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    layer.forward = forward


def _full(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.detach()
    if dtype is not None:
        t = t.to(dtype)
    return t.full_tensor() if isinstance(t, DTensor) else t


def layer_groups(model: torch.nn.Module):
    """The parameter names of the model in groups: the root's (embeddings, norm, head), then one per layer."""
    names = [n for n, _ in model.named_parameters()]
    per_layer: dict[int, list[str]] = {}
    root = []
    for n in names:
        parts = n.split(".")
        if n.startswith("model.layers.") and parts[2].isdigit():
            per_layer.setdefault(int(parts[2]), []).append(n)
        else:
            root.append(n)
    return [root] + [per_layer[i] for i in sorted(per_layer)]


def full_layers(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """Yields, per group of `layer_groups`, {name: full tensor} (every rank must iterate it: each tensor is an
    all-gather). dtype: cast each shard before gathering (bf16 for the engine; None keeps fp32)."""
    params = dict(model.named_parameters())
    for group in layer_groups(model):
        yield {n: _full(params[n], dtype) for n in group}


def local_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes this rank holds of the parameters and of the optimizer's state (its shards only)."""
    from torch.distributed.tensor import DTensor

    def size(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    out = {"params": sum(size(p) for p in model.parameters()), "optimizer": 0}
    if optimizer is not None:
        out["optimizer"] = sum(size(v) for st in optimizer.state.values() for v in st.values()
                               if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out
