"""The speculator's feedback: the acceptance watchdog and per-request draft budgets (DAS)."""

import logging

import pytest

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.speculative.budgets import LengthTracker, das_budgets
from tailrl.speculative.config import SpecConfig
from tailrl.speculative.drafters import ModelFreeDrafter
from tailrl.speculative.speculator import Speculator
from tailrl.speculative.tree import DraftTree
from tests.helpers import tiny_model

PROMPTS = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14]]


class OracleDrafter(ModelFreeDrafter):
    """Drafts the tokens a reference greedy run emitted; made stale on purpose, it drafts wrong ones."""

    name = "oracle"
    policy_bound = True  # it drafts what a reference (earlier) policy wrote

    def __init__(self, reference: dict):
        self.reference, self.stale = reference, False

    def start(self, seq) -> None:
        pass

    def accept(self, seq, tokens) -> None:
        pass

    def propose_one(self, seq, budget, depth):
        ref = self.reference[tuple(seq.prompt_ids)]
        nxt = ref[len(seq.output_ids) : len(seq.output_ids) + min(budget, depth)]
        if self.stale:
            nxt = [(t + 1) % 90 + 3 for t in nxt]
        return DraftTree.chain(nxt, self.name) if nxt else None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "llama", seed=5)


@pytest.mark.parametrize("policy_bound", [True, False], ids=["policy-bound", "text-bound"])
def test_the_watchdog_flags_a_drafter_made_stale_and_stays_quiet_otherwise(tiny, caplog, policy_bound):
    params = SamplingParams(n=2, max_tokens=40, temperature=0, ignore_eos=True)
    plain = Engine(tiny, None, EngineConfig(kv_cache_gb=0.05)).generate(PROMPTS, params)
    oracle = OracleDrafter({tuple(c.prompt_token_ids): c.token_ids for c in plain})
    oracle.policy_bound = policy_bound
    spec = SpecConfig(mode="history", budgets=(4,))
    eng = Engine(tiny, None, EngineConfig(kv_cache_gb=0.05, spec=spec), Speculator(spec, [oracle]))
    flags = []
    for rollout in range(4):
        oracle.stale = rollout == 3  # a weight sync the drafter did not follow
        with caplog.at_level(logging.INFO):
            outs = eng.generate(PROMPTS, params)
        flags.append(outs.stats.stale["oracle"])
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]  # lossless whatever it drafts
    assert flags == [0.0, 0.0, 0.0, 1.0]
    # only a drafter that follows the policy (history, learned) logs a weight sync (INFO, counted in spec/stale); one drafting from the text
    # itself (ngram) is re-measured quietly; both are counted
    warned = "drafter oracle went stale" in caplog.text and "spec/stale/oracle" in caplog.text
    assert warned == policy_bound
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # expected after a sync: no WARNING
    assert outs.stats.metrics()["spec/stale/oracle"] == 1.0


def test_das_gives_the_long_tail_deeper_trees_and_stops_at_the_predicted_end():
    assert das_budgets(4, [None, 2, 0, 10, 100], cap=16) == [4, 2, 1, 4, 8]
    assert das_budgets(8, [1000], cap=8) == [8]  # never above the largest budget the selector knows
    lengths = LengthTracker(keep=3)
    for n in (10, 20, 30, 40):
        lengths.add([1, 2], n)
    assert lengths.remaining([1, 2], 5) == 25 and lengths.remaining([9], 0) is None  # mean of the last 3
    # conditioned on what the sample has emitted: past 35 only the 40 is left; past all of them it is the long tail
    # (half of what it did), never "about to end" (the mean minus done would give it a budget of 1)
    assert lengths.remaining([1, 2], 35) == 5 and lengths.remaining([1, 2], 60) == 30
    assert das_budgets(4, [lengths.remaining([1, 2], 60)], cap=16) == [8]


def test_das_shares_the_batch_budget_when_most_requests_are_long():
    """A full batch of long requests is not a tail: doubling them all would be a budget the selector did not choose.
    They get the arm's budget plus the rows the requests about to end leave unused, the longest first."""
    assert das_budgets(4, [100] * 8, cap=16) == [4] * 8
    assert das_budgets(4, [100, 200, 1, 2, 50, 60, 70, 80], cap=16) == [5, 8, 1, 2, 4, 4, 4, 4]
    assert das_budgets(4, [100] * 8, cap=16, share=False) == [8] * 8  # the first version
    assert das_budgets(4, [100, 5, 5, 5, 5, 5, 5, 5], cap=16) == [8] + [4] * 7  # a quarter or fewer: the tail


