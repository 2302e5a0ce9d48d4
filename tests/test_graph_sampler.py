"""The graph-safe sampler (engine/graph_sampler.py) against today's eager sampler, bit for bit: warped logprobs,
keys, sampled and greedy tokens and their logprobs, and the verdicts of deterministic chains and trees against
`decide`; on CUDA, a captured graph's replays against eager `decide`."""

import random
from types import SimpleNamespace

import pytest
import torch

from tailrl.engine import SamplingParams
from tailrl.engine.graph_sampler import (SamplingBuffers, graph_accept, graph_decide, graph_keys, graph_sample,
                                         graph_warp, verdicts)
from tailrl.engine.sampler import decide, sample_tensor, warp_tensors, warped_logprobs
from tailrl.speculative.noise import row_keys
from tailrl.speculative.tree import DraftTree
from tailrl.speculative.verify import walk


def random_params(rng: random.Random, n: int, top_k: bool = True, top_p: bool = True) -> list[SamplingParams]:
    """A mix of greedy rows and temperatures 0.3-1.5, with top-k and top-p on some rows when asked."""
    return [SamplingParams(temperature=rng.choice([0.0, 0.3, 0.7, 1.0, 1.5]),
                           top_k=rng.choice([0, 0, 1, 5, 40]) if top_k else 0,
                           top_p=rng.choice([1.0, 1.0, 0.5, 0.9, 0.95]) if top_p else 1.0) for _ in range(n)]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (-inf equals -inf)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


MIXES = [(True, True), (True, False), (False, True), (False, False)]


@pytest.mark.parametrize("top_k,top_p", MIXES)
def test_warp_equals_eager_warped_logprobs(top_k, top_p):
    rng = random.Random(int(top_k) * 2 + int(top_p))
    g = torch.Generator().manual_seed(rng.randrange(1000))
    logits = torch.randn(100, 1000, generator=g) * 3
    logits[:10, :50] = logits[:10, 50:100]  # ties around the k-th value and in the top-p sort
    params = random_params(rng, 100, top_k, top_p)
    temps, tk, tp = warp_tensors(params, "cpu")
    assert (tk is not None) == top_k and (tp is not None) == top_p
    want = warped_logprobs(logits, temps, tk, tp)  # 32 rows at a time
    assert same(graph_warp(logits, temps, tk, tp), want)
    assert same(graph_warp(logits, temps, tk, tp, rows=7), want)


def test_keys_equal_row_keys():
    rng = random.Random(0)
    seeds = [rng.choice([0, 1, -1, 2**63 - 1, -(2**63)]) for _ in range(20)]
    seeds += [rng.getrandbits(64) - 2**63 for _ in range(80)]
    positions = [rng.randrange(0, 5000) for _ in range(100)]
    got = graph_keys(torch.tensor(seeds), torch.tensor(positions))
    assert same(got, row_keys(seeds, positions))


@pytest.mark.parametrize("vocab,rows", [(1000, 300), (49152, 12)])
def test_sampled_and_greedy_tokens_and_logprobs_equal_eager(vocab, rows):
    """Many rows, seeds, positions and temperatures, greedy rows among them, with top-k and top-p on some rows: the
    tokens and logprobs of `sample_tensor` (whose CPU noise is pruned to the candidates) bit for bit."""
    rng = random.Random(vocab)
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g) * rng.choice([2.0, 5.0])
    params = random_params(rng, rows)
    seeds = [rng.getrandbits(64) - 2**63 for _ in range(rows)]
    positions = [rng.randrange(0, 2000) for _ in range(rows)]
    greedy = [p.greedy for p in params]
    assert 0 < sum(greedy) < rows
    temps, tk, tp = warp_tensors(params, "cpu")
    logp = warped_logprobs(logits, temps, tk, tp)
    want = sample_tensor(logp, greedy, seeds, positions)
    tokens, lps, got_logp = graph_sample(logits, temps, tk, tp, torch.tensor(greedy), torch.tensor(seeds),
                                         torch.tensor(positions), rows=32)
    assert same(got_logp, logp) and same(tokens, want)
    assert same(lps, logp.gather(-1, want[:, None]).squeeze(-1))
    assert len(set(tokens.tolist())) > rows // 4  # draws differ between rows: the test is not about one token


