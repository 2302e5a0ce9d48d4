import copy

import pytest
import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import load_model
from tailrl.speculative.config import SpecConfig
from tailrl.speculative.drafters import FallbackDrafter, HistoryDrafter, NgramDrafter, model_free_drafters
from tailrl.speculative.suffix import TokenIndex, TreeShape, build_tree
from tailrl.speculative.tree import DraftTree
from tests.helpers import CHATS, assert_same_or_tie, exact_joint
from tests.stats import chisquare_pvalue

@pytest.mark.slow  # SmolLM2 rollouts with and without speculation
@pytest.mark.parametrize("mode", ["history", "ngram", "auto"])
def test_greedy_with_speculation_equals_without(smollm, mode):
    model, tok = smollm
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = Engine(model, tok, EngineConfig(kv_cache_gb=1.0)).generate(CHATS, params)
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, spec=SpecConfig(mode=mode, epsilon=0.2)))
    accepted = 0
    for _ in range(2):  # the second epoch drafts from the first one's history
        outs = eng.generate(CHATS, params)
        accepted += sum(o.stats["accepted"] for o in outs)
        for ref, out in zip(plain, outs):
            assert_same_or_tie(model, ref, out, params, 1e-5)
    assert accepted > 0, "speculation never accepted a draft token: the test exercised nothing"


@pytest.mark.slow  # SmolLM2 rollouts with and without speculation
@pytest.mark.parametrize("mode", ["history", "ngram"])
def test_sampling_with_model_free_drafts_emits_the_very_same_tokens(smollm, mode):
    """The noise for a token depends only on (seed, position), so deterministic drafts change nothing at all, even
    drafts drawn with that very noise (ngram's coupled chains, speculative/backoff.py); a difference is allowed only where
    two perturbed logits tie within float noise, and that is checked."""
    model, tok = smollm
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=40, n=2, seed=11)
    plain = Engine(model, tok, EngineConfig(kv_cache_gb=1.0)).generate(CHATS, params)
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, spec=SpecConfig(mode=mode, min_match=1)))
    eng.generate(CHATS, params)  # the first epoch feeds the history of the second
    outs = eng.generate(CHATS, params)
    assert sum(o.stats["accepted"] for o in outs) > 0
    for ref, out in zip(plain, outs):
        assert_same_or_tie(model, ref, out, params, 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)],
                         ids=["fp32", "bf16"])  # bf16 in the full tier (the fast tier stays under 3 minutes)
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=3)],
                         ids=["t1.0", "t0.8-k3"])
def test_sampling_with_speculation_follows_the_policy(tiny_peaked, params, dtype):
    """6000 rollouts per epoch with history drafts (siblings, then the previous epoch) against the exact
    distribution of 4-token continuations; chi-square at significance 0.001 with fixed seeds, disjoint between the
    epochs (with noise keyed by (seed, position), a shared seed would redraw the same sequence). In bf16 a verify
    pass rounds differently from a one-token step (matrix-product blocking depends on the row count), so SD
    on and off do not draw the very same tokens there: losslessness is this test, by distribution."""
    tiny_peaked = copy.deepcopy(tiny_peaked).to(dtype)
    D, N = 4, 6000
    prompt = [1, 2, 3, 1]
    params = SamplingParams(temperature=params.temperature, top_k=params.top_k, max_tokens=D, n=N, seed=0, ignore_eos=True)
    joint = exact_joint(tiny_peaked, prompt, params, D)
    assert 0.05 < max(joint.values()) < 0.6  # peaked enough that history drafts get accepted, yet spread
    eng = Engine(tiny_peaked, None, EngineConfig(kv_cache_gb=0.5, spec=SpecConfig(mode="history", budgets=(2, 3), min_match=1)))
    for epoch in range(2):
        params.seed = N * epoch  # sample j draws from seed + j: epoch 1's seeds (N..2N-1) are disjoint from epoch 0's
        outs = eng.generate([prompt], params)
        assert sum(o.stats["accepted"] for o in outs) > N // 10, "too few accepted drafts to test anything"
        counts: dict = {}
        for o in outs:
            counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
        assert chisquare_pvalue(counts, joint) > 1e-3, f"epoch {epoch}: rollouts do not follow the policy"


