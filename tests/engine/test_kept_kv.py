"""A stopped sequence's K/V kept for the request that continues it (an agent's next turn: engine/scheduler.py,
SamplingParams.keep_kv/resume): the continuation prefills only its new tokens, and on the batch-invariant engine it
draws the very tokens and logprobs a full prefill draws, with speculation on or off, whether the kept K/V survived,
was evicted under memory pressure, or its request was preempted after taking it over; no block leaks."""

import pytest
import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.speculative.config import SpecConfig
from tests.helpers import cache_gb, tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # test_paged.py's model
    return tiny_model(tmp_path_factory, "llama", seed=11)


PROMPTS = [list(range(3, 3 + n)) for n in (40, 7, 23, 16, 55, 12)]
STOPS = [20, 31, 42, 53, 64, 75]  # 6 of 96 words: a turn of 40 tokens stops early with probability ~0.92
EXTRA = [5, 6, 7, 8, 9, 10, 11]  # the "observation" a continuation appends after the stopped turn


def _engine(model, blocks=None, mode="off", invariant=True) -> Engine:
    return Engine(model, None, EngineConfig(kv_cache_gb=cache_gb(blocks, model) if blocks else 0.05, seed=0,
                                            spec=SpecConfig(mode=mode, min_match=1), batch_invariant=invariant))


def _drive(eng: Engine, prompts, params):
    """Runs requests to their end without ending the rollout (generate would drop the kept K/V)."""
    col = eng.collector(eng.add_requests(prompts, params))
    while eng.has_work():
        col.add(eng.step())
    return col.result()


def two_turns(eng: Engine, resume: bool, second_tokens: int = 24):
    """Turn 1 stops on a stop token (keep_kv); turn 2 continues each stopped sample with EXTRA appended."""
    first = _drive(eng, PROMPTS, [SamplingParams(n=2, max_tokens=40, temperature=1.0, seed=3 + i, keep_kv=True,
                                                 stop_token_ids=STOPS) for i in range(len(PROMPTS))])
    stopped = [c for c in first if c.finish_reason == "stop"]
    assert len(stopped) >= 6, "too few turns stopped on a stop token for the test to mean anything"
    params = [SamplingParams(max_tokens=second_tokens, temperature=1.0, seed=100 + k, resume=c.seq_id if resume else None)
              for k, c in enumerate(stopped)]
    second = _drive(eng, [c.prompt_token_ids + c.token_ids + EXTRA for c in stopped], params)
    return first, second


@pytest.mark.parametrize("mode", ["off", "ngram"])
def test_a_continuation_over_kept_kv_draws_what_a_full_prefill_draws(tiny, mode):
    eng, ref = _engine(tiny, mode=mode), _engine(tiny, mode=mode)
    first, kept = two_turns(eng, resume=True)
    saved = eng.kept_tokens
    _, full = two_turns(ref, resume=False)
    stopped = [c for c in first if c.finish_reason == "stop"]
    # every stopped turn's K/V was kept and taken over: positions = its prompt and tokens but the last
    assert saved == sum(len(c.prompt_token_ids) + len(c.token_ids) - 1 for c in stopped)
    assert ref.kept_tokens == 0
    assert [c.token_ids for c in kept] == [c.token_ids for c in full]
    assert [c.logprobs for c in kept] == [c.logprobs for c in full]
    eng.end_rollout()
    t = eng.runner.kv.tables
    assert not eng.scheduler.parked and t.num_free == t.num_blocks - 1, "a kept block leaked"


def test_kept_kv_is_dropped_on_request_and_at_the_rollouts_end(tiny):
    eng = _engine(tiny)
    first = _drive(eng, PROMPTS, [SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=3 + 2 * i, keep_kv=True,
                                                 stop_token_ids=STOPS) for i in range(len(PROMPTS))])
    stopped = [c.seq_id for c in first if c.finish_reason == "stop"]
    others = [c.seq_id for c in first if c.finish_reason != "stop"]
    assert set(eng.scheduler.parked) == set(stopped) and others and stopped  # one cut at max_tokens keeps nothing
    t = eng.runner.kv.tables
    held = t.num_blocks - 1 - t.num_free
    assert held > 0
    eng.drop_kept(stopped[:1] + [10**9])  # an unknown id is ignored
    assert set(eng.scheduler.parked) == set(stopped[1:]) and t.num_blocks - 1 - t.num_free < held
    eng.end_rollout()
    assert not eng.scheduler.parked and t.num_free == t.num_blocks - 1


