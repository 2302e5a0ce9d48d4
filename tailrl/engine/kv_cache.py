"""Paged KV cache: per layer a pool of blocks [kv_heads, num_blocks, BLOCK, head_dim], and the block tables
(engine/blocks.py) that say which blocks each row (a running sequence) holds.

The pool is allocated once for the memory budget and never moves, so a captured CUDA graph keeps its addresses
(the tables' device copy is static too; `generation` never changes once allocated). Memory is touched lazily:
blocks past the highest one ever handed out are zeroed when they are first handed out (uninitialised memory
could hold NaN, and a masked key still multiplies its value by 0).

A forward addresses the cache through its StepMeta: `write` puts the new tokens' K/V at (slot, position) of
their rows, `keys` gathers each sequence's keys up to the pass's longest (dense passes), and `chunk_blocks`
names the blocks of each key chunk an invariant pass reads (model/chunked.py). The addresses of one pass are
computed once, at its first layer, from device tensors only (a CUDA graph captures them)."""

from __future__ import annotations

import torch

from ..model.chunked import CHUNK
from ..model.config import ModelConfig
from .blocks import BLOCK, BlockTables, blocks_for


class KVFull(RuntimeError):
    """The pool has no free block for a growth that was asked for."""


class KVCache:
    def __init__(self, cfg: ModelConfig, budget_bytes: int, device, dtype):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
        self.budget_tokens = int(budget_bytes // self.bytes_per_token)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.tables: BlockTables | None = None
        self.zeroed = 0  # blocks 0..zeroed-1 hold written or zeroed values
        self.generation = 0
        self.mirrors: list[KVCache] = []  # caches of another model (a draft head) that follow these tables
        self.parent: KVCache | None = None
        self._addr = (None, None)  # (step, its addresses): computed once per pass

    # ---- layout -------------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.tables.num_blocks if self.tables is not None else 0

    def budget_blocks(self) -> int:
        return self.budget_tokens // BLOCK

    def allocate(self, rows: int, max_len: int, num_blocks: int | None = None) -> None:
        """Allocates the pool (the budget's blocks, or num_blocks) and empty tables for `rows` rows of up to
        max_len positions (rounded up to whole key chunks of an invariant pass)."""
        width = blocks_for(-(-max_len // CHUNK) * CHUNK)
        n = num_blocks if num_blocks is not None else self.budget_blocks()
        self.tables = BlockTables(max(n, 2), rows, width, self.device)
        self._pools(self.tables.num_blocks)
        for m in self.mirrors:
            m.tables = self.tables
            m._pools(self.tables.num_blocks)

    def _pools(self, n: int) -> None:
        self.k.clear(), self.v.clear()
        # head-major: a gather of a sequence's blocks leaves each head's keys contiguous, as attention reads them
        shape = (self.cfg.num_key_value_heads, n, BLOCK, self.cfg.head_dim)
        for store in (self.k, self.v):
            for _ in range(self.cfg.num_hidden_layers):
                store.append(torch.empty(shape, device=self.device, dtype=self.dtype))
        self.zeroed = 0
        self.generation += 1
        self._touch(1)  # the null block

    def layout(self, rows: int, capacity: int) -> None:
        """A fixed layout (tests, benchmarks, the probe): `rows` rows that each hold `capacity` positions."""
        self.allocate(rows, capacity, rows * blocks_for(capacity) + 1)
        self.ensure(list(range(rows)), capacity)

    def sleep(self) -> None:
        """Frees the pools (no row may hold blocks): colocated with a trainer, the update gets the memory."""
        if self.tables is not None and self.tables.num_used:
            raise RuntimeError(f"KV cache sleep with {self.tables.num_used} blocks in use")
        for c in [self, *self.mirrors]:
            c.k.clear(), c.v.clear()

    def wake(self) -> None:
        """Allocates the pools again (a new generation: captured graphs are dropped)."""
        for c in [self, *self.mirrors]:
            if not c.k:
                c._pools(self.tables.num_blocks)

    def mirror(self, cfg: ModelConfig, extra: int = 0, dtype=None) -> KVCache:
        """A cache for another model (a draft head) on the same block tables: a row's blocks hold both models'
        K/V. It grows rows through this cache (`extra` is kept for the callers' room arithmetic)."""
        m = KVCache(cfg, 0, self.device, dtype or self.dtype)
        m.parent = self
        if self.tables is not None:
            m.tables = self.tables
            m._pools(self.tables.num_blocks)
        self.mirrors.append(m)
        return m

    def _touch(self, upto: int) -> None:
        """Makes blocks < upto safe to read (zeroes what was never written), in growing chunks."""
        if upto > self.zeroed:
            end = min(self.num_blocks, max(upto, 2 * self.zeroed, 64))
            for store in (self.k, self.v):
                for t in store:
                    t[:, self.zeroed : end].zero_()
            self.zeroed = end

    # ---- rows ---------------------------------------------------------------------------------------------

    def grow(self, row: int, length: int) -> bool:
        """Row `row` gets blocks for positions < length; False (nothing taken) when too few are free."""
        if self.parent is not None:
            return self.parent.grow(row, length)
        new = self.tables.grow(row, length)
        if new is None:
            return False
        if new:
            top = max(new) + 1
            for c in [self, *self.mirrors]:
                c._touch(top)
        return True

    def ensure(self, rows: list[int], lengths: int | list[int]) -> None:
        """Grows each row to its length, or raises KVFull naming the numbers."""
        lengths = [lengths] * len(rows) if isinstance(lengths, int) else lengths
        for r, n in zip(rows, lengths):
            if not self.grow(r, n):
                t = self.tables
                raise KVFull(f"no free KV blocks: row {r} needs {blocks_for(n) - len(t.blocks[r])} more blocks of "
                             f"{BLOCK} tokens, {t.num_free} of {t.num_blocks - 1} are free")

    def release(self, row: int) -> None:
        self.tables.release(row)

    def fork(self, src: int, dst: int, length: int) -> None:
        """dst shares src's prompt blocks (positions < length) and copies the partial last one."""
        pair = self.tables.fork(src, dst, length)
        if pair is not None:
            for c in [self, *self.mirrors]:
                # zero up to the new block before copying into it: else the lazy zeroing of a later grow would
                # wipe the copy (it did: dst's last prompt block read as zeros, the first rollout of a fresh engine)
                c._touch(pair[1] + 1)
                for store in (c.k, c.v):
                    for t in store:
                        t[:, pair[1]] = t[:, pair[0]]

    def move_row(self, src: int, dst: int) -> None:
        self.tables.move_row(src, dst)

    def room(self, row: int, cache_len: int) -> int:
        """Positions past cache_len + 1 (the next root) that row's blocks already hold: room for draft rows."""
        return self.tables.held(row) - cache_len - 1

    def used_bytes(self) -> int:
        return self.tables.num_used * BLOCK * self.bytes_per_token if self.tables else 0

    def peak_bytes(self) -> int:
        return self.tables.peak_used * BLOCK * self.bytes_per_token if self.tables else 0

    @property
    def capacity(self) -> int:
        """Positions one row's table can address."""
        return self.tables.width * BLOCK if self.tables else 0

    @property
    def slots(self) -> int:
        return self.tables.rows if self.tables else 0

    # ---- addressing (one forward) -------------------------------------------------------------------------

    def _addresses(self, step) -> dict:
        if self._addr[0] is not step:
            tab = self.tables.tables
            addr = {"flat": tab[step.token_slot, step.token_pos // BLOCK] * BLOCK + step.token_pos % BLOCK}
            if step.chunks is not None:
                plan = step.chunks
                per = CHUNK // BLOCK
                cols = plan.pair_chunk.view(-1, 1) * per + torch.arange(per, device=tab.device)
                pb = tab[plan.pair_slot.view(-1, 1), cols]  # [P, per] blocks of each (sequence, chunk) pair
                addr["chunks"] = [pb[c.pairs].reshape(-1) for c in plan.calls]
            elif not step.causal and not step.row_tile:
                nb = blocks_for(step.max_k)
                addr["keys"] = tab[step.slots, :nb].reshape(-1)
            self._addr = (step, addr)
        return self._addr[1]

    def write(self, layer: int, step, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, kv_heads, D]: the pass's new tokens, at their rows' (slot, position)."""
        flat = self._addresses(step)["flat"]
        for pool, x in ((self.k[layer], k), (self.v[layer], v)):
            pool.view(pool.shape[0], -1, pool.shape[3]).index_copy_(1, flat, x.transpose(0, 1))

    def keys(self, layer: int, step) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's keys and values at positions < step.max_k: [B, kv_heads, max_k, D] (strided views of a
        gather of its blocks)."""
        idx = self._addresses(step)["keys"]
        B = step.slots.shape[0]
        out = []
        for pool in (self.k[layer], self.v[layer]):
            g = pool.index_select(1, idx)
            out.append(g.view(pool.shape[0], B, -1, pool.shape[3])[:, :, : step.max_k].transpose(0, 1))
        return out[0], out[1]

    def chunk_blocks(self, step) -> list[torch.Tensor]:
        """Per kernel call of an invariant pass, the blocks of its items' key chunks, item after item."""
        return self._addresses(step)["chunks"]

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def block_table(self) -> torch.Tensor:
        """[rows, width] int64: the pool block of each row's positions BLOCK * c .. BLOCK * (c + 1) - 1 (kernels that
        read the pools in place take it)."""
        return self.tables.tables

    def move(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Moves tokens within rows: token src[i] of row slots[i] to position dst[i] (the accepted paths of draft
        trees, all sequences in one indexing op per layer)."""
        tab = self.tables.tables
        fs = tab[slots, src // BLOCK] * BLOCK + src % BLOCK
        fd = tab[slots, dst // BLOCK] * BLOCK + dst % BLOCK
        for store in (self.k, self.v):
            for t in store:
                flat = t.view(t.shape[0], -1, t.shape[3])
                flat[:, fd] = flat[:, fs]