@pytest.mark.slow  # SmolLM2 rollouts
def test_history_drafting_accepts_more_than_one_token_per_step(smollm):
    model, tok = smollm
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, spec=SpecConfig(mode="history")))
    params = SamplingParams(temperature=0.7, max_tokens=48, n=2, seed=0)
    eng.generate(CHATS[:3], params)
    params.seed = 1
    outs = eng.generate(CHATS[:3], params)
    assert outs.stats is eng.last_stats and outs.stats.accept_length("history") > 1.3
    assert sum(o.stats["accept_length"] > 1 for o in outs) >= 4
    assert sum(o.stats.get("accepted/history", 0) for o in outs) == outs.stats.drafters["history"]["accepted"]
    summary = outs.stats.summary()
    assert summary["accepted/history"] > 0 and summary["choices"]


@pytest.mark.parametrize("kw,match", [(dict(budgets=(0,)), "budget"), (dict(mode="eagle9"), "unknown spec mode"),
                                      (dict(min_depth=8, init_depth=4), "min_depth"), (dict(history_epochs=0), "history_epochs")])
def test_spec_config_errors_name_the_problem(kw, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig(**kw)


def test_a_failing_or_wrong_drafter_never_changes_a_token(smollm, monkeypatch):
    model, tok = smollm
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = Engine(model, tok, EngineConfig(kv_cache_gb=1.0)).generate(CHATS, params)

    def bad_propose(self, seq, budget, depth):  # the batch call fails, then each sequence is retried alone
        if seq.prompt_index == 0:
            raise RuntimeError("drafter bug")
        if seq.prompt_index == 1:
            return DraftTree([10**7], [-1])  # outside the vocabulary: rejected by validation
        return DraftTree.chain([(t * 7 + 3) % 1000 for t in range(min(budget, depth))])  # wrong tokens

    monkeypatch.setattr(NgramDrafter, "propose_one", bad_propose)
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, spec=SpecConfig(mode="ngram")))
    outs = eng.generate(CHATS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.finish_reason != "error" for o in outs)


def test_token_index_finds_longest_match_and_builds_count_tree():
    idx = TokenIndex(max_n=3)
    idx.add_stream([5, 1, 2, 3, 4, 9])
    idx.add_stream([7, 1, 2, 3, 4, 8])
    idx.add_stream([6, 6, 2, 3, 5, 5])
    m, occ = idx.match([0, 1, 2, 3])
    assert m == 3 and sorted(occ) == [(0, 4), (1, 4)]
    tree = build_tree(idx.streams, occ, TreeShape(budget=8, max_depth=3, min_prob=0.1), "t")
    assert tree.top_path()[0] == 4 and len(tree.children(0)) == 2  # after 4: 9 or 8, half each
    m, occ = idx.match([9, 9, 3])  # "3" occurs in all three streams, never after a 9
    assert m == 1 and len(occ) == 3


def test_history_keeps_last_epochs_and_round_trips(tiny_ckpt_v96):
    model = tiny_ckpt_v96
    cfg = SpecConfig(mode="history", history_epochs=2)
    eng = Engine(model, None, EngineConfig(kv_cache_gb=0.2, spec=cfg))
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    for epoch in range(3):
        eng.generate(prompts, SamplingParams(n=2, max_tokens=6, seed=epoch, ignore_eos=True))
    hist: HistoryDrafter = eng.speculator.drafters["history"]
    state = hist.state_dict()
    assert len(state["prompts"]) == 2 and all(len(p["epochs"]) == 2 for p in state["prompts"])
    again = HistoryDrafter(cfg)
    again.load_state_dict(state)
    for key, ph in hist.prompts.items():
        other = again.prompts[key]
        assert sorted(map(tuple, ph.index.streams)) == sorted(map(tuple, other.index.streams))


@pytest.fixture(scope="module")
def tiny_ckpt_v96(tmp_path_factory):
    from tailrl.model.tiny import make_tiny_checkpoint

    folder = tmp_path_factory.mktemp("tiny_v96")
    make_tiny_checkpoint(folder, "llama", seed=1)
    return load_model(str(folder), device="cpu")[0]