def test_kept_kv_gives_way_to_running_sequences_and_the_tokens_do_not_change(tiny):
    """A pool of 36 blocks: parked K/V is freed oldest first when turn 2's requests need blocks (that
    continuation prefills everything), and continuations that took theirs over are preempted as they grow and
    recomputed from position 0; the tokens equal a large pool's with no K/V kept."""
    small = _engine(tiny, blocks=36)
    preempted_kept = []
    preempt = small.scheduler.preempt
    small.scheduler.preempt = lambda s: (preempted_kept.append(s.kept), preempt(s))
    first_small, kept = two_turns(small, resume=True, second_tokens=64)
    _, full = two_turns(_engine(tiny), resume=False, second_tokens=64)
    stopped = [c for c in first_small if c.finish_reason == "stop"]
    assert small.scheduler.evicted > 0, "the pool never ran short of parked K/V: the test sees nothing"
    assert any(k > 0 for k in preempted_kept), "no continuation was preempted after taking its K/V over"
    assert 0 < small.kept_tokens < sum(len(c.prompt_token_ids) + len(c.token_ids) - 1 for c in stopped)
    assert [c.token_ids for c in kept] == [c.token_ids for c in full]
    assert [c.logprobs for c in kept] == [c.logprobs for c in full]
    small.end_rollout()
    t = small.runner.kv.tables
    assert t.num_free == t.num_blocks - 1


def test_a_resume_that_does_not_continue_its_kept_tokens_prefills_everything(tiny):
    eng, ref = _engine(tiny), _engine(tiny)
    p = SamplingParams(max_tokens=40, temperature=1.0, seed=3, keep_kv=True, stop_token_ids=STOPS)
    (c,) = _drive(eng, PROMPTS[:1], p)
    assert c.finish_reason == "stop" and eng.scheduler.parked
    other = PROMPTS[1] + EXTRA  # not a continuation of c: the kept K/V must not be used
    q = SamplingParams(max_tokens=12, temperature=1.0, seed=9)
    (a,) = _drive(eng, [other], SamplingParams(max_tokens=12, temperature=1.0, seed=9, resume=c.seq_id))
    (b,) = _drive(ref, [other], q)
    assert eng.kept_tokens == 0 and a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_plain_passes_continue_kept_kv_within_fp32_rounding(tiny):
    """Without batch invariance a continuation's prefill sums its attention in other shapes than a full prefill:
    the same distribution, logprobs equal to fp32 rounding (a 3-layer 64-wide model: a few ulps of values ~10,
    bounded here at 1e-4) while the sampled tokens agree."""
    eng, ref = _engine(tiny, invariant=False), _engine(tiny, invariant=False)
    _, kept = two_turns(eng, resume=True)
    _, full = two_turns(ref, resume=False)
    assert eng.kept_tokens > 0
    for a, b in zip(kept, full):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        assert n > 0
        torch.testing.assert_close(torch.tensor(a.logprobs[:n]), torch.tensor(b.logprobs[:n]), atol=1e-4, rtol=0)


def test_an_imported_sequence_does_not_take_kept_kv_by_another_engines_id(tiny):
    """`resume` names a sequence of the engine a request was made on: exported and imported elsewhere, it must not
    claim (or free) the kept K/V that happens to sit under that id there."""
    a, b = _engine(tiny), _engine(tiny)
    (c,) = _drive(b, PROMPTS[:1], SamplingParams(max_tokens=40, temperature=1.0, seed=3, keep_kv=True,
                                                  stop_token_ids=STOPS))
    assert c.finish_reason == "stop" and list(b.scheduler.parked) == [c.seq_id]
    (sid,) = a.add_requests([PROMPTS[1] + EXTRA], SamplingParams(max_tokens=8, seed=9, resume=c.seq_id))
    (moved,) = b.import_(a.export([sid]))
    while b.has_work():
        b.step()
    assert list(b.scheduler.parked) == [c.seq_id] and b.kept_tokens == 0
