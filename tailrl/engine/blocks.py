"""Block tables of the paged KV cache: which fixed-size blocks of the pool each row (a running sequence) holds.

A row's position p lives in block tables[row][p // BLOCK] at offset p % BLOCK. Blocks are taken as a sequence
grows and given back when it leaves (finished, aborted, failed, exported, preempted), so a rollout holds what its
sequences hold, not prompt + `max_tokens` per slot (vLLM's PagedAttention). The n samples of one prompt share its
full blocks (reference counts); each copies only the last, partial block, the one it will write into (a
copy-on-write done at the fork, since every later write lands past the prompt).

Block 0 is the null block: never handed out, it stands in every table column a row does not hold, so a pass that
reads a whole chunk of keys reads finite values past a sequence's end (masked, but a masked key still multiplies
its value by 0); padded rows of a padded pass write there. Free blocks are handed out lowest id first, so the
memory a rollout touches stays compact. The prefix index (`remember`, `lookup`, `share`) names live full prompt
blocks by a hash chained over their tokens, so a request with the same first blocks references them instead of
computing them again (engine/scheduler.py); a block leaves the index when it is freed."""

from __future__ import annotations

import heapq

import torch

BLOCK = 16  # tokens per block (a power of two dividing model/chunked.py's CHUNK: chunks start on block boundaries)


def blocks_for(length: int) -> int:
    return -(-length // BLOCK)


def chain_keys(tokens: list[int], n: int) -> list[int]:
    """Key i names tokens[: (i + 1) * BLOCK] (a hash chained over the first n full blocks): two prompts share key i
    only if they share those tokens (up to a 64-bit hash collision)."""
    keys, h = [], 0
    for i in range(n):
        h = hash((h, tuple(tokens[i * BLOCK : (i + 1) * BLOCK])))
        keys.append(h)
    return keys


class BlockTables:
    def __init__(self, num_blocks: int, rows: int, width: int, device):
        """num_blocks in the pool (block 0 included), rows tables of `width` columns each."""
        if num_blocks < 2:
            raise ValueError(f"a paged KV cache needs at least 2 blocks of {BLOCK} tokens, got {num_blocks}")
        self.num_blocks, self.rows, self.width = num_blocks, rows, width
        self.free: list[int] = list(range(1, num_blocks))  # a heap
        self.refs = [0] * num_blocks
        self.blocks: list[list[int]] = [[] for _ in range(rows)]
        self.host = torch.zeros(rows, width, dtype=torch.long)
        device = torch.device(device)
        self.tables = self.host if device.type == "cpu" else torch.zeros(rows, width, dtype=torch.long, device=device)
        self.dirty = False
        self.peak_used = 0
        # the prefix index (Scheduler.prefix_cache): chain key of a prompt's first i+1 full blocks -> the block
        # holding block i, for blocks that are live (a row or a parked entry references them); forgotten when freed
        self.cached: dict[int, int] = {}
        self.key_of: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    def held(self, row: int) -> int:
        """Positions row holds blocks for."""
        return len(self.blocks[row]) * BLOCK

    def grow(self, row: int, length: int) -> list[int] | None:
        """Gives row blocks for positions < length. Returns the new blocks, or None (and takes nothing) when the
        pool has too few free ones."""
        have, need = len(self.blocks[row]), blocks_for(length)
        if need > self.width:
            raise ValueError(f"a sequence of {length} positions needs {need} blocks of {BLOCK}; a block table holds "
                             f"{self.width} ({self.width * BLOCK} positions)")
        if need <= have:
            return []
        if need - have > len(self.free):
            return None
        new = [heapq.heappop(self.free) for _ in range(need - have)]
        for b in new:
            self.refs[b] = 1
        self._set(row, self.blocks[row] + new)
        self.peak_used = max(self.peak_used, self.num_used)
        return new

    def release(self, row: int) -> None:
        for b in self.blocks[row]:
            self._unref(b)
        self._set(row, [])

    def _unref(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            heapq.heappush(self.free, b)
            key = self.key_of.pop(b, None)
            if key is not None:
                del self.cached[key]

    def remember(self, row: int, keys: list[int]) -> None:
        """Row's first len(keys) blocks hold the prompt blocks these chain keys name (a key already known keeps its
        block)."""
        for key, b in zip(keys, self.blocks[row]):
            if key not in self.cached and b not in self.key_of:
                self.cached[key] = b
                self.key_of[b] = key

    def lookup(self, keys: list[int]) -> list[int]:
        """The live blocks of the longest run of these chain keys from the first."""
        out = []
        for key in keys:
            b = self.cached.get(key)
            if b is None:
                break
            out.append(b)
        return out

    def share(self, row: int, blocks: list[int]) -> None:
        """An empty row references these live blocks as its first ones (a shared prompt prefix)."""
        if self.blocks[row]:
            raise RuntimeError(f"share into row {row}, which holds blocks")
        for b in blocks:
            self.refs[b] += 1
        self._set(row, list(blocks))

    def forget(self) -> None:
        """Empties the prefix index (the weights may change: K/V computed before is not shared after)."""
        self.cached.clear()
        self.key_of.clear()

    def detach(self, row: int) -> list[int]:
        """Takes row's blocks out of its table, references and all (the scheduler parks them; `attach` or `drop`)."""
        blocks = self.blocks[row]
        self._set(row, [])
        return blocks

    def attach(self, row: int, blocks: list[int]) -> None:
        """An empty row takes over parked blocks."""
        if self.blocks[row]:
            raise RuntimeError(f"attach into row {row}, which holds blocks")
        self._set(row, list(blocks))

    def drop(self, blocks: list[int]) -> None:
        """Gives back parked blocks."""
        for b in blocks:
            self._unref(b)

    def fork(self, src: int, dst: int, length: int) -> tuple[int, int] | None:
        """dst (an empty row) shares src's full blocks of positions < length and gets a block of its own for the
        rest. Returns (src's partial block, dst's copy of it) for the caller to copy, None when length ends on a
        block boundary (nothing to copy). Raises when no block is free (admission reserved it)."""
        if self.blocks[dst]:
            raise RuntimeError(f"fork into row {dst}, which holds blocks")
        full = length // BLOCK
        shared = self.blocks[src][:full]
        for b in shared:
            self.refs[b] += 1
        self._set(dst, list(shared))
        if length % BLOCK == 0:
            return None
        new = self.grow(dst, length)
        if not new:
            raise RuntimeError(f"no free KV block to fork row {src} into row {dst}")
        return self.blocks[src][full], new[0]

    def move_row(self, src: int, dst: int) -> None:
        """Row dst (empty) takes over src's blocks (the running batch stays in rows 0..B-1 with no data copied)."""
        if self.blocks[dst]:
            raise RuntimeError(f"move into row {dst}, which holds blocks")
        self._set(dst, self.blocks[src])
        self._set(src, [])

    def _set(self, row: int, blocks: list[int]) -> None:
        old = len(self.blocks[row])
        self.blocks[row] = blocks
        n = len(blocks)
        if n:
            self.host[row, :n] = torch.tensor(blocks, dtype=torch.long)
        if old > n:
            self.host[row, n:old] = 0
        self.dirty = self.tables is not self.host

    def sync(self) -> None:
        """Copies the host tables to the device copy (its address never changes: CUDA graphs read it)."""
        if self.dirty:
            self.tables.copy_(self.host)
            self.dirty = False
