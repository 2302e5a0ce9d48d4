"""Sampling and the acceptance of deterministic drafts as fixed-shape tensor ops, so that a CUDA graph can capture
them with the decode and verify forwards (issue 29: on an H100, eager sampling took 2.2 ms of a 5.3 ms step).

Every function here is the eager sampler's (engine/sampler.py), bit for bit, without its host reads: no `.item()`,
`.tolist()`, `nonzero` or branch on a tensor's value, and every shape is fixed by its inputs' shapes
(tests/test_graph_sampler.py checks tokens, logprobs and verdicts against `warped_logprobs`, `sample_tensor` and
`decide`). What the eager sampler decides on the host stays a host decision here: whether any row uses top-k
(top-p) is whether `top_k` (`top_p`) is None, so a graph is captured per (bucket, top-k used, top-p used), the
structure `warp_tensors` already chooses. Where the eager code reads a value back, these do more work instead:
top-k's k-th value comes from a full sort (eager: `topk` to the largest k, read on the host), and the keyed
Gumbel noise is computed for the whole vocabulary (eager on CPU: only for the candidates that can win).

Layout: a pass of S sequences with Q rows each (a root and up to Q - 1 draft nodes), as engine/buckets.py's
StaticBatch lays it out: row b*Q + r of the logits is row r of sequence b, `ids[b, r]` the token at that row and
`parents[b, r]` its parent's row (the root's and padded rows' parents are themselves). Sequences past the real
ones, and rows past a sequence's `q_lens`, are padding: they are sampled (a fixed shape costs that) and ignored.
Drafts with probabilities (rejection sampling, speculative/verify.py) are not handled here: they go through `verify_tree`."""

from __future__ import annotations

import torch

from ..speculative.noise import gumbel, hash_tensor, signed64
from ..speculative.verify import Verdict
from .sampler import warp_tensors


def graph_warp(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
               rows: int = 0) -> torch.Tensor:
    """`warped_logprobs` (logits [N, V] -> float32 log-probabilities, -inf outside top-k and top-p), `rows` rows
    at a time (0: all at once; blocks keep a CPU's temporaries in cache, and each row's result is the same)."""
    N, V = logits.shape
    if not rows or N <= rows:
        return _warp(logits, temps, top_k, top_p)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for i in range(0, N, rows):  # N is the static shape: the same blocks every replay
        b = slice(i, i + rows)
        out[b] = _warp(logits[b], temps[b], *(None if t is None else t[b] for t in (top_k, top_p)))
    return out


def _warp(logits, temps, top_k, top_p):
    x = logits.float() / temps.unsqueeze(-1)
    V = x.shape[-1]
    if top_k is not None:  # the k-th largest value: the eager topk's, read from a sort of every value
        k = torch.where(top_k > 0, top_k.clamp(max=V), V)
        kth = x.sort(dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None:  # the eager ops, in the same order
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = (mass_before >= top_p.unsqueeze(-1)) & (top_p < 1).unsqueeze(-1)  # top_p=1: keep all
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def graph_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`row_keys` of int64 tensors (broadcast together): int32 keys of (seed, position), all on the device."""
    h = hash_tensor(seeds, positions, torch.zeros_like(positions))  # a tensor index: no host-made scalar tensor
    return (((h + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)).to(torch.int32)


def graph_choose(logp: torch.Tensor, greedy: torch.Tensor, keys: torch.Tensor, rows: int = 0) -> torch.Tensor:
    """`sample_tensor`'s tokens [N] (long): argmax of logp + the row's keyed Gumbel noise, or of logp alone for
    greedy rows (bool [N]); the noise of the whole vocabulary, `rows` rows at a time (0: all at once)."""
    N, V = logp.shape
    step = rows or max(N, 1)
    out = []
    for i in range(0, N, step):
        x = logp[i : i + step].float()
        noisy = x + gumbel(keys[i : i + step], V)
        out.append(torch.where(greedy[i : i + step, None], x, noisy).argmax(-1))
    return torch.cat(out) if out else logp.argmax(-1)


def graph_sample(logits: torch.Tensor, temps: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                 greedy: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                 rows: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row of logits [N, V], row r at output position positions[r] of a request seeded seeds[r]
    (per-row tensors [N]): (tokens [N], their logprobs [N], the warped logprobs [N, V])."""
    logp = graph_warp(logits, temps, top_k, top_p, rows)
    tokens = graph_choose(logp, greedy, graph_keys(seeds, positions), rows)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), logp


