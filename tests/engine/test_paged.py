"""The paged KV cache (engine/blocks.py, kv_cache.py, scheduler.py): a group holds its prompt once, no block leaks
whatever ends a sequence, a KV budget small enough to preempt gives the very tokens a large one gives, and a
sequence that outgrows the whole cache is cut with an error naming the numbers while the rest finishes."""

import pytest
import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.engine.blocks import BLOCK, BlockTables, blocks_for
from tailrl.speculative.config import SpecConfig
from tests.helpers import cache_gb, tiny_model

PROMPTS = [list(range(3, 3 + n)) for n in (40, 7, 23, 16, 55, 12)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "llama", seed=11)


def _engine(model, blocks=None, mode="off", invariant=False, max_num_seqs=256) -> Engine:
    spec = SpecConfig(mode=mode, min_match=1)
    return Engine(model, None, EngineConfig(kv_cache_gb=cache_gb(blocks, model) if blocks else 0.05, spec=spec,
                                            batch_invariant=invariant, max_num_seqs=max_num_seqs))


def _all_free(eng: Engine) -> bool:
    t = eng.runner.kv.tables
    return t.num_free == t.num_blocks - 1 and not any(t.blocks) and not t.host.any()


def test_block_tables_share_fork_and_give_back():
    t = BlockTables(10, rows=3, width=12, device="cpu")
    assert t.grow(0, 40) == [1, 2, 3] and t.num_free == 6  # block 0 is never handed out
    assert t.fork(0, 1, 40) == (3, 4)  # shares the 2 full blocks, copies the partial third
    assert t.blocks[1] == [1, 2, 4] and t.refs[1] == 2 and t.refs[3] == 1
    assert t.fork(0, 2, 32) is None and t.blocks[2] == [1, 2]  # ends on a block boundary: nothing to copy
    t.release(0)
    assert t.refs[1] == 2 and 3 in t.free and 1 not in t.free
    t.move_row(2, 0)
    assert t.blocks[0][:2] == [1, 2] and not t.blocks[2] and not t.host[2].any()
    t.release(0), t.release(1)
    assert t.num_free == 9 and all(r == 0 for r in t.refs)
    assert t.grow(0, 9 * BLOCK + 1) is None  # more than is free: takes nothing
    assert t.num_free == 9
    with pytest.raises(ValueError, match="block table holds 12"):
        t.grow(0, 12 * BLOCK + 1)


