"""The model runner: builds the inputs of prefill, decode and tree-verify passes, owns the KV cache and runs
the forward. It keeps only the accepted path of each verified tree in the cache.

It is the one place that knows about devices and buffers: the scheduler hands it slots and token lists, the
engine hands it draft trees, and what comes back is logits (and the last layer's hidden states when they are
captured for the learned drafter). Inputs are built with tensor operations (model/step.py); the per-sequence
Python work is list concatenation only.

Decode and verify passes are padded to buckets (engine/buckets.py) when CUDA graphs run them (engine/graphs.py;
on CUDA by default) or when `pad` asks for it without graphs (the CPU tests of padding); prefill and passes
past the largest bucket always run eagerly, unpadded. On CUDA each forward ends with a synchronize, so the
forward times the selector's cost model learns from are the device's, not the launch queue's."""

from __future__ import annotations

import os
import time

import torch

from ..model.llama import CausalLM
from ..model.step import make_step
from ..speculative.tree import DraftTree
from .buckets import Bucket, StaticBatch, forward_padded, pick_bucket
from .graphs import GraphPool
from .blocks import blocks_for
from .kv_cache import KVCache

LOOKAHEAD = 512  # table columns past the context: draft rows and a draft head's tree entries past a sequence


def default_kv_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(0.6 * free)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(0.25 * ram, 8 * 2**30))