def test_budgets_follow_predicted_remaining_length_in_the_engine(tiny):
    """After a rollout, the speculator knows each prompt's response length and drafts no further than it."""
    spec = SpecConfig(mode="ngram", budgets=(4,))
    sp = Speculator(spec)
    eng = Engine(tiny, None, EngineConfig(kv_cache_gb=0.05, spec=spec), sp)
    eng.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=6, temperature=0, ignore_eos=True))
    assert sp.lengths.remaining(PROMPTS[0], 0) == 6
    seen = []
    orig = sp.drafters["ngram"].propose

    def spy(seqs, budgets, depths):
        seen.extend((len(s.output_ids), b) for s, b in zip(seqs, budgets))
        return orig(seqs, budgets, depths)

    sp.drafters["ngram"].propose = spy
    eng.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=30, temperature=0, ignore_eos=True))
    assert seen and all(b <= max(6 - n, 1) for n, b in seen if n < 6)


def test_the_tail_drafts_its_full_budget_where_rows_are_cheap():
    """A request whose adaptive depth fell to 2 after a rejection drafts the arm's full budget where the pass's
    extra rows cost little (one sequence on a CPU), and keeps the adaptive depth where they cost (a large batch)."""
    spec = SpecConfig(mode="ngram", budgets=(2, 8))
    sp = Speculator(spec)
    sel = sp.selector
    for B, d in [(1, 0), (1, 8), (4, 0), (4, 8), (64, 0), (64, 8)]:  # 25 ms a pass + 0.2 ms a row + 1 ms a sequence
        for _ in range(3):
            sel.time.record(sel.geometry.shape([4] * B, [d] * B), 0.025 + 0.0002 * B * (1 + d) + 0.001 * B)
    assert sel.free_depth([4]) == 8 and sel.free_depth([4] * 64) == 0
    seen = []

    class Spy(ModelFreeDrafter):
        name = "ngram"

        def start(self, seq):
            pass

        def accept(self, seq, tokens):
            pass

        def propose_one(self, seq, budget, depth):
            seen.append(depth)
            return None

    sp.drafters["ngram"] = Spy()
    sp.selector.choose = lambda B, contexts=None, *_, **__: sp.selector.drafter_arms[-1]  # ngram:8

    class Seq:
        prompt_ids, output_ids, max_tokens = [1, 2, 3], [4, 5], 64

        def __init__(self, seq_id):
            self.seq_id = seq_id
            sp.resume(seq_id, 2)  # its adaptive depth: 2

    sp.plan([Seq(0)])
    sp.plan([Seq(i) for i in range(64)])
    assert seen[0] == 8 and set(seen[1:]) == {2}


def test_block_budget_fills_whole_query_blocks():
    from tailrl.speculative.budgets import block_budget

    assert [block_budget(n, 4) for n in range(1, 18)] == [1, 2, 3, 3, 3, 3, 7, 7, 7, 7, 11, 11, 11, 11, 15, 15, 15]
    assert [block_budget(n, 1) for n in (1, 4, 16)] == [1, 4, 16]
    from tailrl.speculative.budgets import block_end

    assert [block_end(n, 4) for n in (0, 1, 2, 3, 4, 7, 8)] == [3, 3, 3, 3, 7, 7, 11]


