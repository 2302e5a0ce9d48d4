"""The audit's scorer (engine/score.py): a prompt's responses scored in one forward with the prompt computed once
give each token the log p of its own sequence, as one forward per response does (the path it replaced)."""

import random

import pytest

from tailrl.engine import score as score_mod
from tailrl.engine.score import model_scorer, per_response, pieces

# fp32: the same products summed in another order (packed rows, the prompt's keys gathered), as the trainer's
# packed layout against its padded one (tests/rl/update_helpers.VALUE_TOL); measured here: 1e-6 on Zen 3
TOL = 2e-5


def responses(seed, vocab, n=9):
    rng = random.Random(seed)
    lengths = [0, 1, 2] + [rng.randint(1, 40) for _ in range(n - 3)]
    rng.shuffle(lengths)
    return [[rng.randrange(3, vocab) for _ in range(k)] for k in lengths]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("budget", [None, 96 * 30])  # one piece; pieces of at most 30 tokens (the prompt each time)
def test_shared_prompt_scores_as_one_forward_per_response(kind, budget, tmp_path_factory, monkeypatch):
    from tests.helpers import tiny_model

    model = tiny_model(tmp_path_factory, kind)
    if budget:
        monkeypatch.setattr(score_mod, "LOGIT_BUDGET", budget)
    scorer = model_scorer(model)
    for seed, prompt in enumerate([[1, 5, 9, 4], [1] + list(range(3, 40))]):
        rs = responses(seed, 96)
        for t in (0.7, 1.0):
            got = scorer.score(prompt, rs, t)
            want = per_response(model, prompt, rs, t)
            assert [len(g) for g in got] == [len(r) for r in rs]
            err = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
            assert err <= TOL, (kind, seed, t, err)


def test_warping_matches_too(tmp_path_factory):
    """top-k and top-p as the arm's: the same support (a token outside it scores -inf on both paths)."""
    from tests.helpers import tiny_model

    model = tiny_model(tmp_path_factory, "llama", seed=1)
    prompt, rs = [1, 7, 8, 9, 4], responses(3, 96)
    for top_k, top_p in ((5, 1.0), (0, 0.9)):
        got = model_scorer(model, top_k, top_p).score(prompt, rs, 0.8)
        want = per_response(model, prompt, rs, 0.8, top_k, top_p)
        flat = [(a, b) for g, w in zip(got, want) for a, b in zip(g, w)]
        assert any(b == float("-inf") for _, b in flat)  # the warping excluded some drawn tokens
        assert all((a == b == float("-inf")) or abs(a - b) <= TOL for a, b in flat)


def test_pieces_keep_order_and_the_row_budget():
    assert pieces([3, 4, 0, 5, 9, 1], 8) == [[0, 1, 2], [3], [4], [5]]
    assert pieces([], 8) == [[]]
