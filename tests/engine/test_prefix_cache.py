"""Prompts that begin with the same whole blocks share them (EngineConfig.prefix_cache, engine/scheduler.py): a
later request prefills only what differs; on the batch-invariant engine the tokens and logprobs are those of
prefilling every prompt whole, with speculation on or off and under preemption; no block leaks, nothing is shared
across rollouts, and nothing a request writes lands in a block it shares."""

import pytest
import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.engine.blocks import BLOCK
from tailrl.speculative.config import SpecConfig
from tests.helpers import tiny_model

FEW_SHOT = [3 + (5 * i) % 80 for i in range(45)]  # a shared prefix of 2 whole blocks and 13 tokens
PROMPTS = [FEW_SHOT + [10 + i, 20 + i, 30 + i] * (i + 1) for i in range(5)] + [FEW_SHOT[:32]]  # the last: 2 blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "llama", seed=11)


def _engine(model, on: bool, mode="off", invariant=True, gb=0.05) -> Engine:
    return Engine(model, None, EngineConfig(kv_cache_gb=gb, seed=0, prefix_cache=on, batch_invariant=invariant,
                                            spec=SpecConfig(mode=mode, min_match=1)))


def _params():
    return [SamplingParams(n=2, max_tokens=24, temperature=1.0, seed=7 + i) for i in range(len(PROMPTS))]


def _free(eng) -> bool:
    t = eng.runner.kv.tables
    return t.num_free == t.num_blocks - 1 and not t.cached and not t.key_of


@pytest.mark.parametrize("mode", ["off", "ngram"])
def test_shared_prefix_blocks_give_the_tokens_of_whole_prefills(tiny, mode):
    on, off = _engine(tiny, True, mode), _engine(tiny, False, mode)
    got, want = on.generate(PROMPTS, _params()), off.generate(PROMPTS, _params())
    # every prompt after the first shares FEW_SHOT's 2 whole blocks; the 32-token one only its first (its second
    # block holds its last position, which it prefills for its logits)
    assert on.shared_tokens == (len(PROMPTS) - 2) * 2 * BLOCK + BLOCK and off.shared_tokens == 0
    assert got.stats.prefill_reused == on.shared_tokens and want.stats.prefill_reused == 0
    share = got.stats.metrics()["rollout/prefill_reused_share"]
    assert share == on.shared_tokens / sum(len(p) for p in PROMPTS)  # every prompt's positions, computed or reused
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.logprobs for c in got] == [c.logprobs for c in want]
    assert _free(on), "a block leaked, or the prefix index outlived the rollout"


def test_indexed_blocks_never_change_while_live_and_nothing_is_shared_across_rollouts(tiny):
    """A block in the prefix index holds a prompt's K/V: from the step that computed it until it is freed, no pass
    may write into it (a request sharing it prefills only past it; decode and drafts write past the prompt)."""
    eng = _engine(tiny, True, mode="ngram")
    eng.add_requests(PROMPTS, _params())
    t, snap, checked = eng.runner.kv.tables, {}, 0
    while eng.has_work():
        eng.step()
        for blk in [blk for blk in snap if blk not in t.key_of]:  # freed (maybe reused): no longer a prefix block
            del snap[blk]
        for blk in t.key_of:
            now = torch.stack([eng.runner.kv.k[0][:, blk], eng.runner.kv.v[-1][:, blk]])
            if blk in snap:
                assert torch.equal(snap[blk], now), f"prefix block {blk} was written while indexed"
                checked += 1
            else:
                snap[blk] = now.clone()
    eng.end_rollout()
    assert checked > 0 and eng.shared_tokens > 0
    first = eng.shared_tokens
    eng.generate(PROMPTS[:1], _params()[:1])  # alone in its rollout: the last rollout's blocks are not shared
    assert eng.shared_tokens == first and _free(eng)


def test_sharing_under_preemption_gives_the_same_tokens(tiny):
    c = tiny.config
    gb = 30.5 * BLOCK * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4 / 2**30  # 30 blocks
    small, big = _engine(tiny, True, gb=gb), _engine(tiny, False)
    params = [SamplingParams(n=3, max_tokens=64, temperature=1.0, seed=7 + i) for i in range(len(PROMPTS))]
    got, want = small.generate(PROMPTS, params), big.generate(PROMPTS, params)
    assert small.shared_tokens > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert _free(small)


def test_plain_passes_share_within_fp32_rounding(tiny):
    on, off = _engine(tiny, True, invariant=False), _engine(tiny, False, invariant=False)
    got, want = on.generate(PROMPTS, _params()), off.generate(PROMPTS, _params())
    assert on.shared_tokens > 0
    for a, b in zip(got, want):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        assert n > 0
        torch.testing.assert_close(torch.tensor(a.logprobs[:n]), torch.tensor(b.logprobs[:n]), atol=1e-4, rtol=0)
