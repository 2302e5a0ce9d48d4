"""Losslessness of tree verification, checked statistically on a synthetic target over a small vocabulary.

The target is a fixed table of next-token logits for every prefix; drafts are random chains and trees,
deterministic or sampled from a different draft distribution q without replacement. Speculative generation
of D tokens is repeated 100k times and the distribution of the D-token outputs is compared with the exact
target joint by a chi-square test (fixed seeds; each must pass at significance 0.001)."""

import itertools
import math
import random

import pytest
import torch

from tailrl.engine import SamplingParams
from tailrl.engine.sampler import warp_tensors, warped_logprobs
from tailrl.speculative.tree import DraftTree
from tailrl.speculative.verify import verify_tree
from tests.stats import chisquare_pvalue

V, D, DRAWS = 5, 3, 100_000


class Synthetic:
    def __init__(self, params: SamplingParams, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.params = params
        self.target, self.draft = {}, {}
        for n in range(D + 4):
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
        else:
            chosen = rng.sample(range(V), k)
        for t in chosen:
            tokens.append(t)
            parents.append(node)
        return list(range(len(tokens) - k, len(tokens)))

    frontier = [(-1, prefix)]
    depth = 3 if shape == "chain" else rng.randint(2, 3)
    for _ in range(depth):
        nxt = []
        for node, pre in frontier:
            k = 1 if shape == "chain" else rng.randint(1, 2)
            for i in kids(pre, node, k):
                nxt.append((i, pre + (tokens[i],)))
        frontier = nxt[:3]
    return DraftTree(tokens, parents, q)


def spec_generate(syn: Synthetic, shape: str, with_q: bool, draws: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed + 1)
    counts = torch.zeros([V] * D, dtype=torch.float64)
    for k in range(draws):
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
        counts[out[:D]] += 1
    return counts


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


@pytest.mark.slow  # a chi-square over thousands of draws per case
@pytest.mark.parametrize("shape,with_q,params", CASES, ids=[f"{s}-{'q' if q else 'det'}-{p.temperature}-k{p.top_k}-p{p.top_p}" for s, q, p in CASES])
def test_speculative_output_follows_the_target(shape, with_q, params):
    syn = Synthetic(params, seed=3)
    counts = spec_generate(syn, shape, with_q, DRAWS, seed=7)
    assert_follows(counts, syn.joint())


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
