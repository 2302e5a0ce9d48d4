"""Decode and verify passes padded to fixed shapes: the buckets, and the static buffers of each shape.

A pass of B sequences with up to Q tokens each (the last emitted token and its draft tree) whose longest
sequence reaches key position max_k runs as the smallest bucket (seqs, tokens, keys): seqs >= B from
BATCH_SIZES (capped at the cache's slot count), tokens >= Q from TOKENS_PER_SEQ, and keys >= max_k a power of
two from MIN_KEYS up (capped at the capacity). Keys are bucketed as well because attention reads every key
position it is given: reading a long cache's whole capacity every step would cost more than padding saves.
Passes past the largest bucket run unpadded.

Padding never changes a real token's result (model/step.py make_padded_step): padded rows write their K/V to
the last cache position of their slot, which real tokens never reach (ModelRunner checks it), and see key 0
only. A padded sequence (b >= B) sits in a free slot: running sequences always occupy slots 0..B-1."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.llama import CausalLM
from ..model.step import make_padded_step
from ..speculative.tree import DraftTree
from .kv_cache import KVCache

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKENS_PER_SEQ = (1, 2, 4, 8, 16, 32)
MIN_KEYS = 256


@dataclass(frozen=True)
class Bucket:
    seqs: int
    tokens: int  # per sequence
    keys: int  # key positions attention reads per sequence

    def __str__(self) -> str:
        return f"{self.seqs}x{self.tokens}@{self.keys}"


def pick_bucket(num_seqs: int, max_q: int, max_k: int, slots: int, capacity: int) -> Bucket | None:
    """The smallest bucket holding the pass, or None past the largest one (the pass then runs unpadded)."""
    seqs = next((b for b in BATCH_SIZES if b >= num_seqs), None)
    tokens = next((q for q in TOKENS_PER_SEQ if q >= max_q), None)
    if seqs is None or tokens is None:
        return None
    keys = min(max(MIN_KEYS, 1 << max(max_k - 1, 0).bit_length()), capacity)
    return Bucket(min(seqs, slots), tokens, keys)


class StaticBatch:
    """Input and output buffers of one (seqs, tokens) shape, at fixed addresses for the life of the runner, shared
    by the graphs of that shape's key buckets. The inputs are views of one int64 device buffer that a single
    host-to-device copy fills per pass: ids [S*Q], cache_lens [S], q_lens [S], parents [S, Q] (tokens > 1 only),
    then the real rows' indices into the grid (variable length, read outside any graph). `outputs` are written
    by a graph's replay (allocated at the shape's first capture)."""

    def __init__(self, seqs: int, tokens: int, device: torch.device):
        self.seqs, self.tokens = seqs, tokens
        n = seqs * tokens
        tree = n if tokens > 1 else 0
        self.flat = torch.zeros(n + 2 * seqs + tree + n, dtype=torch.long, device=device)
        self.ids = self.flat[:n]
        self.cache_lens = self.flat[n : n + seqs]
        self.q_lens = self.flat[n + seqs : n + 2 * seqs]
        self.parents = self.flat[n + 2 * seqs : n + 2 * seqs + tree].view(seqs, tokens) if tree else None
        self.rows = self.flat[n + 2 * seqs + tree :]
        self.outputs: tuple[torch.Tensor | None, ...] | None = None

    def fill(self, roots: list[int], trees: list[DraftTree | None] | None, cache_lens: list[int]) -> torch.Tensor:
        """Writes one pass's inputs (len(roots) <= seqs, every tree shorter than tokens). Returns the real rows'
        indices in the grid [T], in packed order (sequence after sequence, root first): valid until the next fill."""
        S, Q = self.seqs, self.tokens
        ids = [0] * (S * Q)
        parents = list(range(Q)) * S if Q > 1 else []  # padded rows point to themselves
        q_lens, rows = [], []
        for b, root in enumerate(roots):
            t, o = trees[b] if trees else None, b * Q
            n = 1 + (len(t) if t else 0)
            ids[o] = root
            if t:
                ids[o + 1 : o + n] = t.tokens
                parents[o + 1 : o + n] = [p + 1 for p in t.parents]
            q_lens.append(n)
            rows.extend(range(o, o + n))
        pad = [0] * (S - len(roots))
        host = torch.tensor(ids + list(cache_lens) + pad + q_lens + pad + parents + rows, dtype=torch.long)
        self.flat[: host.shape[0]].copy_(host)
        return self.rows[: len(rows)]


def forward_padded(model: CausalLM, kv: KVCache, batch: StaticBatch, keys: int, hidden_layers: tuple[int, ...]):
    """One padded pass over the batch's current inputs: (logits [S*Q, V], hidden [S*Q, H] or None, depths [S*Q]
    or None). Only fixed-shape tensor ops on the batch's buffers and the cache: a CUDA graph can capture it."""
    step = make_padded_step(batch.cache_lens, batch.q_lens, batch.parents, keys, kv.capacity - 1)
    logits, hidden = model(batch.ids, step, kv, hidden_layers=hidden_layers)
    return logits, (hidden[hidden_layers[0]] if hidden_layers else None), step.depths
