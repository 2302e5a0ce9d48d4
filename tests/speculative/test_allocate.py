import random


import torch

from tailrl.speculative.allocate import FILL_MIN_SURVIVAL, AcceptanceModel, allocate, fill_tile
from tailrl.speculative.tree import DraftTree


def chain(tokens, cond, support, drafter="history"):
    t = DraftTree.chain(tokens, drafter)
    t.cond, t.support = list(cond), list(support)
    return t


def trained_model(p_sure=0.9, p_guess=0.1, n=400, seed=0):
    """Nodes the drafter is sure of (cond 1.0 over 16 continuations) are accepted with p_sure, guesses (cond 0.2
    over 2) with p_guess."""
    rng = random.Random(seed)
    m = AcceptanceModel()
    for _ in range(n):
        sure = chain([1], [1.0], [16])
        m.observe(sure, [0] if rng.random() < p_sure else [])
        guess = chain([2], [0.2], [2])
        m.observe(guess, [0] if rng.random() < p_guess else [])
    return m


def test_calibrated_odds_follow_what_was_accepted_not_the_drafters_claim():
    m = trained_model()
    sure = chain([5, 6], [1.0, 1.0], [16, 16])
    guess = chain([7], [0.2], [2])
    s = m.survival(sure)
    assert abs(s[0] - 0.9) < 0.05 and abs(s[1] - s[0] * s[0]) < 1e-9  # survival multiplies along the path
    assert abs(m.survival(guess)[0] - 0.1) < 0.05
    m.end_rollout()  # halving the counts keeps the estimates
    assert abs(m.survival(guess)[0] - 0.1) < 0.06


def test_where_rows_cost_a_third_of_a_sequence_only_likely_nodes_are_verified():
    m = trained_model()
    B = 4
    trees = [chain([1, 2, 3], [1.0, 1.0, 0.2], [16, 16, 2]), chain([4, 5], [0.2, 1.0], [2, 16]), None,
             chain([6], [1.0], [16])]
    out = allocate(trees, m, B, lambda rows: 1.0 + rows / (3 * B))  # a plain step of the 4 costs 1, a row a third of a sequence
    assert out[0].tokens == [1, 2]  # 0.9, 0.81 kept; the guess after them (0.08) dropped
    assert out[1] is None  # its first node is a guess: the whole chain goes
    assert out[2] is None and out[3].tokens == [6]
    out[0].validate(10)


def test_where_rows_are_free_every_node_is_verified():
    m = trained_model()
    trees = [chain([1, 2, 3], [1.0, 1.0, 0.2], [16, 16, 2]), chain([4, 5], [0.2, 1.0], [2, 16])]
    out = allocate(trees, m, 2, lambda rows: 1.0 + 0.001 * rows)
    assert [t.tokens for t in out] == [[1, 2, 3], [4, 5]]


def test_free_rows_of_the_last_tile_verify_the_likeliest_next_nodes_within_each_query_block():
    m = trained_model()
    # 3 sequences verify 1, 1 and 0 drafts: 2 + 2 + 1 = 5 rows of a 8-row tile, 3 free. Query blocks of 4 rows: the
    # first two may add 2 nodes each (rows 3-4 of their block), the third 3 (it has only its root row)
    wide = [chain([1, 2, 3, 4], [1.0, 1.0, 1.0, 1.0], [16] * 4), chain([5, 6, 7], [1.0, 0.2, 1.0], [16, 2, 16]),
            chain([8, 9, 10], [0.2, 1.0, 1.0], [2, 16, 16])]
    trees = [wide[0].subset([0]), wide[1].subset([0]), None]
    out, added = fill_tile(trees, wide, m, tile=8, block=4)
    # survivals of the candidates: seq 0's nodes 1, 2: 0.81, 0.73; seq 1's nodes 1, 2: 0.09, 0.08; seq 2's: 0.1, 0.09
    assert added == 3 and sum(1 + len(t) for t in out if t) + sum(t is None for t in out) == 8
    assert out[0].tokens == [1, 2, 3]  # its block ends at node 2: node 3 (a new block) is never added
    assert out[1].tokens == [5] and out[2].tokens == [8]  # 0.1 beats 0.09 for the last free row
    for t in out:
        t.validate(16)
        assert t.parents == list(range(-1, len(t) - 1))
    # a full tile: nothing added; a chain that is no prefix of its wide draft is left alone
    full, n = fill_tile([wide[0].subset([0, 1, 2]), wide[1].subset([0, 1]), None], wide, m, tile=8, block=4)
    assert n == 0 and full[2] is None and len(full[1]) == 2
    other, n = fill_tile([chain([9], [1.0], [16]), None, None], wide, m, tile=8, block=4)
    assert n == 4 and other[0].tokens == [9] and other[1].tokens == [5, 6] and other[2].tokens == [8, 9]
    # nodes under FILL_MIN_SURVIVAL stay out even with rows to spare
    poor = AcceptanceModel()
    for _ in range(200):
        poor.observe(chain([1], [1.0], [16]), [])
    assert poor.survival(wide[0])[0] < FILL_MIN_SURVIVAL
    assert fill_tile([None], [wide[0]], poor, tile=16, block=4) == ([None], 0)


def test_before_anything_is_measured_only_the_first_nodes_are_verified():
    """A fresh table gives even odds and an unmeasured step prices a row at ROW_PRIOR of a sequence: the first
    node of each chain is verified (0.5 > 0.3), its deeper nodes (0.25, 0.125, ...) are not."""
    trees = [chain([1, 2, 3, 4], [0.2] * 4, [2] * 4), chain([5, 6], [1.0, 1.0], [16, 16])]
    out = allocate(trees, AcceptanceModel(), 2, None)
    assert [t.tokens for t in out] == [[1], [5]]


def test_sampled_trees_are_never_cut():
    """A tree whose children were drawn from q keeps all of them: cutting by what was drawn would bias rejection
    sampling."""
    m = trained_model()
    t = chain([2, 3], [0.2, 0.2], [2, 2])
    t.q = {-1: torch.full((10,), 0.1), 0: torch.full((10,), 0.1)}
    out = allocate([t, chain([2], [0.2], [2])], m, 2, lambda rows: 1.0 + rows)
    assert out[0] is t and out[1] is None


def test_a_branching_tree_is_cut_to_a_valid_subtree():
    m = trained_model()
    # root -> a (sure) -> b (guess), root -> c (guess) -> d (sure)
    t = DraftTree([1, 2, 3, 4], [-1, 0, -1, 2], drafter="history", cond=[1.0, 0.2, 0.2, 1.0], support=[16, 2, 2, 16])
    out = allocate([t], m, 1, lambda rows: 1.0 + rows / 3)[0]
    out.validate(10)
    assert out.tokens == [1] and out.parents == [-1]
    # a model that trusts everything keeps the whole tree, parents before children
    full = allocate([t], trained_model(p_guess=0.95), 1, lambda rows: 1.0 + rows / 3)[0]
    assert full.tokens == [1, 2, 3, 4] and full.parents == [-1, 0, -1, 2]


def test_shadow_paths_teach_the_odds():
    m = AcceptanceModel()
    f = m.path_features(chain([1, 2, 3], [1.0, 1.0, 1.0], [16, 16, 16]))
    for _ in range(50):
        m.observe_path("history", f, 1)  # the first node matches, the second does not, the third is never reached
    s = m.survival(chain([1, 2], [1.0, 1.0], [16, 16]))
    assert abs(s[0] - 0.5) < 0.05  # 50 of 100 reached nodes accepted
