"""Our decode attention kernel (model/paged_attention.py, csrc/paged_attention.c): it reads the paged KV cache in
place and equals attention over the gathered keys within a floating-point bound; a row's bits do not depend on the
rest of the pass; the engine decodes the same logits with it as without it (within the bound); and where it cannot be
built the engine runs without it."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import paged_attention as pa
from tailrl.speculative.config import SpecConfig
from tests.helpers import tiny_model

needs_kernel = pytest.mark.skipif(not pa.available(), reason=f"the kernel is not built here: {pa._WHY}")

BLOCK = 16


def _case(seed, B=5, Q=1, H=6, KVH=2, D=32, max_len=150, dtype=torch.float32):
    """Random pools whose blocks are shuffled over the rows, random lengths, a causal mask over each row's new
    tokens (as a decode or verify pass sees them)."""
    g = torch.Generator().manual_seed(seed)
    width = -(-max_len // BLOCK)
    nblk = B * width + 3
    k_pool = torch.randn(KVH, nblk, BLOCK, D, generator=g).to(dtype)
    v_pool = torch.randn(KVH, nblk, BLOCK, D, generator=g).to(dtype)
    table = (torch.randperm(nblk - 1, generator=g)[: B * width] + 1).view(B, width)
    slots = torch.randperm(B, generator=g)
    lens = torch.randint(Q, max_len + 1, (B,), generator=g)
    K = int(lens.max())
    j = torch.arange(K).view(1, 1, K)
    start = (lens - Q).view(B, 1, 1)
    mask = (j < start) | ((j >= start) & (j <= start + torch.arange(Q).view(1, Q, 1)))
    q = torch.randn(B, Q, H, D, generator=g).to(dtype)
    return q, k_pool, v_pool, table, slots, mask


def _reference(q, k_pool, v_pool, table, slots, mask):
    """float64 attention over each sequence's gathered keys: [B, Q, H, D]."""
    B, Q, H, D = q.shape
    KVH, K = k_pool.shape[0], mask.shape[2]
    idx = table[slots].reshape(-1)
    keys, vals = (p.double().index_select(1, idx).view(KVH, B, -1, D)[:, :, :K].transpose(0, 1) for p in (k_pool, v_pool))
    keys, vals = (t.repeat_interleave(H // KVH, dim=1) for t in (keys, vals))
    s = q.double().transpose(1, 2) @ keys.transpose(-1, -2) / math.sqrt(D)
    s = s.masked_fill(~mask.unsqueeze(1), float("-inf"))
    return (s.softmax(-1) @ vals).transpose(1, 2)


def _bound(q, k_pool, v_pool, mask):
    """A forward error bound for fp32 attention: scores carry at most D * u * sum|q_d k_d| / sqrt(D) of error each
    (a dot product of D terms), which moves each softmax weight by at most twice that relatively; normalising over K
    keys and the weighted sum add K + D roundings more; the output errs by at most (2 * D * S + 2 * K + 16) * u *
    max|v|, S the largest sum|q_d k_d| / sqrt(D). u = 2^-24."""
    D, K = q.shape[-1], mask.shape[2]
    S = (q.double().abs().amax() * k_pool.double().abs().amax() * D / math.sqrt(D)).item()
    return (2 * D * S + 2 * K + 16) * 2.0**-24 * v_pool.double().abs().amax().item()


@needs_kernel
@pytest.mark.parametrize("Q", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_kernel_equals_attention_over_the_gathered_keys_within_an_fp32_bound(seed, Q):
    case = _case(seed, Q=Q)
    out, ref = pa.paged_attention(*case), _reference(*case)
    err = (out.double() - ref).abs().max().item()
    assert err <= _bound(case[0], case[1], case[2], case[5]), err


@needs_kernel
def test_bf16_is_computed_in_fp32_and_rounded_once():
    case = _case(3, dtype=torch.bfloat16)
    out, ref = pa.paged_attention(*case), _reference(*case)
    assert out.dtype == torch.bfloat16
    # the fp32 bound plus the final rounding to bf16 (half an ulp: at most 2^-8 of the value, 8 significant bits)
    bound = _bound(case[0], case[1], case[2], case[5])
    tol = bound + 2.0**-8 * (ref.abs() + bound)
    assert ((out.double() - ref).abs() <= tol).all()


@needs_kernel
def test_a_rows_bits_do_not_depend_on_the_rest_of_the_pass():
    q, k_pool, v_pool, table, slots, mask = _case(4, B=6, Q=3)
    full = pa.paged_attention(q, k_pool, v_pool, table, slots, mask)
    for b in (0, 3, 5):
        n = int(mask[b].sum(-1).max())  # alone: only as many keys as this sequence's rows see
        alone = pa.paged_attention(q[b : b + 1], k_pool, v_pool, table, slots[b : b + 1], mask[b : b + 1, :, :n])
        assert torch.equal(alone, full[b : b + 1])
        one_row = pa.paged_attention(q[b : b + 1, 1:2], k_pool, v_pool, table, slots[b : b + 1], mask[b : b + 1, 1:2])
        assert torch.equal(one_row[0, 0], full[b, 1])
    spare = table.shape[1] * BLOCK - mask.shape[2]  # padded to as many keys as the table holds
    wider = torch.cat([mask, torch.zeros(*mask.shape[:2], spare, dtype=torch.bool)], -1)
    assert torch.equal(pa.paged_attention(q, k_pool, v_pool, table, slots, wider), full)


@needs_kernel
def test_a_hidden_key_changes_nothing_and_a_seen_one_does():
    q, k_pool, v_pool, table, slots, mask = _case(5, B=2)
    out = pa.paged_attention(q, k_pool, v_pool, table, slots, mask)
    hidden = int(mask[0, 0].sum())  # the first key row 0 does not see; change its block's values
    blk, pos = table[slots[0], hidden // BLOCK], hidden % BLOCK
    v2 = v_pool.clone()
    v2[:, blk, pos] += 100
    assert torch.equal(pa.paged_attention(q, k_pool, v2, table, slots, mask)[0], out[0])
    v2 = v_pool.clone()
    v2[:, table[slots[0], 0], 0] += 100  # key 0, which it sees
    assert not torch.equal(pa.paged_attention(q, k_pool, v2, table, slots, mask)[0], out[0])


def _prefill_case(seed, dtype=torch.float32):
    """Three sequences continuing their cached keys by 1, 37 and 20 new rows (a decode row and two prefills longer
    than the kernel's 16-token items), padded to 37 rows: q [3, 37, H, D], lens [3, 2], and the causal mask over
    keys that says the same."""
    q, k_pool, v_pool, table, slots, _ = _case(seed, B=3, Q=37, max_len=150, dtype=dtype)
    lens = torch.tensor([[120, 1], [40, 37], [0, 20]])
    K = int(lens.sum(1).max())
    i, j = torch.arange(37).view(1, 37, 1), torch.arange(K).view(1, 1, K)
    mask = (j <= lens[:, :1].view(3, 1, 1) + i) & (i < lens[:, 1].view(3, 1, 1))
    return q, k_pool, v_pool, table, slots, mask, lens


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_rows_from_lens_are_attention_over_their_keys_and_padding_is_zero(dtype):
    """The invariant passes' route (model/step.py): rows causal from each sequence's cache_len, no mask; within the fp32
    bound of the float64 reference (plus bf16's final rounding), the very bits of the same rows under the dense causal
    mask, and zeros where a row pads its sequence."""
    q, k_pool, v_pool, table, slots, mask, lens = _prefill_case(7, dtype)
    out = pa.paged_attention(q, k_pool, v_pool, table, slots, None, lens)
    real = mask.any(-1)
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))
    ref = _reference(q, k_pool, v_pool, table, slots, mask | ~real.unsqueeze(-1))  # padding rows: any finite row
    bound = _bound(q, k_pool, v_pool, mask)
    tol = bound + (2.0**-8 * (ref.abs() + bound) if dtype == torch.bfloat16 else 0)
    assert ((out.double() - ref).abs() <= tol)[real].all()
    dense = pa.paged_attention(q, k_pool, v_pool, table, slots, mask, lens)
    assert torch.equal(dense, out)


@needs_kernel
def test_a_row_has_the_same_bits_decoded_alone_in_a_prefill_and_under_a_tree_mask():
    """What the batch-invariant passes rest on: the last row of a 37-row prefill (in the kernel's third item of query
    tokens), decoded alone at its position, and as the root of a verify pass beside other sequences, in bf16."""
    q, k_pool, v_pool, table, slots, mask, lens = _prefill_case(8, torch.bfloat16)
    full = pa.paged_attention(q, k_pool, v_pool, table, slots, None, lens)
    b, i = 1, 36
    at = int(lens[b, 0]) + i
    alone = pa.paged_attention(q[b : b + 1, i : i + 1], k_pool, v_pool, table, slots[b : b + 1], None,
                               torch.tensor([[at, 1]]))
    assert torch.equal(alone[0, 0], full[b, i])
    tree = torch.zeros(2, 4, at + 4, dtype=torch.bool)
    tree[0, :, :at] = True
    tree[0, :, at : at + 4] = torch.ones(4, 4, dtype=torch.bool).tril()
    tree[1, :2, :31] = True
    rows = torch.stack([torch.cat([q[b, i : i + 1], q[0, :3]]), q[2, :4]])
    verify = pa.paged_attention(rows, k_pool, v_pool, table, torch.stack([slots[b], slots[2]]), tree,
                                torch.tensor([[at, 4], [29, 2]]))
    assert torch.equal(verify[0, 0], full[b, i])
    assert torch.equal(verify[1, 2:], torch.zeros_like(verify[1, 2:]))  # rows past q_len pad the sequence


@needs_kernel
def test_the_invariant_passes_run_it_and_the_probe_names_a_build_whose_rows_depend_on_the_pass(tmp_path_factory,
                                                                                             monkeypatch):
    """On a CPU the batch-invariant passes' attention is this kernel read in place (make_step builds no chunk plan,
    causal rows come as lens); a row's independence of the pass is by construction, and a build that broke it (here:
    a sequence's rows scaled by 1 + 2^-6 in passes of more than one 16-token item) must fail the start-up probe,
    named, on a bf16 model."""
    import tailrl.engine.probe as probe
    from tailrl.model import make_step

    step = make_step([10, 300], [1, 40], [0, 1], invariant=True)
    assert step.in_place and step.chunks is None and step.mask is None and step.lens.tolist() == [[10, 1], [300, 40]]
    model = tiny_model(tmp_path_factory, "llama", seed=4).to(torch.bfloat16)
    monkeypatch.setattr(probe, "_CACHE", {})
    assert "attention rows" not in probe.probe_invariance(model).summary()
    real = pa.paged_attention

    def broken(q, *args, **kw):
        o = real(q, *args, **kw)
        return o * (1 + 2**-6) if q.shape[1] > pa.ITEM_TOKENS else o

    monkeypatch.setattr(pa, "paged_attention", broken)
    monkeypatch.setattr(probe, "_CACHE", {})
    verdict = probe.probe_invariance(model)
    assert not verdict.ok and "attention rows (our kernel, in place): a row decoded alone differs as a causal " \
        "prefill's row beside another sequence" in verdict.summary(), verdict.summary()


@needs_kernel
def test_the_engine_decodes_the_same_with_and_without_the_kernel(tmp_path_factory, monkeypatch):
    """Greedy decoding of a tiny model: the same tokens, and logprobs within the fp32 noise of a 2-layer model
    (1e-4 nats: two attention outputs' errors, each under the bound above, through the logits)."""
    model = tiny_model(tmp_path_factory, "llama", seed=3)
    prompts = [list(range(3, 3 + n)) for n in (9, 30, 17, 44)]
    params = SamplingParams(temperature=0.0, max_tokens=24)

    def run():
        eng = Engine(model, None, EngineConfig(kv_cache_gb=0.05, spec=SpecConfig(mode="off"), seed=0))
        return eng.generate(prompts, params)

    with_kernel = run()
    monkeypatch.setattr(pa, "_LIB", [None])
    without = run()
    for a, b in zip(with_kernel, without):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_without_a_compiler_the_engine_gathers_and_says_why_at_info(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(pa, "_LIB", [])
    monkeypatch.setattr(pa, "_WHY", [])
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TAILRL_KERNEL_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger=pa.__name__):
        assert not pa.available()
    assert "paged decode attention kernel off" in caplog.text and "no-such-cc" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    q, k_pool, v_pool, table, slots, mask = _case(6)
    assert not pa.supports(q, k_pool)