class _Fixed:
    """A drafter that drafts a fixed chain for the sequences it knows, and records the budgets it was given."""

    costly = needs_hidden = policy_bound = chains = False

    def __init__(self, name, chains_by_seq):
        self.name, self.by_seq, self.asked = name, chains_by_seq, []

    def propose(self, seqs, budgets, depths):
        self.asked.append(list(budgets))
        return [DraftTree.chain(self.by_seq[s][:b], self.name) if b and s in self.by_seq else None
                for s, b in zip(seqs, budgets)]


def test_fallback_drafts_from_the_first_part_that_drafts_enough_for_each_sequence():
    first = _Fixed("history", {"a": [1, 2, 3], "b": [4]})  # "b": one node, under min_len
    second = _Fixed("ngram", {"b": [5, 6], "c": [7, 8]})
    both = FallbackDrafter([first, second], min_len=2)
    trees = both.propose(["a", "b", "c", "d"], [4, 4, 4, 4], [4] * 4)
    assert [t.tokens if t else None for t in trees] == [[1, 2, 3], [5, 6], [7, 8], None]
    assert second.asked == [[0, 4, 4, 4]]  # "a" was drafted enough by history: ngram never drafted for it
    assert [t.drafter for t in trees[:3]] == ["history", "ngram", "ngram"]
    one = FallbackDrafter([_Fixed("history", {"b": [4]}), _Fixed("ngram", {})]).propose(["b"], [4], [4])
    assert one[0].tokens == [4]  # a short draft is kept where nothing longer comes
    assert both.propose(["b"], [1], [4])[0].tokens == [4]  # a budget of 1 is drafted in full by one node
    both.chains = True
    assert first.chains and second.chains and both.chains and both.name == "history+ngram"


def test_auto_drafts_history_then_own_ngrams():
    names = [d.name for d in model_free_drafters(SpecConfig(mode="auto"))]
    assert names == ["history", "ngram", "history+ngram"]
    assert [d.name for d in model_free_drafters(SpecConfig(mode="history"))] == ["history"]


def test_history_drafts_a_later_turn_from_the_same_turn_of_an_earlier_epoch():
    """A multi-turn agent's turn k arrives with the whole trajectory so far as its prompt, which differs from epoch to
    epoch; keyed by (prompt, turn) (SamplingParams.history) it still drafts from epoch 1's turn k of that prompt, and
    the state round-trips with its turn."""
    from types import SimpleNamespace

    cfg = SpecConfig(mode="history", min_match=1)
    hist = HistoryDrafter(cfg)
    prompt, gen = [3, 4, 5, 6, 90, 91], [90, 91]  # the chat template's generation prompt ends every request
    turn1 = [40, 41, 42, 43, 44, 45, 46]

    def seq(sid, prompt_ids, out, key):
        return SimpleNamespace(seq_id=sid, prompt_ids=prompt_ids, output_ids=list(out),
                               params=SamplingParams(history=key))

    first = seq(0, prompt + [10, 11, 12] + [70, 71] + gen, [], (prompt, 1))  # epoch 1: turn 1 after one call
    hist.start(first)
    hist.accept(first, turn1)
    hist.release(0)
    hist.end_rollout()
    assert (tuple(prompt), 1) in hist.prompts
    other_turns = prompt + [20, 21, 22] + [72, 73] + gen  # epoch 2: other earlier turns, the same prompt
    keyed, plain = seq(1, other_turns, turn1[:2], (prompt, 1)), seq(2, other_turns, turn1[:2], None)
    hist.start(keyed)
    hist.start(plain)
    tree = hist.propose_one(keyed, 8, 4)
    assert tree is not None and tree.top_path()[:4] == turn1[2:6]
    assert hist.propose_one(plain, 8, 4) is None  # keyed by its own prompt ids: nothing from epoch 1
    again = HistoryDrafter(cfg)
    again.load_state_dict(hist.state_dict())
    assert (tuple(prompt), 1) in again.prompts and again.prompts[(tuple(prompt), 1)].epochs[0] == [turn1]