class ModelRunner:
    def __init__(self, model: CausalLM, budget_bytes: int | None, max_num_seqs: int, max_model_len: int,
                 capture_hidden: bool = False, cuda_graphs: bool = False, graph_budget_bytes: int = 0,
                 pad: bool = False, invariant: bool = False):
        """cuda_graphs: replay decode/verify passes from a GraphPool (only where the model is on CUDA).
        pad: pad decode/verify passes to buckets even without graphs (eagerly).
        invariant: run decode/verify passes batch-invariantly (engine/invariant.py; no buckets then)."""
        self.model = model
        self.device = model.device
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        budget = budget_bytes if budget_bytes is not None else default_kv_budget(self.device)
        self.kv = KVCache(model.config, budget, self.device, model.dtype)
        self.kv.allocate(max_num_seqs, max_model_len + LOOKAHEAD)
        self.capture = capture_hidden
        self.hidden_layers = (model.config.num_hidden_layers,) if capture_hidden else ()
        self.last_forward_s = 0.0
        self.last_capture_s = 0.0  # CUDA-graph capture inside the last decode (one-time; not in last_forward_s)
        on_cuda = self.device.type == "cuda"
        self.graphs = GraphPool(self.device, graph_budget_bytes) if cuda_graphs and on_cuda else None
        self.pad = pad
        self.invariant = invariant
        self.batches: dict[tuple[int, int], StaticBatch] = {}  # (seqs, tokens) -> its static buffers

    # ---- the paged cache ----------------------------------------------------------------------------------

    def fits(self, length: int) -> bool:
        """Whether one sequence of this many positions can ever be held (the whole pool, one row's table)."""
        return blocks_for(length) <= self.kv.num_blocks - 1 and length <= self.kv.capacity

    def fork(self, src: int, dst: int, length: int) -> None:
        """Row dst shares row src's prompt (positions < length) and gets a block for its next token."""
        self.kv.fork(src, dst, length)
        self.kv.ensure([dst], length + 1)

    @property
    def num_slots(self) -> int:
        return self.kv.slots

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    # ---- forwards -----------------------------------------------------------------------------------------

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward(self, ids: list[int], step, logits_idx=None):
        t = time.perf_counter()
        self.kv.tables.sync()
        logits, hidden = self.model(torch.tensor(ids, device=self.device), step, self.kv, logits_idx=logits_idx,
                                    hidden_layers=self.hidden_layers)
        self._sync()
        self.last_forward_s = time.perf_counter() - t
        return logits, (hidden[self.hidden_layers[0]] if self.capture else None)

    def prefill(self, token_lists: list[list[int]], slots: list[int], starts: list[int] | None = None):
        """Writes each list's K/V into its slot from position starts[i] (0: the whole prompt; more: a continuation
        over K/V the slot holds already). Returns (logits at each list's last token [N, V],
        hidden [sum(lens), H] or None); the rows hold blocks for them (the scheduler grew them). A batch-invariant
        pass gives each list's K/V and logits the bits it would have alone, or in decode passes (engine/invariant.py),
        so prompts admitted together share one pass."""
        lens = [len(t) for t in token_lists]
        step = make_step(starts or [0] * len(lens), lens, slots, self.device, invariant=self.invariant)
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1
        return self._forward([t for toks in token_lists for t in toks], step, logits_idx=last)

    def decode(self, roots: list[int], cache_lens: list[int], trees: list[DraftTree | None] | None):
        """One pass over running slots 0..B-1: each sequence's last emitted token (the root) and its draft tree's
        nodes; each row holds blocks for its tree (Scheduler.make_room, and trees no larger than the room). Returns
        (logits [T, V], hidden [T, H] or None, q_lens, depths [T] or None), the same whether the pass ran padded
        (graph or eager) or not. A batch-invariant pass reads each sequence's own keys in fixed chunks
        (engine/invariant.py)."""
        B = len(roots)
        self.last_capture_s = 0.0
        trees = trees if trees and any(trees) else None
        q_lens = [1 + len(t) if t else 1 for t in trees] if trees else [1] * B
        inv = dict(invariant=self.invariant)
        if not self.invariant:
            max_k = max(c + q for c, q in zip(cache_lens, q_lens))
            bucket = self._bucket(B, max(q_lens), max_k)
            if bucket is not None:
                out = self._decode_padded(bucket, roots, trees, cache_lens)
                if out is not None:
                    return out[0], out[1], q_lens, out[2]
        if trees is None:
            logits, hidden = self._forward(roots, make_step(cache_lens, q_lens, list(range(B)), self.device, **inv))
            return logits, hidden, q_lens, None
        ids, parents = _tree_rows(roots, trees, max(q_lens))
        step = make_step(cache_lens, q_lens, list(range(B)), self.device,
                         tree_parents=torch.tensor(parents, device=self.device), **inv)
        logits, hidden = self._forward(ids, step)
        return logits, hidden, q_lens, step.depths

    def _bucket(self, B: int, max_q: int, max_k: int) -> Bucket | None:
        if self.graphs is None and not self.pad:
            return None
        if max_k >= self.kv.capacity:  # scratch = capacity - 1 must lie past every real token
            raise RuntimeError(f"a pass reaching key {max_k} leaves no scratch position in a cache of capacity "
                               f"{self.kv.capacity}: reserved_len must bound cache_len + tokens in the pass")
        return pick_bucket(B, max_q, max_k, self.kv.slots, self.kv.capacity)

    def _decode_padded(self, bucket: Bucket, roots, trees, cache_lens):
        """Runs the pass on its bucket's grid (a graph replay, or eagerly); returns the real rows' (logits, hidden,
        depths), or None when the graph pool declines and padding was not asked for."""
        t = time.perf_counter()
        key = (bucket.seqs, bucket.tokens)
        batch = self.batches.get(key)
        if batch is None:
            batch = self.batches[key] = StaticBatch(bucket.seqs, bucket.tokens, self.device)
        self.kv.tables.sync()
        rows = batch.fill(roots, trees, cache_lens)

        def fn():
            return forward_padded(self.model, self.kv, batch, bucket.keys, self.hidden_layers)

        out = self.graphs.run(bucket, batch, fn, self.kv.generation) if self.graphs is not None else None
        self.last_capture_s = self.graphs.last_capture_s if self.graphs is not None else 0.0
        if out is None and not self.pad:
            return None
        out = [None if o is None else o[rows] for o in (out if out is not None else fn())]
        self._sync()
        self.last_forward_s = time.perf_counter() - t - self.last_capture_s
        return out

    def keep_accepted(self, cache_lens: list[int], accepted: list[list[int]]) -> None:
        """Moves each sequence's accepted tree nodes (node i sits at cache_len + 1 + i) to the positions right
        after its cache, in order, for every running slot at once."""
        slots, src, dst = [], [], []
        for b, (c, nodes) in enumerate(zip(cache_lens, accepted)):
            for k, n in enumerate(nodes):
                if n != k:
                    slots.append(b)
                    src.append(c + 1 + n)
                    dst.append(c + 1 + k)
        if slots:
            dev = self.device
            self.kv.move(torch.tensor(slots, device=dev), torch.tensor(src, device=dev), torch.tensor(dst, device=dev))

    def path_rows(self, rows: torch.Tensor, q_lens: list[int], accepted: list[list[int]]) -> list[torch.Tensor]:
        """Per sequence, the rows of a decode pass's output (hidden states) on its verified path: the root, then
        the accepted nodes."""
        idx, counts, off = [], [], 0
        for q, nodes in zip(q_lens, accepted):
            idx += [off] + [off + 1 + a for a in nodes]
            counts.append(1 + len(nodes))
            off += q
        return list(rows[torch.tensor(idx, device=rows.device)].split(counts))


def _tree_rows(roots: list[int], trees: list[DraftTree | None], width: int) -> tuple[list[int], list[list[int]]]:
    """The packed ids of each sequence's root and tree nodes, and each sequence's parent rows padded to width (a
    root and a padded row point to themselves)."""
    ids, parents = [], []
    for r, t in zip(roots, trees):
        ids.append(r)
        row = [0]
        if t:
            ids.extend(t.tokens)
            row.extend(p + 1 for p in t.parents)
        parents.append(row + list(range(len(row), width)))
    return ids, parents