def random_tree(rng: random.Random, nodes: int, chain: bool, vocab: int) -> DraftTree:
    tokens, parents = [], []
    for i in range(nodes):
        p = i - 1 if chain else rng.randrange(-1, i)
        taken = {t for t, q in zip(tokens, parents) if q == p}
        tokens.append(rng.choice([t for t in range(vocab) if t not in taken][:40]))
        parents.append(p)
    return DraftTree(tokens, parents)


def test_accept_walks_like_walk():
    """Random chains and trees with random draws, most of them following a path: the accepted nodes, the path's
    rows and the accepted counts of `walk` for every sequence."""
    rng = random.Random(1)
    S, Q = 64, 12
    trees = [random_tree(rng, rng.randrange(0, Q), rng.random() < 0.4, 6) if b % 7 else None for b in range(S)]
    ids, parents, q_lens = torch.zeros(S, Q, dtype=torch.long), torch.arange(Q).repeat(S, 1), []
    draws = torch.randint(0, 6, (S, Q), generator=torch.Generator().manual_seed(2))
    for b, t in enumerate(trees):
        n = 1 + (len(t) if t else 0)
        q_lens.append(n)
        if t:
            ids[b, 1:n] = torch.tensor(t.tokens)
            parents[b, 1:n] = torch.tensor(t.parents) + 1
            for i, p in enumerate(t.parents):  # the draw at a parent's row picks this child, mostly
                if rng.random() < 0.6:
                    draws[b, p + 1] = t.tokens[i]
    path, accepted = graph_accept(draws, ids, parents, torch.tensor(q_lens))
    counts = []
    for b, t in enumerate(trees):
        want = walk(t, draws[b, : q_lens[b]].tolist()) if t else []
        n = int(accepted[b])
        counts.append(n)
        assert [int(r) - 1 for r in path[b, 1 : n + 1]] == want, b
        assert (path[b, n:] == path[b, n]).all()  # the last row repeats past the path's end
    assert max(counts) >= 3 and counts.count(0) > 3  # long paths and stops at the root both happen