def test_a_group_holds_its_prompt_once(tiny):
    eng = _engine(tiny)
    n, P = 5, 40
    eng.add_requests([PROMPTS[0]], SamplingParams(n=n, max_tokens=8, seed=1))
    out = eng.step()
    assert out.record.kind == "prefill" and len(eng.scheduler.running) == n
    # the leader's blocks for P + 1 positions, then one block per further sample (its copy of the partial block)
    assert eng.runner.kv.tables.num_used == blocks_for(P + 1) + (n - 1)
    rows = [s.slot for s in eng.scheduler.running]
    shared = set(eng.runner.kv.tables.blocks[rows[0]][: P // BLOCK])
    assert all(set(eng.runner.kv.tables.blocks[r][: P // BLOCK]) == shared for r in rows)
    while eng.has_work():
        eng.step()
    assert _all_free(eng)


@pytest.mark.parametrize("mode", ["off", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_preemption_changes_no_token(tiny, mode, temperature):
    """Invariant passes (fp32 here): a budget of 24 blocks for 6 prompts x 3 samples of up to 60 tokens forces
    preemptions; every response equals the one a 50 MB cache gives, token for token."""
    params = SamplingParams(n=3, max_tokens=60, temperature=temperature, seed=7, ignore_eos=True)
    big = _engine(tiny, mode=mode, invariant=True)
    ref = big.generate(PROMPTS, params)
    small = _engine(tiny, blocks=24, mode=mode, invariant=True)
    out = small.generate(PROMPTS, params)
    assert small.runner.invariant and small.last_stats.preemptions > 0
    assert big.last_stats.preemptions == 0
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert all(o.finish_reason == "length" for o in out)
    assert small.last_stats.peak_kv_bytes <= 24 * BLOCK * small.runner.kv.bytes_per_token
    assert _all_free(small) and _all_free(big)


def test_no_block_leaks_after_abort_export_and_import(tiny):
    params = SamplingParams(n=2, max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
    a, b = _engine(tiny), _engine(tiny)
    ids = a.add_requests(PROMPTS[:3], params)
    for _ in range(4):
        a.step()
    a.abort(ids[:1])
    states = a.export(ids[1:3])
    assert a.scheduler.running and not _all_free(a)
    while a.has_work():
        a.step()
    assert _all_free(a)
    b.import_(states)
    while b.has_work():
        b.step()
    assert _all_free(b)


def test_a_drafter_failure_leaks_no_block(tiny):
    eng = _engine(tiny, mode="ngram")
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("drafter broke")

    eng.speculator.drafters["ngram"].propose = broken
    out = eng.generate(PROMPTS[:2], SamplingParams(n=2, max_tokens=20, temperature=1.0, seed=2, ignore_eos=True))
    assert calls and all(o.finish_reason == "length" and len(o.token_ids) == 20 for o in out)
    assert _all_free(eng)


def test_a_sequence_that_outgrows_the_whole_cache_is_cut_and_the_rest_finishes(tiny):
    eng = _engine(tiny, blocks=6)  # 96 positions in all
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=1.0, seed=2, ignore_eos=True)]
    out = eng.generate(PROMPTS[1:3], params)
    long, short = out
    assert long.finish_reason == "length" and "outgrew the whole KV cache" in long.error
    assert "the cache holds 6" in long.error
    assert len(long.token_ids) == 96 - len(PROMPTS[1]) + 1  # cut when its next token needs position 96
    assert short.finish_reason == "length" and len(short.token_ids) == 5 and short.error is None
    assert _all_free(eng)


def test_the_learned_drafter_mirror_follows_the_tables(tiny):
    """A draft head's cache on the same tables: blocks it grows for tree entries are the target's rows' blocks,
    and they come back when the sequences finish."""
    from tailrl.engine.kv_cache import KVCache

    kv = KVCache(tiny.config, 1 << 20, "cpu", torch.float32)
    kv.allocate(4, 256)
    m = kv.mirror(tiny.config, 8)
    m.ensure([2], 40)
    assert kv.tables.blocks[2] == m.tables.blocks[2] and len(kv.tables.blocks[2]) == 3
    assert len(m.k) == tiny.config.num_hidden_layers and m.k[0].shape[1] == kv.num_blocks
    kv.release(2)
    assert kv.tables.num_free == kv.num_blocks - 1


def test_a_sleeping_engine_frees_its_pools_and_wakes_to_the_same_tokens(tiny):
    """Colocated with a trainer (issue 28), the engine frees its KV pools during the update and takes them back."""
    params = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    ref = _engine(tiny).generate(PROMPTS[:2], params)
    eng = _engine(tiny)
    eng.generate(PROMPTS[:1], params)
    eng.sleep()
    assert not eng.runner.kv.k and not eng.runner.kv.v
    eng.wake()
    out = eng.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    eng.add_requests(PROMPTS[:1], params)
    with pytest.raises(RuntimeError, match="cannot sleep"):
        eng.sleep()


@pytest.mark.slow  # 6.7 s: the fast tier stays under 3 minutes (the learned drafter is off by default)
def test_the_learned_drafter_under_preemption_cuts_its_trees_and_changes_no_token(tiny, caplog):
    """A budget that preempts: the draft head's tree entries need blocks past what make_room gave. Where the pool
    is short it drafts shallower trees (or none) instead of failing the batch; no drafter warning, the very
    tokens a 50 MB cache gives, and every block back."""
    import logging

    from tailrl.drafter import DrafterConfig, EagleDrafter, make_speculator
    from tailrl.drafter.propose import LearnedDrafter

    params = SamplingParams(n=3, max_tokens=60, temperature=0.0, seed=7, ignore_eos=True)
    spec = SpecConfig(mode="learned", budgets=(6,))
    outs, engines = [], []
    for blocks in (None, 24):
        head = EagleDrafter(tiny.config).bind(tiny)
        drafter = LearnedDrafter(head, DrafterConfig(topk=4, min_prob=0.0))
        eng = Engine(tiny, None, EngineConfig(kv_cache_gb=cache_gb(blocks, tiny) if blocks else 0.05, spec=spec,
                                              batch_invariant=True), make_speculator(spec, drafter))
        with caplog.at_level(logging.WARNING, logger="tailrl"):
            outs.append(eng.generate(PROMPTS, params))
        engines.append(eng)
    big, small = engines
    assert small.last_stats.preemptions > 0 and big.last_stats.preemptions == 0
    assert sum(o.stats["drafted"] for o in outs[1]) > 0, "the learned drafter never drafted"
    assert not [r for r in caplog.records if "failed" in r.getMessage()], [r.getMessage() for r in caplog.records]
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[0]]
    assert _all_free(small) and _all_free(big)


def test_a_forked_block_survives_the_lazy_zeroing_of_later_blocks(tiny):
    """The copy-on-write block of a fork lies past the blocks zeroed so far (a fresh pool): a later grow that
    zeroes the next blocks must not wipe it. (It did: siblings of the first rollout's later groups read their last
    prompt block as zeros, so a fresh engine's first bf16 rollout differed with SD on and off.)"""
    from tailrl.engine.kv_cache import KVCache

    kv = KVCache(tiny.config, 0, "cpu", torch.float32)
    kv.allocate(4, 2048, num_blocks=300)
    kv.ensure([0], 63 * BLOCK)  # blocks 1..63; the lazy zeroing has reached block 64
    assert kv.zeroed == 64
    kv.k[0][:, 1:64] = 1.0
    kv.fork(0, 1, 63 * BLOCK - 5)  # the partial block 63 copied into block 64
    new = kv.tables.blocks[1][-1]
    assert new == 64 and torch.equal(kv.k[0][:, new], kv.k[0][:, 63])
    kv.ensure([2], 4 * BLOCK)  # blocks 65..68: zeroes the next chunk of the pool
    assert kv.zeroed > new + 1
    assert (kv.k[0][:, new] == 1.0).all(), "the forked block was zeroed after its copy"