def graph_accept(draws: torch.Tensor, ids: torch.Tensor, parents: torch.Tensor,
                 q_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`walk` for every sequence at once. draws [S, Q]: the target's draw at each row; ids [S, Q]: the token of
    each row (a draft node's, from row 1); parents [S, Q]: each row's parent row; q_lens [S]: real rows.
    Returns (path [S, Q]: the rows of the root and then of the accepted nodes, root side first, the last one
    repeated past the path's end; accepted [S]: how many nodes were accepted).

    Q - 1 rounds, each a fixed set of ops: at the current row, the child whose token is the row's draw (siblings
    have distinct tokens, `DraftTree.validate`; the first in row order otherwise, as `walk`) becomes current. A
    sequence whose walk stopped stays where it is: no child matched, and none will."""
    S, Q = draws.shape
    r = torch.arange(Q, device=draws.device)
    nodes = (r >= 1) & (r < q_lens.unsqueeze(-1))  # [S, Q]
    cur = torch.zeros(S, dtype=torch.long, device=draws.device)
    path, accepted = [cur], torch.zeros_like(cur)
    for _ in range(Q - 1):
        x = draws.gather(1, cur.unsqueeze(-1))
        match = nodes & (parents == cur.unsqueeze(-1)) & (ids == x)
        found = match.any(-1)
        cur = torch.where(found, match.to(torch.int8).argmax(-1), cur)  # argmax: the first of equal maxima
        accepted = accepted + found.long()
        path.append(cur)
    return torch.stack(path, 1), accepted


def graph_decide(logits: torch.Tensor, ids: torch.Tensor, parents: torch.Tensor | None, q_lens: torch.Tensor,
                 temps: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, greedy: torch.Tensor,
                 seeds: torch.Tensor, positions: torch.Tensor, rows: int = 0) -> torch.Tensor:
    """`decide` for deterministic drafts over a padded pass: logits [S*Q, V]; ids, parents (None when Q == 1) and
    positions [S, Q] (each row's output position: the sequence's emitted count plus the row's depth); q_lens and
    the sampling values temps, top_k, top_p, greedy, seeds per sequence [S]. Returns one float64 tensor
    [S, 1 + 3Q], exact for token ids and float32 logprobs, so that one device-to-host copy brings the step back:
    per sequence the accepted count n, the path's rows [Q], the emitted tokens [Q] and their logprobs [Q], of
    which the first n + 1 are real (`verdicts` reads it)."""
    S, Q = positions.shape

    def per_row(t):
        return None if t is None else t.unsqueeze(-1).expand(S, Q).reshape(-1)

    tokens, lps, _ = graph_sample(logits, per_row(temps), per_row(top_k), per_row(top_p), per_row(greedy),
                                  per_row(seeds), positions.reshape(-1), rows)
    draws, lps = tokens.view(S, Q), lps.view(S, Q)
    if Q == 1:
        path, accepted = torch.zeros_like(draws), torch.zeros(S, dtype=torch.long, device=draws.device)
    else:
        path, accepted = graph_accept(draws, ids.view(S, Q), parents.view(S, Q), q_lens)
    out = (accepted.unsqueeze(-1), path, draws.gather(1, path), lps.gather(1, path))
    return torch.cat([t.double() for t in out], 1)


def verdicts(packed: torch.Tensor, count: int) -> list[Verdict]:
    """The first `count` sequences' verdicts from `graph_decide`'s output (copied to the host here, once)."""
    Q = (packed.shape[1] - 1) // 3
    out = []
    for row in packed[:count].tolist():
        n = int(row[0])
        path = row[1 : 2 + n]
        out.append(Verdict([int(p) - 1 for p in path[1:]], [int(t) for t in row[1 + Q : 2 + Q + n]],
                           row[1 + 2 * Q : 2 + 2 * Q + n]))
    return out


class SamplingBuffers:
    """The per-sequence sampling values of a pass at fixed device addresses (one per bucket's sequence count),
    filled by one host-to-device copy: one int64 buffer holding temperature and top-p as float32 bits, top-k,
    greedy, the seed (as signed 64 bits) and the emitted count. Padded sequences sample greedily at position 0."""

    def __init__(self, seqs: int, device):
        self.seqs = seqs
        self.flat = torch.zeros(6 * seqs, dtype=torch.long, device=device)
        self.top_k_used = self.top_p_used = False

    def _part(self, i: int) -> torch.Tensor:
        return self.flat[i * self.seqs : (i + 1) * self.seqs]

    @property
    def temps(self) -> torch.Tensor:
        return self._part(0).to(torch.int32).view(torch.float32)

    @property
    def top_p(self) -> torch.Tensor | None:
        return self._part(1).to(torch.int32).view(torch.float32) if self.top_p_used else None

    @property
    def top_k(self) -> torch.Tensor | None:
        return self._part(2) if self.top_k_used else None

    @property
    def greedy(self) -> torch.Tensor:
        return self._part(3) != 0

    @property
    def seeds(self) -> torch.Tensor:
        return self._part(4)

    @property
    def emitted(self) -> torch.Tensor:
        return self._part(5)

    def fill(self, seqs: list) -> None:
        """Writes the values of these sequences (len <= seqs; each with .params, .seed, .output_ids) and sets
        `top_k_used` / `top_p_used` as `warp_tensors` decides them (the graph to replay depends on them)."""
        temps, top_k, top_p = warp_tensors([s.params for s in seqs], "cpu")
        self.top_k_used, self.top_p_used = top_k is not None, top_p is not None
        pad = self.seqs - len(seqs)

        def bits(t: torch.Tensor | None, fill: float) -> list[int]:
            vals = t if t is not None else torch.full((len(seqs),), fill)
            return vals.float().view(torch.int32).tolist() + [torch.tensor(fill).view(torch.int32).item()] * pad

        host = (bits(temps, 1.0) + bits(top_p, 1.0) + [s.params.top_k for s in seqs] + [0] * pad
                + [int(s.params.greedy) for s in seqs] + [1] * pad + [signed64(s.seed) for s in seqs] + [0] * pad
                + [len(s.output_ids) for s in seqs] + [0] * pad)
        self.flat.copy_(torch.tensor(host, dtype=torch.long))
