"""Batch-invariant decoding: a token's logits do not depend on how many other tokens share its forward.

Speculation verifies k drafted tokens in one pass where plain decoding runs one per sequence, and sequences finish
at other steps, so the same token meets passes of other shapes. In fp32 the results agree but for rounding at
near-ties; in bf16 on a CPU they round apart often enough that SD on and off draw different rollouts (18 of 32
sampled responses diverged in one test). Measured on this CPU's bf16 kernels (oneDNN through torch 2.13):

- a linear layer's output row is the same for every number of rows M >= 2; M = 1 takes another kernel;
- the fused attention kernel's output row is the same for every batch and every query count Q >= 4 (Q = 1..3
  round apart), but only at one fixed key length: padding the keys changes the result even where masked.

So an invariant pass reads every one of the cache's `capacity` key positions, pads each sequence's query rows
to MIN_QUERY_ROWS (padded rows see valid keys, so their softmax is finite, and are dropped), and never runs a
single-row matrix product: a lone sequence decoding without a draft gets a second row (its root again, one
position on; the K/V it writes there is overwritten by the next token, and causal order hides it from the real
row).

A draft tree's branches are another matter: a node off the tree's first-child path sits in the pass after its
siblings' subtrees, so its row sees its ancestors with masked holes between them, and the keys' order in the
attention's sums differs from plain decoding's. The speculator lays trees out depth-first (DraftTree.preorder),
and `contiguous_prefix` cuts an accepted path at its first node off that layout.

Prefill pads a batch's prompts to the longest, so a prompt's K/V would depend on its batch-mates (which differ
between workers and between steps); an invariant runner prefills each prompt alone.

The key length is the cache layout's capacity, which grows with the longest request an engine has seen: two
engines round alike once their layouts match (the same config and the same requests, e.g. the same evaluation
schedule in a training run). A run without evaluation, or a worker that never saw the longest prompt, may lay out
fewer positions and then draws other tokens, from the same distribution.

What it costs is measured by `benchmarks/invariant.py`. It is a CPU-bf16 property: other kernels (CUDA's
split-K GEMMs, fp32 on CPU) need their own analysis, and `auto` turns it on only for bf16 on a CPU."""

from __future__ import annotations

import torch

from ..spec.verify import Verdict

MIN_QUERY_ROWS = 4


def resolve_invariant(setting: bool | str, device: torch.device, dtype: torch.dtype) -> bool:
    """engine.batch_invariant: true | false | auto (bf16 on a CPU, where the kernels above were measured)."""
    if setting == "auto":
        return device.type == "cpu" and dtype == torch.bfloat16
    return bool(setting)  # EngineConfig has validated it


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