@pytest.mark.parametrize("route", ["in place", "chunked", "plain"])
def test_an_invariant_verifier_gets_drafts_of_whole_query_blocks(request, tiny, route):
    """Under batch-invariant passes a sequence's 1 + n rows fill whole blocks of query rows (its attention reads the
    sequence's keys once per block, full or not): on the chunked route (model/chunked.py) blocks of QUERY_BLOCK = 4
    rows, so the selector's budgets (1, 2, 4, 8, 16) become (1, 2, 3, 7, 15) and every draft asked for is one of
    those lengths; in place (our kernel, a CPU's default) items of ITEM_TOKENS = 16, so 16 becomes 15. Plain passes
    keep the budgets as configured."""
    from tailrl.model.chunked import QUERY_BLOCK
    from tailrl.model.paged_attention import ITEM_TOKENS, available

    if route == "chunked":
        request.getfixturevalue("chunked_route")
    elif route == "in place" and not available():
        pytest.skip("our kernel is not built here")
    invariant = route != "plain"
    spec = SpecConfig(mode="ngram", budgets=(1, 2, 4, 8, 16), init_depth=16, min_depth=4)
    sp = Speculator(spec)
    eng = Engine(tiny, None, EngineConfig(kv_cache_gb=0.05, spec=spec, batch_invariant=invariant), sp)
    assert eng.runner.invariant == invariant
    arms = iter(sp.selector.drafter_arms * 100)  # the arms in turn: every budget
    sp.selector.choose = lambda B, contexts=None, *_, **__: next(arms)
    asked = []
    orig = sp.drafters["ngram"].propose

    def spy(seqs, budgets, depths):
        asked.extend(min(b, d) for b, d in zip(budgets, depths))
        return orig(seqs, budgets, depths)

    sp.drafters["ngram"].propose = spy
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [8, 9, 8, 9, 8, 9]]  # repeats: n-gram drafts that get accepted, depths grow
    out = eng.generate(prompts, SamplingParams(n=3, max_tokens=60, temperature=0, ignore_eos=True))
    assert all(len(c.token_ids) == 60 for c in out)
    if route == "chunked":
        assert QUERY_BLOCK == 4 and sp.row_block == 4 and sp.selector.budgets == (1, 2, 3, 7, 15)
        # drafts are asked for to the end of their last query block (the free rows of a tile may verify them:
        # test_free_rows_of_the_last_tile_verify_more_drafts_and_change_no_token); 1 and 2 where max_tokens is near
        assert set(asked) <= {0, 1, 2, 3, 7, 11, 15} and {3, 7, 15} <= set(asked)
    elif route == "in place":
        assert ITEM_TOKENS == 16 and sp.row_block == 16 and sp.selector.budgets == (1, 2, 4, 8, 15)
        assert set(asked) <= set(range(16)) and 15 in asked  # to the end of the item: 15 drafts and the root
    else:
        assert sp.selector.budgets == (1, 2, 4, 8, 16)
        assert {1, 2, 4, 8, 16} <= set(asked)


@pytest.mark.parametrize("route", ["in place", "chunked"])
def test_free_rows_of_the_last_tile_verify_more_drafts_and_change_no_token(request, tiny, route):
    """6 sequences drafting one token each verify 12 rows in a pass whose products run on 16 (ROW_TILE) in calls of
    the probe's rows: the free rows (to the tile's end until the step-time model has priced a row, then to the last
    product call's end) verify the next nodes of the likeliest drafts, never past a sequence's query block
    (ITEM_TOKENS in place, QUERY_BLOCK on the chunked route) or into another weight stream. The tokens are those of
    plain decoding."""
    if route == "chunked":
        request.getfixturevalue("chunked_route")

    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [8, 9, 8, 9, 8, 9]]
    params = SamplingParams(n=3, max_tokens=60, temperature=0, ignore_eos=True)
    spec = SpecConfig(mode="ngram", budgets=(1,))
    sp = Speculator(spec)
    eng = Engine(tiny, None, EngineConfig(kv_cache_gb=0.05, spec=spec, batch_invariant=True), sp)
    passes = []
    decode = eng.runner.decode

    def spy(roots, cache_lens, trees):
        passes.append((list(sp._planned), [len(t) if t else 0 for t in trees or []]))
        return decode(roots, cache_lens, trees)

    eng.runner.decode = spy
    block = sp.row_block
    assert block == (4 if route == "chunked" else 16)
    out = eng.generate(prompts, params)
    off = Engine(tiny, None, EngineConfig(kv_cache_gb=0.05, spec=SpecConfig(mode="off"), batch_invariant=True))
    assert [c.token_ids for c in out] == [c.token_ids for c in off.generate(prompts, params)]
    verified = [(p, v) for p, v in passes if v]
    assert verified and any(sum(v) > sum(p) for p, v in verified)  # steps verified more than the arm's budget
    for planned, nodes in verified:
        assert all(p <= n <= max(p, -(-(1 + p) // block) * block - 1) for p, n in zip(planned, nodes))
        streams = lambda ns: sp.selector.geometry.passes(sum(1 + n for n in ns))  # noqa: E731
        assert streams(nodes) == streams(planned)
    fed = SpecConfig(mode="ngram", budgets=(1,), fill_tiles=False)
    sp2 = Speculator(fed)
    eng2 = Engine(tiny, None, EngineConfig(kv_cache_gb=0.05, spec=fed, batch_invariant=True), sp2)
    passes.clear()
    decode2 = eng2.runner.decode
    eng2.runner.decode = lambda r, c, t: (passes.append(([], [len(x) for x in t or [] if x])), decode2(r, c, t))[1]
    eng2.generate(prompts, params)
    assert passes and all(n <= 1 for _, ns in passes for n in ns)  # fill_tiles=false: the arm's budget only
