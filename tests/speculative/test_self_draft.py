"""The self-speculative drafter (speculative/self_draft.py): the policy's own layers with weight-only quantized
products drafting chains in the target's KV. Lossless (greedy SD on = off; sampled on the batch-invariant engine, on
= off token for token; rejection sampling with its q follows the policy: chi-square), re-quantized at every weight
sync, priced per draft level by the selector."""

import pytest
import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model.quant import dequantize, quantize_int4, quantize_linear
from tailrl.rollout.weights import push_weights
from tailrl.speculative.config import SpecConfig
from tailrl.speculative.draft_cost import DraftCost
from tailrl.speculative.selector import Arm
from tailrl.speculative.speculator import Speculator
from tests.helpers import exact_joint, tiny_model
from tests.stats import chisquare_pvalue

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 10, 11, 12]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "llama", seed=0)


def run(model, mode, params, invariant=False, **spec):
    eng = Engine(model, None, EngineConfig(kv_cache_gb=0.05, seed=0, batch_invariant=invariant,
                                           spec=SpecConfig(mode=mode, **spec)))
    outs = eng.generate(PROMPTS, params)
    return eng, [o.token_ids for o in outs], outs


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_products_are_the_dequantized_weights(kind):
    """Each kernel computes x @ dequant(w).T, and dequant(w) is within the quantization step of w."""
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 128) * 0.05, torch.randn(96) * 0.1, torch.randn(3, 128)
    ql = quantize_linear(w, b, kind)
    assert ql.kind == kind
    dq = dequantize(ql, quantize_int4(w)[0] if kind == "int4" else None)
    step = (w.abs().amax(1, keepdim=True) / 127) if kind == "int8" else (w.view(96, 4, 32).amax(-1) -
                                                                         w.view(96, 4, 32).amin(-1)).repeat_interleave(32, 1) / 15
    slack = 1e-6 if kind == "int8" else 1e-3  # int4 keeps its scales and zeros in bf16
    assert bool(((dq - w).abs() <= 0.5 * step + slack).all())
    ref = x @ dq.t() + b
    tol = 2e-2 if kind == "int4" else 1e-4  # the int4 kernel takes bf16 inputs
    assert torch.allclose(ql(x), ref, atol=tol * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_self_drafts_equal_plain_decoding(tiny, temperature):
    """Greedy, and sampled with coupled draws (the verifier's own noise), SD with self drafts emits plain decoding's
    tokens, and its drafts are verified and accepted (not all of them: the quantized model is not the policy)."""
    params = SamplingParams(n=2, max_tokens=32, temperature=temperature, seed=3, ignore_eos=True)
    _, off, _ = run(tiny, "off", params)
    eng, on, outs = run(tiny, "self", params, self_quant="int4")
    assert on == off
    drafted, accepted = sum(o.stats["drafted"] for o in outs), sum(o.stats["accepted"] for o in outs)
    assert accepted > 0 and drafted > 0
    d = eng.speculator.drafters["self"]
    assert d.quantizations == 1 and {q.kind for q in d.q.values()} == {"int4"}
    met = outs.stats.metrics()  # its memory and re-quantization beside the engine's
    assert met["spec/self/quantized_mib"] * 2**20 == d.nbytes > 0 and met["spec/self/quantize_s"] > 0


def test_self_drafts_on_the_batch_invariant_engine_equal_plain_decoding(tiny):
    """bf16 on the batch-invariant engine, sampled (coupled) and greedy in one batch: the very same tokens."""
    model = tiny.to(torch.bfloat16)
    try:
        for t in (0.0, 0.9):
            params = SamplingParams(n=3, max_tokens=40, temperature=t, seed=11, ignore_eos=True)
            _, off, _ = run(model, "off", params, invariant=True)
            eng, on, outs = run(model, "self", params, invariant=True, self_quant="int8")
            assert eng.runner.invariant and on == off
            assert sum(o.stats["accepted"] for o in outs) > 0
    finally:
        tiny.to(torch.float32)


def test_a_draft_vocabulary_keeps_decoding_lossless(tiny):
    """self_vocab: the head's rows of the most frequent tokens seen (and the stop tokens); drafts come from them."""
    params = SamplingParams(n=2, max_tokens=24, temperature=0.0, seed=1, ignore_eos=True)
    _, off, _ = run(tiny, "off", params)
    eng, on, outs = run(tiny, "self", params, self_vocab=40)
    d = eng.speculator.drafters["self"]
    assert on == off and d.vocab is not None and len(d.vocab) <= 41 and 2 in d.vocab.tolist()
    assert d.counts.sum() > 0  # it counts what it sees: the next batch's vocabulary follows the text


def test_requantized_after_a_weight_sync(tmp_path_factory):
    """After the new policy's weights reach the engine (the in-process sync, rollout/weights.py push_weights), the
    next rollout drafts with them quantized: the drafter's tensors equal quantizing the new state dict here."""
    model = tiny_model(tmp_path_factory, "llama", seed=0)
    new = tiny_model(tmp_path_factory, "llama", seed=1)
    params = SamplingParams(n=1, max_tokens=8, temperature=0.0, ignore_eos=True)
    eng = Engine(model, None, EngineConfig(kv_cache_gb=0.05, spec=SpecConfig(mode="self", self_quant="int8")))
    eng.generate(PROMPTS, params)
    d = eng.speculator.drafters["self"]
    lin = model.model.layers[1].mlp.down_proj
    before = d.q[lin].weight.clone()
    push_weights(new, model)
    outs = eng.generate(PROMPTS, params)
    sd = new.state_dict()
    for i, layer in enumerate(model.model.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.down_proj"):
            mod = layer.get_submodule(name)
            want = quantize_linear(sd[f"model.layers.{i}.{name}.weight"], None, "int8")
            assert torch.equal(d.q[mod].weight, want.weight) and torch.equal(d.q[mod].scales, want.scales)
    assert not torch.equal(before, d.q[lin].weight) and d.quantizations == 2
    assert [o.token_ids for o in outs] == [o.token_ids for o in Engine(new, None, EngineConfig(
        kv_cache_gb=0.05)).generate(PROMPTS, params)]


def test_rejection_sampling_with_self_drafts_follows_the_policy(tiny_peaked):
    """coupled off: drafts drawn from the quantized model's q on their own noise, verified by rejection sampling,
    against the exact distribution of 3-token continuations (64 outcomes); chi-square at significance 0.001 (a
    correct sampler fails it one run in 1,000; the seeds are fixed, so it passes or fails the same every run). The
    draft vocabulary is cut to 2 of the 4 tokens, so q is far from p where it matters: many drafts are rejected and
    the residual max(p - q, 0) draws the token."""
    D, N = 3, 1200
    prompt = [1, 2, 3, 1]
    params = SamplingParams(temperature=0.9, max_tokens=D, n=N, seed=5, ignore_eos=True)
    joint = exact_joint(tiny_peaked, prompt, params, D)
    spec = SpecConfig(mode="self", budgets=(2,), coupled=False, self_quant="int4", self_vocab=1)
    eng = Engine(tiny_peaked, None, EngineConfig(kv_cache_gb=0.5, spec=spec))
    eng.speculator.drafters["self"].max_rows = 10**6  # quantized at the batch's 1,200 rows too
    outs = eng.generate([prompt], params)
    drafted = sum(o.stats["drafted"] for o in outs)
    accepted = sum(o.stats["accepted"] for o in outs)
    assert accepted > N // 4 and accepted < 0.9 * drafted, "the test needs both accepted and rejected drafts"
    counts: dict = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert chisquare_pvalue(counts, joint) > 1e-3, "rollouts with self drafts do not follow the policy"


def test_the_selector_prices_a_proposal_per_draft_level():
    """A leveled drafter's proposal costs levels x a level's seconds at the batch's bucket (the nearest measured one
    before), not B x seconds per sequence: 8 levels cost 8x one, and 16 sequences' level is their own."""
    cost = DraftCost(["self", "ngram"])
    cost.leveled = {"self"}
    assert cost.seconds(Arm("self", 8), 4) == 0.0  # never measured: tried
    cost.record(Arm("self", 2), 1, 0.06, levels=2)
    assert cost.seconds(Arm("self", 8), 1) == pytest.approx(8 * 0.03)
    assert cost.seconds(Arm("self", 2), 16) == pytest.approx(2 * 0.03)  # nearest bucket until measured
    cost.record(Arm("self", 2), 16, 0.2, levels=2)
    assert cost.seconds(Arm("self", 2), 16) == pytest.approx(0.2)
    cost.record(Arm("ngram", 4), 4, 0.004)
    assert cost.seconds(Arm("ngram", 4), 8) == pytest.approx(8 * 0.2 * 0.001)


def test_config_and_arms():
    with pytest.raises(ValueError, match="self_quant"):
        SpecConfig(self_quant="int3")
    with pytest.raises(ValueError, match="self_vocab"):
        SpecConfig(self_vocab=-1)
    assert "self" not in Speculator(SpecConfig(mode="auto")).drafters  # off by default in auto (RESULTS 26)
    sp = Speculator(SpecConfig(mode="auto", self_draft=True))
    assert {"self", "history+self"} <= set(sp.drafters) and sp.selector.draft.leveled == {"self", "history+self"}
    assert list(Speculator(SpecConfig(mode="self")).drafters) == ["self"]


@pytest.mark.slow
def test_self_drafts_on_smollm_equal_plain_decoding(smollm):
    """SmolLM2-135M, fp32: greedy SD with int8 and int4 self drafts equals plain decoding and accepts most drafts."""
    model, tok = smollm
    prompt = [{"role": "user", "content": "What is 17 * 23? Think step by step."}]
    params = SamplingParams(temperature=0, max_tokens=48)
    off = Engine(model, tok, EngineConfig(kv_cache_gb=0.5)).generate([prompt], params)[0].token_ids
    for kind in ("int8", "int4"):
        eng = Engine(model, tok, EngineConfig(kv_cache_gb=0.5, spec=SpecConfig(mode="self", self_quant=kind)))
        out = eng.generate([prompt], params)
        assert out[0].token_ids == off
        assert out[0].stats["accepted"] >= 0.6 * out[0].stats["drafted"] > 0
