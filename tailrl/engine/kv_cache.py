"""KV cache in slots: one slot per running sequence, [slots, kv_heads, capacity, head_dim] per layer.

Running sequences occupy slots 0..B-1 so attention reads a view, not a gather; a finished sequence's slot is
filled by moving the last one in. Capacity grows by doubling as the longest sequence grows. The memory
budget is enforced at admission on the worst case (every running sequence at its maximum length), so
growth never exceeds it and the engine never runs out of memory mid-rollout."""

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
        self.mirrors: list[KVCache] = []  # caches in the same slots (a draft head's): copies apply to them too

    def fits(self, num_slots: int, max_len: int) -> bool:
        return num_slots * max_len <= self.budget_tokens

    def ensure(self, num_slots: int, length: int) -> None:
        """Room for slots 0..num_slots-1 of at least length tokens. Grows by doubling within the budget; when the
        capacity grows, surplus slots beyond num_slots are dropped to stay within it (running slots are packed)."""
        if num_slots <= self.slots and length <= self.capacity:
            return
        cap = self.capacity if length <= self.capacity else max(length, min(2 * self.capacity, self.budget_tokens // max(num_slots, 1)))
        slots = self.slots if num_slots <= self.slots else max(num_slots, min(2 * self.slots, self.budget_tokens // cap))
        if slots * cap > self.budget_tokens:
            slots = max(num_slots, self.budget_tokens // cap)
        keep_slots, keep_cap = min(self.slots, slots), min(self.capacity, cap)
        shape = (slots, self.cfg.num_key_value_heads, cap, self.cfg.head_dim)
        for store in (self.k, self.v):
            for layer in range(self.cfg.num_hidden_layers):
                new = torch.zeros(shape, device=self.device, dtype=self.dtype)
                if layer < len(store):
                    new[:keep_slots, :, :keep_cap] = store[layer][:keep_slots, :, :keep_cap]
                    store[layer] = new
                else:
                    store.append(new)
        self.slots, self.capacity = slots, cap

    def copy(self, src: int, dst: int, length: int, dst_offset: int = 0, src_offset: int = 0) -> None:
        """Copies tokens src_offset.. of slot src to dst_offset.. of slot dst (fork of a prefill, slot compaction)."""
        for store in (self.k, self.v):
            for t in store:
                t[dst, :, dst_offset : dst_offset + length] = t[src, :, src_offset : src_offset + length]
        for m in self.mirrors:
            if src < m.slots and m.capacity:
                m.ensure(max(dst + 1, m.slots), 1)
                n = max(min(length, m.capacity - dst_offset, m.capacity - src_offset), 0)
                m.copy(src, dst, n, dst_offset, src_offset)

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Moves tokens within a slot (the accepted path of a draft tree to its final positions)."""
        src_t = torch.tensor(src, device=self.device)
        dst_t = torch.tensor(dst, device=self.device)
        for store in (self.k, self.v):
            for t in store:
                t[slot, :, dst_t] = t[slot, :, src_t]

    def allocated_bytes(self) -> int:
        return self.slots * self.capacity * self.bytes_per_token
