"""The step API: moving running sequences between engines, merging statistics, aborting; keyed noise."""

import dataclasses
import math

import pytest
import torch
from scipy.stats import chisquare

from tailrl.engine import Engine, EngineConfig, GenerateStats, SamplingParams
from tailrl.model.step import make_step
from tailrl.speculative.config import SpecConfig
from tailrl.speculative.noise import gumbel, row_keys, uniform, uniforms
from tailrl.speculative.tree import DraftTree
from tests.helpers import tiny_model

PROMPTS = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "llama", seed=3)


def engine(model, mode: str) -> Engine:
    return Engine(model, None, EngineConfig(kv_cache_gb=0.05, spec=SpecConfig(mode=mode, min_match=1)))


def run(eng: Engine, params, move_at: int | None = None, dest: Engine | None = None) -> dict:
    """Runs PROMPTS to the end; at step move_at every unfinished sequence is exported to dest and finishes there.
    Returns (prompt, sample) -> (tokens, logprobs)."""
    ids = eng.add_requests(PROMPTS, params)
    done, steps, moved = {}, 0, 0
    while eng.has_work():
        done.update({(c.prompt_index, c.sample_index): c for c in eng.step().finished})
        steps += 1
        if steps == move_at:
            states = eng.export(eng.unfinished_ids())
            moved = sum(len(s.output_ids) > 0 for s in states)
            dest.import_(states)
            eng = dest
    assert len(done) == len(ids)
    if move_at is not None:
        assert moved >= 3, "the test must move sequences mid-generation"
    return {k: (c.token_ids, c.logprobs, c.finish_reason) for k, c in done.items()}


