"""Losslessness of tree verification, checked statistically on a synthetic target over a small vocabulary.

The target is a fixed table of next-token logits for every prefix; drafts are random chains and trees,
deterministic or sampled from a different draft distribution q without replacement. Speculative generation
of D tokens is repeated 100k times and the distribution of the D-token outputs is compared with the exact
target joint by a chi-square test (fixed seeds; each must pass at significance 0.001). The draws are split into
PARTS fixed parts run in worker processes (the verifier is Python-bound: one core per part), so the counts, and
the p-value, are the same on any number of cores."""

import itertools
import math
import multiprocessing
import os
import random
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from tailrl.engine import SamplingParams
from tailrl.engine.sampler import warp_tensors, warped_logprobs
from tailrl.speculative.tree import DraftTree
from tailrl.speculative.verify import verify_tree
from tests.stats import chisquare_pvalue

V, D, DRAWS, PARTS = 5, 3, 100_000, 4


class Synthetic:
    def __init__(self, params: SamplingParams, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.params = params
        self.target, self.draft = {}, {}
        for n in range(D + 3):  # prefixes of up to D + 2 tokens: D - 1 emitted ones, then a tree of depth 3
            for prefix in itertools.product(range(V), repeat=n):
                logits = torch.randn(V, generator=g) * 1.5
                self.target[prefix] = warped_logprobs(logits[None], *warp_tensors([params], "cpu"))[0]
                self.draft[prefix] = torch.softmax(torch.randn(V, generator=g), -1)
        self.draft_log = {k: [math.log(x) for x in v.tolist()] for k, v in self.draft.items()}

    def joint(self) -> dict:
        out = {}
        for seq in itertools.product(range(V), repeat=D):
            lp = sum(float(self.target[seq[:i]][seq[i]]) for i in range(D))
            out[seq] = torch.tensor(lp).exp().item()
        return out


def random_tree(rng: random.Random, syn: Synthetic, prefix: tuple, shape: str, with_q: bool) -> DraftTree:
    """chain: 3 nodes in a line; tree: up to 2 children per node, depth 2 or 3."""
    tokens, parents, q = [], [], {}

    def kids(node_prefix, node, k):
        if with_q:  # k distinct children drawn from q without replacement (Gumbel top-k)
            logq = syn.draft_log[node_prefix]
            keys = [lq - math.log(-math.log(1.0 - rng.random())) for lq in logq]
            chosen = sorted(range(V), key=lambda t: -keys[t])[:k]
            q[node] = syn.draft[node_prefix]
        else:  # k distinct children, uniformly (random() alone: a sample() call cost more than a verification)
            chosen = sorted(range(V), key=lambda t: rng.random())[:k]
        for t in chosen:
            tokens.append(t)
            parents.append(node)
        return list(range(len(tokens) - k, len(tokens)))

    frontier = [(-1, prefix)]
    depth = 3 if shape == "chain" else 2 + (rng.random() < 0.5)
    for _ in range(depth):
        nxt = []
        for node, pre in frontier:
            k = 1 if shape == "chain" else 1 + (rng.random() < 0.5)
            for i in kids(pre, node, k):
                nxt.append((i, pre + (tokens[i],)))
        frontier = nxt[:3]
    return DraftTree(tokens, parents, q)


_SYNTHETIC: dict = {}


def synthetic(params: SamplingParams, seed: int) -> Synthetic:
    """One Synthetic per case and process (a worker runs several parts of a case)."""
    key = (repr(params), seed)
    if key not in _SYNTHETIC:
        _SYNTHETIC.clear()
        _SYNTHETIC[key] = Synthetic(params, seed)
    return _SYNTHETIC[key]


def spec_generate(syn: Synthetic, shape: str, with_q: bool, draws: int, seed: int, part: int = 0,
                  parts: int = 1) -> torch.Tensor:
    """Counts of the D-token outputs of draws k = part, part + parts, ... below `draws`, draw k verified with the
    noise of request seed * 10**6 + k; the trees from a random stream of the part's own."""
    rng = random.Random((seed + 1) * 1000 + part)
    counts = {}
    for k in range(part, draws, parts):
        out: tuple = ()
        while len(out) < D:
            tree = random_tree(rng, syn, out, shape, with_q)
            rows = [syn.target[out]]
            paths = []
            for i, p in enumerate(tree.parents):
                paths.append((paths[p] if p >= 0 else out) + (tree.tokens[i],))
                rows.append(syn.target[paths[-1]])
            verdict = verify_tree(tree, torch.stack(rows), syn.params.greedy, seed * 10**6 + k, len(out))
            out = out + tuple(verdict.tokens)
        counts[out[:D]] = counts.get(out[:D], 0) + 1
    cells = itertools.product(range(V), repeat=D)  # row-major, as the reshape reads them
    return torch.tensor([counts.get(seq, 0) for seq in cells], dtype=torch.float64).reshape([V] * D)


def assert_follows(counts: torch.Tensor, joint: dict):
    observed = {seq: float(counts[seq]) for seq in joint}
    pvalue = chisquare_pvalue(observed, joint)
    assert pvalue > 1e-3, f"chi-square p={pvalue:.2e}: emitted tokens do not follow the target"


CASES = [
    ("chain", False, SamplingParams(temperature=1.0)),
    ("tree", False, SamplingParams(temperature=0.7, top_k=3)),
    ("chain", True, SamplingParams(temperature=1.0)),
    ("tree", True, SamplingParams(temperature=1.0)),
    ("tree", True, SamplingParams(temperature=0.8, top_p=0.8)),
]


def spec_part(params: SamplingParams, shape: str, with_q: bool, part: int) -> torch.Tensor:
    """One part of a case's draws, in a worker process."""
    return spec_generate(synthetic(params, 3), shape, with_q, DRAWS, seed=7, part=part, parts=PARTS)


@pytest.fixture(scope="module")
def workers():
    """Worker processes for the parts, one torch thread each (spawned: no fork of a process holding OpenMP threads)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ProcessPoolExecutor(min(PARTS, cores), mp_context=multiprocessing.get_context("spawn"),
                             initializer=torch.set_num_threads, initargs=(1,)) as pool:
        yield pool


@pytest.mark.slow  # a chi-square over thousands of draws per case
@pytest.mark.parametrize("shape,with_q,params", CASES, ids=[f"{s}-{'q' if q else 'det'}-{p.temperature}-k{p.top_k}-p{p.top_p}" for s, q, p in CASES])
def test_speculative_output_follows_the_target(workers, shape, with_q, params):
    counts = sum(workers.map(spec_part, *zip(*[(params, shape, with_q, part) for part in range(PARTS)])))
    assert counts.sum() == DRAWS
    assert_follows(counts, synthetic(params, 3).joint())


def test_greedy_always_emits_argmax():
    syn = Synthetic(SamplingParams(temperature=0), seed=5)
    rng = random.Random(0)
    for with_q in (False, True):
        for _ in range(300):
            tree = random_tree(rng, syn, (), "tree", with_q)
            rows = [syn.target[()]]
            paths = []
            for i, p in enumerate(tree.parents):
                paths.append((paths[p] if p >= 0 else ()) + (tree.tokens[i],))
                rows.append(syn.target[paths[-1]])
            v = verify_tree(tree, torch.stack(rows), True, 0, 0)
            prefix = ()
            for tok in v.tokens:
                assert tok == int(syn.target[prefix].argmax())
                prefix += (tok,)


def test_accepted_logprobs_are_the_targets():
    syn = Synthetic(SamplingParams(temperature=1.0), seed=2)
    tree = DraftTree.chain([int(syn.target[()].argmax()), 0, 1])
    rows = [syn.target[()]]
    prefix = ()
    for t in tree.tokens:
        prefix += (t,)
        rows.append(syn.target[prefix])
    v = verify_tree(tree, torch.stack(rows), False, 0, 0)
    prefix = ()
    for tok, lp in zip(v.tokens, v.logprobs):
        assert lp == pytest.approx(float(syn.target[prefix][tok]))
        prefix += (tok,)


def test_invalid_trees_are_rejected():
    with pytest.raises(ValueError, match="parent"):
        DraftTree([1, 2], [-1, 1]).validate(10)
    with pytest.raises(ValueError, match="vocabulary"):
        DraftTree([1, 20], [-1, 0]).validate(10)
    with pytest.raises(ValueError, match="twice"):
        DraftTree([1, 1], [-1, -1]).validate(10)
    with pytest.raises(ValueError, match="zero probability"):
        DraftTree([1, 2], [-1, -1], q={-1: torch.tensor([0.5, 0.5, 0.0] + [0.0] * 7)}).validate(10)
