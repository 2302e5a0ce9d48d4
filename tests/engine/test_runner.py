"""The model runner's buffers and buckets: padded decode/verify passes equal unpadded ones (logits, hidden states,
tree depths and every real K/V in the cache), the engine emits the same tokens with padding on and off, and the
causal prefill kernel equals the dense-mask prefill. CUDA-only tests (graph replay) are skipped on CPU."""

import pytest
import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.engine.blocks import blocks_for
from tailrl.engine.buckets import MIN_KEYS, StaticBatch, pick_bucket
from tailrl.engine.runner import ModelRunner
from tailrl.model.step import make_padded_step, make_step
from tailrl.speculative.config import SpecConfig
from tailrl.speculative.tree import DraftTree
from tests.helpers import tiny_model

from tests.helpers import assert_same_or_tie

PROMPTS = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16, 17]]
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "qwen2", seed=5)  # GQA (4 heads, 2 KV heads) with q/k/v biases


def test_buckets_are_the_smallest_that_hold_the_pass():
    assert pick_bucket(3, 1, 40, slots=64, capacity=512) == pick_bucket(4, 1, 1, slots=64, capacity=512)
    b = pick_bucket(3, 5, 300, slots=64, capacity=1024)
    assert (b.seqs, b.tokens, b.keys) == (4, 8, 512)
    assert pick_bucket(40, 1, 10, slots=50, capacity=64).seqs == 50  # capped at the slots the cache has
    assert pick_bucket(1, 1, 10, slots=4, capacity=1024).keys == MIN_KEYS
    assert pick_bucket(1, 1, 10, slots=4, capacity=48).keys == 48  # capped at the capacity
    assert pick_bucket(257, 1, 10, slots=512, capacity=64) is None
    assert pick_bucket(2, 33, 10, slots=4, capacity=64) is None


def test_a_static_batch_pads_each_sequence_and_points_padded_rows_to_themselves():
    batch = StaticBatch(4, 4, torch.device("cpu"))
    trees = [DraftTree([20, 21, 22], [-1, 0, 0]), None, DraftTree([30], [-1])]
    rows = batch.fill([1, 2, 3], trees, [5, 7, 9])
    assert batch.ids.tolist() == [1, 20, 21, 22, 2, 0, 0, 0, 3, 30, 0, 0, 0, 0, 0, 0]
    assert batch.cache_lens.tolist() == [5, 7, 9, 0] and batch.q_lens.tolist() == [4, 1, 2, 0]
    assert batch.parents.tolist() == [[0, 0, 1, 1], [0, 1, 2, 3], [0, 0, 2, 3], [0, 1, 2, 3]]
    assert rows.tolist() == [0, 1, 2, 3, 4, 8, 9]
    storage = batch.flat.data_ptr()
    assert batch.fill([4], None, [3]).tolist() == [0] and batch.flat.data_ptr() == storage


def test_a_padded_step_writes_padding_to_scratch_and_lets_it_see_key_zero_only():
    parents = torch.tensor([[0, 0, 1, 1], [0, 1, 2, 3], [0, 0, 2, 3], [0, 1, 2, 3]])
    cache, q, keys, scratch = [5, 7, 9, 0], [4, 1, 2, 0], 16, 63
    step = make_padded_step(torch.tensor(cache), torch.tensor(q), parents, keys, scratch)
    ref = make_step(cache[:3], q[:3], [0, 1, 2], tree_parents=parents[:3])
    real = [b * 4 + i for b in range(4) for i in range(q[b])]
    assert step.token_pos[real].tolist() == ref.token_pos.tolist()
    assert step.positions[real].tolist() == ref.positions.tolist()
    assert step.depths[real].tolist() == ref.depths.tolist()
    assert step.token_slot.tolist() == [b for b in range(4) for _ in range(4)]
    pad = [r for r in range(16) if r not in real]
    assert step.token_pos[pad].eq(scratch).all()
    for b in range(3):
        assert torch.equal(step.mask[b, 0, : q[b], : ref.max_k], ref.mask[b, 0, : q[b]]), b
        assert not step.mask[b, 0, : q[b], ref.max_k :].any()  # keys past the pass are never seen
    padded_rows = step.mask.view(16, keys)[pad]
    assert padded_rows[:, 0].all() and not padded_rows[:, 1:].any()


