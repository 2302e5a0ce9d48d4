"""Batch-invariant decoding: a token's logits do not depend on what else shares its forward.

Speculation verifies k drafted tokens in one pass where plain decoding runs one per sequence, and sequences finish
at other steps, so the same token meets passes of other shapes. In fp32 the results agree but for rounding at
near-ties; in bf16 they round apart often enough that SD on and off draw different rollouts (18 of 32 sampled
responses diverged in one test), and which ops round apart depends on the CPU: oneDNN picks other kernels with AMX,
with AVX512-BF16, with plain AVX-512 (where the LM head's rows change at 4 rows a pass) and with AVX2.

So the invariant passes are built so that no kernel call's shape depends on the pass:
- every matrix product runs on a whole number of ROW_TILE-row tiles (padding rows are dropped and write no K/V),
  through oneDNN's packed weights in every call (model/packed.py), in calls no larger than the probe found every
  tile to keep its bits in, for that weight shape (on an Intel CPU with AMX a product of 1,536 inner columns rounds
  its tiles otherwise in calls of 160 rows or more; model/chunked.py `in_calls`);
- on a CPU, attention is our C kernel reading each sequence's keys in place from the cache (model/paged_attention.py,
  csrc/paged_attention.c): a row's result is a fixed sequence of float operations over the keys it sees, whatever
  else is in the pass, so a decode row, a draft row and a prefill row of the same token get the same bits, a prompt
  may prefill beside others and a sequence re-prefilled after a move emits what it would have emitted; a pass costs
  what its sequences hold, as a plain pass on the same kernel does. Off a CPU (or without a C compiler) it reads
  each sequence's keys in CHUNK-key chunks at absolute offsets, in items of QUERY_BLOCK query tokens, merged per row
  in ascending chunk order through one scalar path (model/chunked.py);
- the sampler warps each row alone (engine/sampler.py).
What construction cannot promise (a fixed-shape product kernel treats all its rows alike; a library attention item
does not depend on how many share its call), and what our kernel promises by construction, the start-up probe
checks on the running process's kernels (engine/probe.py), and `batch_invariant=auto` falls back to the plain passes where it fails: then SD on and off draw from the same
distribution, not the same tokens.

A draft tree's branches are another matter: a node off the tree's first-child path sits in the pass after its
siblings' subtrees, so its row sees its ancestors with masked holes between them, and the keys' places in the
attention's sums differ from plain decoding's (our kernel sums a row's weights by key index mod 8). The speculator lays trees out depth-first (DraftTree.preorder),
and `contiguous_prefix` cuts an accepted path at its first node off that layout."""

from __future__ import annotations

from ..speculative.verify import Verdict


def contiguous_prefix(v: Verdict) -> Verdict:
    """Cuts an accepted path at its first node that does not sit right after its parent in the pass. That node's
    token stays, as the token drawn from its parent's row (a row without holes); the node's own row and K/V, and
    what follows, are dropped and decoded again. The cut point is a function of the emitted tokens (a stopping
    time), so the emitted sequence keeps the target's distribution, and with deterministic drafts the very
    tokens plain decoding draws."""
    n = 0
    while n < len(v.accepted_nodes) and v.accepted_nodes[n] == n:
        n += 1
    if n == len(v.accepted_nodes):
        return v
    return Verdict(v.accepted_nodes[:n], v.tokens[: n + 1], v.logprobs[: n + 1])
