"""Linear weights packed once per weight version for the CPU's oneDNN product (the engine's plain passes).

`F.linear` on a CPU lays its weight out for the kernel on every call; a decode step's products have a few rows, so
that costs as much as the product (SmolLM2-135M fp32, 12 rows, AMD Zen 3: the LM head 141 -> 71 ms, the layers'
products 0.77x; benchmarks/RESULTS.md). vLLM's CPU backend and inductor's freezing pack once for the same reason.

The pack is keyed by the weight's version counter and storage, and by a generation that `invalidate_packs()` moves:
a `copy_` into the weight or a new tensor repacks at the next call, and so does every pack after an invalidation.
The version counter alone is not enough: torch's fused AdamW updates its parameters in place without moving their
version counters (torch 2.13), so an engine sharing the trainer's fp32 policy decoded from the weights it first
packed. The engine therefore invalidates its packs whenever a new batch starts (Engine._new_batch: requests or
imported sequences arriving at an idle engine):
weights change between rollouts, never during one. The packed product
is the same product with other rounding, so it serves the plain passes (exact in distribution); the
batch-invariant passes keep the module's own kernel, the one the start-up probe checked (engine/probe.py). Where
oneDNN cannot pack a dtype on this CPU (bf16 without AVX-512 or AVX-NE-CONVERT) the layer runs unpacked."""

from __future__ import annotations

import weakref

import torch
from torch import nn

# products of more rows (a prefill) run unpacked: from 256 rows the packed kernel was 1.1-1.15x slower than F.linear,
# at 12-64 rows 0.78x (Zen 3, fp32, 1 thread). SmolLM2's five product shapes weighted as in a layer, process time:
# 0.80x at 16 rows, 0.92x at 64, 0.93-0.94x at 96-128 (a verify pass of 32-64 sequences drafting 1-2), 0.98x at 192
PACK_ROWS = 128
_UNPACKABLE = "unpackable"
_PACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> (weight key, packed weight) or _UNPACKABLE
_GENERATION = [0]


def invalidate_packs() -> None:
    """Every packed weight is repacked at its next call (the weights may have changed in a way that moved no version
    counter, e.g. a fused optimizer step)."""
    _GENERATION[0] += 1


def _key(w: torch.Tensor) -> tuple:
    return _GENERATION[0], w._version, w.data_ptr(), w.dtype


def packed_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x), through a packed copy of layer.weight on a CPU for at most PACK_ROWS rows (no autograd: the
    engine's passes only)."""
    w = layer.weight
    if x.device.type != "cpu" or torch.is_grad_enabled() or x.shape[0] > PACK_ROWS:
        return layer(x)
    state = _PACKS.get(layer)
    if state is None or (state is not _UNPACKABLE and state[0] != _key(w)):
        try:
            state = (_key(w), torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16))
        except (RuntimeError, AttributeError):  # no oneDNN pack for this dtype on this CPU
            state = _UNPACKABLE
        _PACKS[layer] = state  # kept beside the module, not in it: a deepcopy or pickle of the model never sees it
    if state is _UNPACKABLE:
        return layer(x)
    return torch.ops.mkldnn._linear_pointwise(x, state[1], layer.bias, "none", [], "")
