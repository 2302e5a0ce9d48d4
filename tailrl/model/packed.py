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
is the same product with other rounding. The plain passes pack calls of up to PACK_ROWS rows; the batch-invariant
passes pack every call, whatever its rows (a row must meet one kernel in a call of 16 rows and of 256), and the
start-up probe checks the packed kernel they run (engine/probe.py; 1.5x the unpacked one's speed at a decode pass's
16 rows in bf16 on a Zen 4). Where oneDNN cannot pack a dtype on this CPU (bf16 without AVX-512 or AVX-NE-CONVERT)
the layer runs unpacked, in both."""

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


def pack_weight(w: torch.Tensor) -> torch.Tensor | None:
    """w laid out once for oneDNN's product on this CPU, or None where oneDNN cannot pack its dtype here."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)
    except (RuntimeError, AttributeError):  # no oneDNN pack for this dtype on this CPU
        return None


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_linear(layer: nn.Linear, x: torch.Tensor, max_rows: int | None = PACK_ROWS) -> torch.Tensor:
    """layer(x), through a packed copy of layer.weight on a CPU for at most max_rows rows (None: any number, as the
    batch-invariant passes need: one kernel whatever a call's rows; no autograd: the engine's passes only)."""
    w = layer.weight
    if x.device.type != "cpu" or torch.is_grad_enabled() or (max_rows is not None and x.shape[0] > max_rows):
        return layer(x)
    state = _PACKS.get(layer)
    if state is None or (state is not _UNPACKABLE and state[0] != _key(w)):
        packed = pack_weight(w)
        state = _UNPACKABLE if packed is None else (_key(w), packed)
        _PACKS[layer] = state  # kept beside the module, not in it: a deepcopy or pickle of the model never sees it
    if state is _UNPACKABLE:
        return layer(x)
    return linear_packed(x, state[1], layer.bias)