@pytest.mark.parametrize("mode", ["off", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_moved_sequence_finishes_with_the_tokens_it_would_have_produced(tiny, mode, temperature):
    params = SamplingParams(n=3, max_tokens=24, temperature=temperature, seed=7, ignore_eos=True)
    ref = run(engine(tiny, mode), params)
    moved = run(engine(tiny, mode), params, move_at=6, dest=engine(tiny, mode))
    assert ref.keys() == moved.keys()
    for k in ref:
        assert moved[k][0] == ref[k][0], k
        # the importer re-prefills: fp32 rounding of a many-row pass differs from step-by-step decoding
        assert moved[k][1] == pytest.approx(ref[k][1], abs=1e-4), k


def test_export_returns_the_states_in_the_order_asked_and_refuses_unknown_ids(tiny):
    """The cluster driver pairs exported states with its own (prompt, sample) keys by position: states in the
    engine's slot order (which finishing sequences reshuffle) labelled another prompt's samples as these."""
    eng = engine(tiny, "off")
    ids = eng.add_requests(PROMPTS, SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=7))
    key_of = {i: (k // 3, k % 3) for k, i in enumerate(ids)}  # add_requests: ids in (prompt, sample) order
    for _ in range(4):
        eng.step()
    with pytest.raises(ValueError, match="cannot export"):
        eng.export([ids[0], 10_000])
    live = eng.unfinished_ids()
    assert len(live) == len(ids)  # the failed export took nothing out
    want = sorted(live, key=lambda i: (-key_of[i][1], key_of[i][0]))[:5]  # an order the scheduler does not keep
    assert want != [i for i in live if i in want]
    states = eng.export(want)
    assert [(st.prompt_index, st.sample_index) for st in states] == [key_of[i] for i in want]
    assert [st.prompt_ids for st in states] == [PROMPTS[key_of[i][0]] for i in want]
    assert sorted(eng.unfinished_ids()) == sorted(set(live) - set(want))


def test_merged_stats_of_two_halves_equal_the_stats_of_the_whole(tiny):
    eng = engine(tiny, "ngram")
    eng.add_requests(PROMPTS, SamplingParams(n=2, max_tokens=20, temperature=1.0, seed=1, ignore_eos=True))
    records = []
    while eng.has_work():
        records.append(eng.step().record)
    assert {r.kind for r in records} >= {"prefill", "decode"} and any(r.drafter for r in records)
    whole, a, b = GenerateStats(), GenerateStats(), GenerateStats()
    for i, r in enumerate(records):
        whole.add(r)
        (a if i < len(records) // 2 else b).add(r)
    merged = dataclasses.asdict(a.merge(b))
    expect = dataclasses.asdict(whole)
    assert merged.keys() == expect.keys()
    for k, v in expect.items():
        assert merged[k] == (pytest.approx(v) if isinstance(v, float) else v), k
    assert merged["generated_tokens"] > 0 and merged["drafters"]


def test_abort_finishes_only_the_named_sequences(tiny):
    eng = engine(tiny, "off")
    ids = eng.add_requests(PROMPTS, SamplingParams(n=2, max_tokens=16, seed=0, ignore_eos=True))
    eng.step()
    eng.step()
    aborted = eng.abort(ids[:2])
    assert [c.finish_reason for c in aborted] == ["abort", "abort"] and all(c.token_ids for c in aborted)
    rest = []
    while eng.has_work():
        rest += eng.step().finished
    assert sorted(c.seq_id for c in rest) == ids[2:] and all(len(c.token_ids) == 16 for c in rest)


def test_the_speculator_drops_a_sequences_state_when_it_finishes_aborts_or_leaves(tiny):
    """Drafter state, draft depth and shadows live in the speculator, keyed by seq_id: every way out of the engine
    drops them (a long-lived rollout engine would otherwise hold every sequence it ever ran)."""
    eng, dest = engine(tiny, "auto"), engine(tiny, "auto")
    sp = eng.speculator
    ids = eng.add_requests(PROMPTS, SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert set(sp.seqs) == set(ids) and set(sp.drafters["ngram"].models) == set(ids)
    eng.abort(ids[:1])
    depths = [sp.depth(i) for i in ids[1:3]]
    states = eng.export(ids[1:3])
    assert all(d >= 1 for d in depths) and [st.spec_depth for st in states] == depths
    assert ids[0] not in sp.seqs and [sp.depth(i) for i in ids[1:3]] == [0, 0]
    moved = dest.import_(states)
    assert [dest.speculator.depth(i) for i in moved] == depths  # drafts on at the depth it had
    while eng.has_work():
        eng.step()
    while dest.has_work():
        dest.step()
    for e in (eng, dest):
        assert not e.speculator.seqs
        assert not e.speculator.drafters["ngram"].models and not e.speculator.drafters["history"].streams


def test_the_kv_cache_is_laid_out_once_for_uniform_requests(tiny):
    eng = engine(tiny, "off")
    params = SamplingParams(n=4, max_tokens=12, seed=0, ignore_eos=True)
    eng.generate(PROMPTS, params)
    storage = eng.runner.kv.k[0].data_ptr()
    eng.generate(PROMPTS, params)
    assert eng.runner.kv.k[0].data_ptr() == storage


def test_tensor_built_tree_masks_equal_the_trees_own_masks():
    trees = [DraftTree([5, 6, 7, 8], [-1, -1, 0, 2]), None, DraftTree([9], [-1]), DraftTree([1, 2, 3], [-1, 0, 1])]
    q = [1 + len(t) if t else 1 for t in trees]
    Q = max(q)
    parents = [[0] + ([p + 1 for p in t.parents] if t else []) for t in trees]
    parents = [p + list(range(len(p), Q)) for p in parents]
    cache = [3, 0, 5, 2]
    step = make_step(cache, q, [0, 1, 2, 3], tree_parents=torch.tensor(parents))
    for b, t in enumerate(trees):
        want = t.attention_mask() if t else torch.ones(1, 1, dtype=torch.bool)
        got = step.mask[b, 0, : q[b], cache[b] : cache[b] + q[b]]
        assert torch.equal(got, want), b
        assert bool(step.mask[b, 0, : q[b], : cache[b]].all())
    depths = [0, 1, 1, 2, 3] + [0] + [0, 1] + [0, 1, 2, 3]
    assert step.depths.tolist() == depths
    assert step.positions.tolist() == [c + d for c, d in zip([3] * 5 + [0] + [5] * 2 + [2] * 4, depths)]


def test_keyed_noise_is_the_same_in_python_and_torch_and_uniform_and_independent():
    """Chi-square at significance 0.001 on 200k draws: uniform over 50 bins; pairs of neighbouring positions,
    indices and seeds uniform over a 10 x 10 grid (independence)."""
    seeds, pos = [0, 1, 2**62, -5, 10**12], [0, 7, 3, 1000, 2**40]
    assert [uniform(s, p, 2) for s, p in zip(seeds, pos)] == uniforms(seeds, pos, 2).tolist()
    n = 200_000
    s = torch.arange(n) // 1000
    p = torch.arange(n) % 1000
    u = uniforms(s, p)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert chisquare(torch.histc(u.float(), 50, 0, 1).numpy()).pvalue > 1e-3
    for other in (uniforms(s, p + 1), uniforms(s, p, 1), uniforms(s + 1, p)):
        cells = (u * 10).long() * 10 + (other * 10).long()
        assert chisquare(torch.bincount(cells, minlength=100).numpy()).pvalue > 1e-3


def test_keyed_gumbel_noise_is_gumbel_and_independent_across_vocabulary_and_positions():
    """The 23-bit uniforms behind the Gumbel noise: chi-square at significance 0.001 over 50 bins, and over a
    10 x 10 grid of pairs (neighbouring vocabulary entries; neighbouring positions; neighbouring seeds)."""
    keys = row_keys(torch.arange(64) // 8, torch.arange(64) % 8)
    g = gumbel(keys, 4096)  # [64, 4096]
    u = torch.exp(-torch.exp(-g.double()))  # back to the uniforms
    assert chisquare(torch.histc(u.float(), 50, 0, 1).numpy()).pvalue > 1e-3
    assert abs(float(g.mean()) - 0.5772) < 0.01  # the Euler-Mascheroni constant
    pairs = [(u[:, :-1], u[:, 1:]), (u[:-1], u[1:])]  # vocabulary neighbours; (seed, position) neighbours
    for a, b in pairs:
        cells = (a * 10).long() * 10 + (b * 10).long()
        assert chisquare(torch.bincount(cells.flatten(), minlength=100).numpy()).pvalue > 1e-3
    assert torch.equal(gumbel(row_keys([5], [9]), 4096)[0], gumbel(row_keys([5, 6], [9, 9]), 4096)[0])  # batch-free


def test_a_request_that_fits_the_budget_runs_to_its_end(tiny):
    """A 300-token budget is 18 blocks of 16, one the null block: 272 positions. A request whose last token needs
    position 271 runs to max_tokens with no error (the K/V of its last sampled token is never written), within the
    budget, and gives every block back."""
    c = tiny.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    eng = Engine(tiny, None, EngineConfig(kv_cache_gb=300 * per_token / 2**30))
    assert eng.runner.kv.num_blocks == 300 // 16
    out = eng.generate([[3, 4, 5]], SamplingParams(max_tokens=272 - 3 + 1, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.error is None and len(out.token_ids) == 270
    assert eng.last_stats.peak_kv_bytes <= 300 * per_token
    assert eng.runner.kv.tables.num_free == eng.runner.kv.num_blocks - 1


def test_a_rollout_keeps_older_objects_out_of_the_garbage_collector(tiny):
    """Objects older than a rollout are frozen while it runs (full collections would rescan them every few hundred
    steps' allocations) and handed back when it ends, so nothing is left frozen (no cyclic garbage kept)."""
    import gc

    gc.unfreeze()  # an earlier test's engine may have stopped mid-rollout
    eng = engine(tiny, "auto")
    eng.add_requests(PROMPTS, SamplingParams(n=2, max_tokens=6, seed=1))
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # the model's modules, the libraries
    eng.add_requests(PROMPTS[:1], SamplingParams(max_tokens=3, seed=2))  # joins the running rollout: no refreeze
    assert gc.get_freeze_count() <= frozen  # (frozen objects freed by reference counting leave it)
    while eng.has_work():
        eng.step()
    assert 0 < gc.get_freeze_count() <= frozen
    eng.end_rollout()
    assert gc.get_freeze_count() == 0
    eng.generate(PROMPTS, SamplingParams(max_tokens=4, seed=3))
    assert gc.get_freeze_count() == 0


def test_imported_sequences_decode_under_the_weights_the_model_holds_now(tmp_path_factory):
    """A partial rollout imports its carried responses before it adds any request (issue 64): the engine repacks
    its weights then too, so a change that moved no version counter (torch's fused AdamW steps in place) reaches
    them. Here the LM head is zeroed that way: every continued token is then drawn from the uniform distribution.
    (Under the last rollout's packs, a resumed run and the run that never stopped sampled different tokens.)"""
    model = tiny_model(tmp_path_factory, "llama", seed=4)
    eng = engine(model, "off")
    eng.add_requests(PROMPTS, SamplingParams(n=2, max_tokens=24, temperature=1.0, seed=7, ignore_eos=True))
    for _ in range(4):
        eng.step()
    states = eng.export(eng.unfinished_ids())
    assert not eng.has_work() and all(st.output_ids for st in states)
    version = model.lm_head.weight._version
    model.lm_head.weight.data.zero_()  # in place, as a fused optimizer step: no version counter moves
    assert model.lm_head.weight._version == version
    had = {(st.prompt_index, st.sample_index): len(st.output_ids) for st in states}
    eng.import_(states)
    new = []
    while eng.has_work():
        new += [lp for c in eng.step().finished for lp in c.logprobs[had[(c.prompt_index, c.sample_index)]:]]
    assert len(new) == sum(24 - k for k in had.values())
    assert new == pytest.approx([-math.log(model.config.vocab_size)] * len(new), abs=1e-5)