def pass_case(seed: int, S: int, real: int, Q: int, vocab: int, chains: bool):
    """A padded verify pass: `real` sequences of S with deterministic drafts (some without a tree), logits that
    mostly agree with the drafts, per-sequence sampling values and emitted counts. Returns the eager inputs
    (packed logits, seqs, trees, q_lens, depths) and the grid's (logits, ids, parents, positions)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    grid = torch.randn(S * Q, vocab, generator=g) * 2
    params = random_params(rng, real)
    seqs = [SimpleNamespace(params=p, seed=rng.getrandbits(63), output_ids=[0] * rng.randrange(1, 300)) for p in params]
    trees = [random_tree(rng, rng.randrange(1, Q), chains, 30) if Q > 1 and rng.random() < 0.85 else None
             for _ in range(real)]
    ids, parents = torch.zeros(S, Q, dtype=torch.long), torch.arange(Q).repeat(S, 1)
    depth = torch.zeros(S, Q, dtype=torch.long)
    rows, q_lens = [], []
    for b, t in enumerate(trees):
        n = 1 + (len(t) if t else 0)
        q_lens.append(n)
        rows += range(b * Q, b * Q + n)
        if t:
            ids[b, 1:n] = torch.tensor(t.tokens)
            parents[b, 1:n] = torch.tensor(t.parents) + 1
            depth[b, 1:n] = torch.tensor(t.depths())
            for i, p in enumerate(t.parents):  # a peak at the drafted token: most drafts are accepted
                if rng.random() < 0.7:
                    grid[b * Q + p + 1, t.tokens[i]] += 12
    depths = torch.cat([depth[b, :q] for b, q in enumerate(q_lens)])
    base = torch.tensor([len(s.output_ids) for s in seqs] + [0] * (S - real))
    return (grid[rows], seqs, trees, q_lens, depths), (grid, ids, parents, base[:, None] + depth)


@pytest.mark.parametrize("chains", [True, False], ids=["chains", "trees"])
def test_decide_equals_eager_decide(chains):
    """Verdicts (accepted nodes, emitted tokens, their logprobs) of padded passes against `decide`, over several
    passes of mixed greedy/sampled sequences, with top-k and top-p on some of them."""
    total_accepted, partial = 0, 0
    for seed in range(4):
        (logits, seqs, trees, q_lens, depths), (grid, ids, parents, positions) = pass_case(seed, 16, 13, 8, 300, chains)
        want = decide(logits, seqs, trees, q_lens, depths)
        buf = SamplingBuffers(16, "cpu")
        buf.fill(seqs)
        assert same(buf.emitted[:13], positions[:13, 0])
        assert same(buf.greedy[:13], torch.tensor([s.params.greedy for s in seqs]))
        packed = graph_decide(grid, ids, parents, torch.tensor(q_lens + [1] * 3), buf.temps, buf.top_k, buf.top_p,
                              buf.greedy, buf.seeds, positions, rows=32)
        got = verdicts(packed, len(seqs))
        assert got == want
        total_accepted += sum(len(v.accepted_nodes) for v in want)
        partial += sum(0 < len(v.accepted_nodes) < q - 1 for v, q in zip(want, q_lens))
    assert total_accepted > 40 and partial > 3  # acceptance happened, and stopped inside trees too


def test_plain_decode_equals_eager_decide():
    (logits, seqs, _, q_lens, _), (grid, _, _, positions) = pass_case(5, 32, 29, 1, 500, True)
    want = decide(logits, seqs, None, q_lens, None)
    buf = SamplingBuffers(32, "cpu")
    buf.fill(seqs)
    packed = graph_decide(grid, grid.new_zeros(32, 1, dtype=torch.long), None, torch.ones(32, dtype=torch.long),
                          buf.temps, buf.top_k, buf.top_p, buf.greedy, buf.seeds, positions)
    assert verdicts(packed, len(seqs)) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graph capture of the sampler against eager")
@pytest.mark.parametrize("chains", [True, False], ids=["chains", "trees"])
def test_captured_graph_equals_eager_decide_on_cuda(chains):
    """One graph captured over static buffers, replayed on passes it was not captured on: the verdicts of eager
    `decide` on the same device, bit for bit. Every pass uses top-k and top-p (the graph's structure)."""
    dev = torch.device("cuda")
    S, Q, V = 16, 8, 4096
    cases = [pass_case(seed, S, 13, Q, V, chains) for seed in range(10, 14)]
    cases = [c for c in cases if all(x is not None for x in warp_tensors([s.params for s in c[0][1]], "cpu")[1:])]
    assert len(cases) >= 2
    grid, ids, parents, positions = (t.to(dev) for t in cases[0][1])
    q_lens = torch.ones(S, dtype=torch.long, device=dev)
    buf = SamplingBuffers(S, dev)

    def load(case):
        (_, seqs, _, ql, _), (g_, i_, p_, pos_) = case
        for dst, src in ((grid, g_), (ids, i_), (parents, p_), (positions, pos_)):
            dst.copy_(src)
        q_lens.copy_(torch.tensor(ql + [1] * (S - len(ql))))
        buf.fill(seqs)

    def step():
        return graph_decide(grid, ids, parents, q_lens, buf.temps, buf.top_k, buf.top_p, buf.greedy, buf.seeds,
                            positions)

    load(cases[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for case in cases[1:] + cases[:1]:
        load(case)
        graph.replay()
        (logits, seqs, trees, ql, depths) = case[0]
        want = decide(logits.to(dev), seqs, trees, ql, depths.to(dev))
        assert verdicts(out, len(seqs)) == want
