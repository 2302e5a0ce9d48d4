"""KV cache in slots: one slot per running sequence, [slots, kv_heads, capacity, head_dim] per layer.

The storage is allocated once for its layout (slots x capacity within the memory budget) and never moves while
sequences run, so a captured CUDA graph keeps its addresses; `generation` counts re-layouts, and a graph captured
under another generation must not replay (engine/graphs.py clears its pool). Running sequences occupy slots 0..B-1 so attention
reads a view, not a gather; a finished sequence's slot is filled by moving the last one in. Memory is touched
lazily: positions past the highest one ever read are zeroed only when reads reach them (uninitialised memory
could hold NaN, and a masked key still multiplies its value by 0)."""

from __future__ import annotations

import torch

from ..model.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, budget_bytes: int, device, dtype):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
        self.budget_tokens = int(budget_bytes // self.bytes_per_token)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.slots = 0
        self.capacity = 0
        self.zeroed = 0  # positions 0..zeroed-1 of every slot hold written or zeroed values
        self.generation = 0  # bumped by every re-allocation: storage addresses are stable within one generation
        self.mirrors: list[tuple[KVCache, int]] = []  # caches in the same slots (a draft head's), with extra capacity

    def mirror(self, cfg: ModelConfig, extra: int, dtype=None) -> KVCache:
        """A cache for another model (a draft head) in the same slots, `extra` positions longer; slot copies and
        re-layouts of this cache apply to it too."""
        m = KVCache(cfg, 0, self.device, dtype or self.dtype)
        m.budget_tokens = (self.budget_tokens // max(self.capacity, 1) + 1) * (self.capacity + extra)
        if self.slots:
            m.layout(self.slots, self.capacity + extra)
        self.mirrors.append((m, extra))
        return m

    def slots_for(self, capacity: int, max_slots: int) -> int:
        return min(max_slots, self.budget_tokens // max(capacity, 1))

    def layout(self, slots: int, capacity: int) -> None:
        """(Re)allocates the storage: only while no sequence is running (the contents are dropped)."""
        if (slots, capacity) != (self.slots, self.capacity):
            self.k.clear(), self.v.clear()  # free the old storage before allocating the new
            shape = (slots, self.cfg.num_key_value_heads, capacity, self.cfg.head_dim)
            for store in (self.k, self.v):
                for _ in range(self.cfg.num_hidden_layers):
                    store.append(torch.empty(shape, device=self.device, dtype=self.dtype))
            self.slots, self.capacity, self.zeroed = slots, capacity, 0
            self.generation += 1
        for m, extra in self.mirrors:
            m.layout(slots, capacity + extra)

    def touch(self, length: int) -> None:
        """Makes positions < length safe to read (zeroes what was never written)."""
        if length > self.zeroed:
            end = min(self.capacity, max(length, 2 * self.zeroed, 64))  # in growing chunks: few calls per rollout
            for store in (self.k, self.v):
                for t in store:
                    t[:, :, self.zeroed : end].zero_()
            self.zeroed = end

    def ensure(self, num_slots: int, length: int) -> None:
        if num_slots > self.slots or length > self.capacity:
            raise RuntimeError(f"KV cache layout {self.slots} slots x {self.capacity} positions cannot hold "
                               f"{num_slots} slots x {length}")
        self.touch(length)

    def copy(self, src: int, dst: int, length: int) -> None:
        """Copies the first `length` tokens of slot src to slot dst (fork of a prefill, slot compaction)."""
        for store in (self.k, self.v):
            for t in store:
                t[dst, :, :length] = t[src, :, :length]
        for m, _ in self.mirrors:
            m.copy(src, dst, min(length, m.zeroed))

    def move(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Moves tokens within slots: token src[i] of slot slots[i] to position dst[i] (the accepted paths of
        draft trees, all sequences in one indexing op per layer)."""
        for store in (self.k, self.v):
            for t in store:
                t[slots, :, dst] = t[slots, :, src]

    def allocated_bytes(self) -> int:
        return self.slots * self.capacity * self.bytes_per_token