def _runner(model, length: int, pad: bool, rows: int = 3) -> ModelRunner:
    """A runner for sequences of up to `length` positions whose first rows hold blocks for them."""
    r = ModelRunner(model, 2**26, 8, length, capture_hidden=True, pad=pad)
    r.kv.ensure(list(range(rows)), length)
    return r


def _real_kv(r: ModelRunner, lens: list[int], rows=None) -> list[torch.Tensor]:
    """The K/V each row holds at positions < its length, gathered from its blocks."""
    out = []
    for t in r.kv.k + r.kv.v:
        for b, n in zip(rows or range(len(lens)), lens):
            blocks = r.kv.tables.blocks[b][: blocks_for(n)]
            out.append(t[:, blocks].reshape(t.shape[0], -1, t.shape[3])[:, :n])
    return out


TREES = [DraftTree([20, 21, 22, 23], [-1, 0, 0, 1]), None, DraftTree([30, 31], [-1, 0])]


@pytest.mark.parametrize("length", [64, 300])
@pytest.mark.parametrize("trees", [None, TREES], ids=["decode", "verify"])
def test_a_padded_pass_equals_the_unpadded_pass(tiny, length, trees):
    """Three sequences run as a 4-sequence bucket (one padded sequence in a free slot), the verify pass on a
    grid of 8 tokens per sequence: logits, hidden states, depths and all real K/V agree within fp32 noise."""
    runners = [_runner(tiny, length, pad) for pad in (False, True)]
    outs = []
    with torch.inference_mode():
        for r in runners:
            r.prefill(PROMPTS, [0, 1, 2])
            cache = [len(p) for p in PROMPTS]
            outs.append(r.decode([40, 41, 42], cache, trees))
            q_lens = outs[-1][2]
            cache = [c + q for c, q in zip(cache, q_lens)]
            outs.append(r.decode([43, 44, 45], cache, trees))  # a second pass reads the first one's K/V
    assert runners[1].batches and not runners[0].batches  # the padded runner did pad
    for i in range(2):
        (l0, h0, q0, d0), (l1, h1, q1, d1) = outs[i], outs[2 + i]
        assert q0 == q1 and l0.shape == l1.shape
        torch.testing.assert_close(l1, l0, atol=1e-5, rtol=0)
        torch.testing.assert_close(h1, h0, atol=1e-5, rtol=0)
        assert (d0 is None and d1 is None) or d0.tolist() == d1.tolist()
    lens = [len(p) + 2 * q for p, q in zip(PROMPTS, outs[0][2])]
    for a, b in zip(*(_real_kv(r, lens) for r in runners)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


def _engine(model, mode: str, pad: bool) -> Engine:
    spec = SpecConfig(mode=mode, min_match=1)
    return Engine(model, None, EngineConfig(kv_cache_gb=0.05, spec=spec, pad_to_buckets=pad))


@pytest.mark.parametrize("mode", ["off", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_engine_emits_the_same_tokens_with_buckets_on_and_off(tiny, mode, temperature):
    params = SamplingParams(n=3, max_tokens=40, temperature=temperature, seed=3, ignore_eos=True)
    ref = _engine(tiny, mode, False).generate(PROMPTS, params)
    eng = _engine(tiny, mode, True)
    out = eng.generate(PROMPTS, params)
    assert eng.runner.batches, "the engine must have run padded passes"
    for a, b in zip(ref, out):
        assert_same_or_tie(tiny, a, b, params, 1e-4)


def test_the_causal_prefill_equals_the_dense_mask_prefill(tiny, monkeypatch):
    """The causal kernel against SDPA over the gathered keys under the dense mask: the same bits in the KV cache. A
    dense pass of a few rows a sequence would take our paged kernel, another kernel (tests/model/test_paged_kernel.py)."""
    from tailrl.model import paged_attention

    monkeypatch.setattr(paged_attention, "MAX_Q", 0)
    lens, slots = [len(p) for p in PROMPTS], [2, 0, 5]  # packed, different lengths, slots out of order
    ids = torch.tensor([t for p in PROMPTS for t in p])
    causal = make_step([0, 0, 0], lens, slots)
    dense = make_step([0, 0, 0], lens, slots, causal=False)
    assert causal.causal and causal.mask is None and dense.mask is not None
    runners = [_runner(tiny, 32, pad=False, rows=0) for _ in range(2)]
    for r in runners:
        for s, n in zip(slots, lens):
            r.kv.ensure([s], n + 1)
    with torch.inference_mode():
        a, _ = tiny(ids, causal, runners[0].kv)
        b, _ = tiny(ids, dense, runners[1].kv)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for x, y in zip(*(_real_kv(r, lens, slots) for r in runners)):
        assert torch.equal(x, y)


# ---- CUDA only ------------------------------------------------------------------------------------------------


@cuda_only
@pytest.mark.parametrize("trees", [None, TREES], ids=["decode", "verify"])
def test_a_graph_replay_equals_the_eager_padded_pass(tiny, trees):
    model = tiny.to("cuda")
    try:
        runners = [ModelRunner(model, 2**26, 8, 512, True, cuda_graphs=g, graph_budget_bytes=2**30, pad=True)
                   for g in (False, True)]
        outs = []
        with torch.inference_mode():
            for r in runners:
                r.kv.ensure([0, 1, 2], 300)
                r.prefill(PROMPTS, [0, 1, 2])
                cache = [len(p) for p in PROMPTS]
                for roots in ([40, 41, 42], [43, 44, 45]):  # the second pass replays the captured graph
                    outs.append(r.decode(roots, cache, trees))
                    cache = [c + q for c, q in zip(cache, outs[-1][2])]
        assert len(runners[1].graphs.graphs) == 1 and runners[1].graphs.summary()["cuda_graph_mb"] >= 0
        for i in range(2):
            torch.testing.assert_close(outs[2 + i][0], outs[i][0], atol=1e-5, rtol=0)
            torch.testing.assert_close(outs[2 + i][1], outs[i][1], atol=1e-5, rtol=0)
        lens = [len(p) + 2 * q for p, q in zip(PROMPTS, outs[0][2])]
        for a, b in zip(*(_real_kv(r, lens) for r in runners)):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        assert runners[1].graphs.generation == runners[1].kv.generation
    finally:
        tiny.to("cpu")


@cuda_only
@pytest.mark.parametrize("mode", ["off", "ngram"])
def test_the_engine_emits_the_same_tokens_with_cuda_graphs_on_and_off(tiny, mode):
    params = SamplingParams(n=3, max_tokens=40, temperature=0.0, seed=3, ignore_eos=True)
    spec = SpecConfig(mode=mode, min_match=1)
    model = tiny.to("cuda")
    try:
        eager = Engine(model, None, EngineConfig(kv_cache_gb=0.05, spec=spec, cuda_graphs=False))
        ref = eager.generate(PROMPTS, params)
        eng = Engine(model, None, EngineConfig(kv_cache_gb=0.05, spec=spec))
        out = eng.generate(PROMPTS, params)
        assert eng.runner.graphs is not None and eng.runner.graphs.graphs
    finally:
        tiny.to("cpu")
    for a, b in zip(ref, out):
        assert_same_or_tie(tiny, a, b, params, 1e-4)


@cuda_only
def test_the_engine_runs_in_bf16_with_its_kv_cache_on_the_device(tiny):
    model = tiny.to(device="cuda", dtype=torch.bfloat16)
    try:
        eng = Engine(model, None, EngineConfig(kv_cache_gb=0.05))
        out = eng.generate(PROMPTS, SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=0, ignore_eos=True))
        assert all(len(c.token_ids) == 16 for c in out)
        assert eng.runner.kv.k[0].dtype == torch.bfloat16 and eng.runner.kv.k[0].is_cuda
    finally:
        tiny.to(device="cpu", dtype=torch.float32)
