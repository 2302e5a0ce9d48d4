"""Other CPUs' kernels: each oneDNN ISA cap in a process of its own, and the kernels of an Intel CPU with AMX
simulated on any CPU (issue 45): what they do differently, where the invariant passes meet it, and that the
start-up probe sees it.

Two things change on AMX, and both only the order of a sum, so a row's bf16 bits move rarely on random data:
- PyTorch's CPU flash attention packs K and V and computes with oneDNN brgemm when the query rows of a call reach 64
  (its `need_pack` rule, simulated here line for line); the passes keep every kernel item below that
  (model/chunked.py `kernel_split`), for any number of query heads a K/V head;
- oneDNN picks other product kernels by a call's row count; the probe sizes each product's calls on cancelling data
  (engine/probe_data.py), where another order of summation shows in most outputs instead of in almost none."""

import json
import os
import subprocess
import sys

import pytest
import torch

import tailrl.engine.probe as probe
import tailrl.model.chunked as chunked
import tailrl.model.packed as packed
from tailrl.engine.kv_cache import KVCache
from tailrl.model import make_step
from tailrl.model.chunked import CHUNK, QUERY_BLOCK
from tailrl.model.config import ModelConfig
from tailrl.model.llama import CausalLM
from tailrl.engine.probe_data import cancelling_product

REAL_KERNEL = chunked.kernel


def need_pack(q: torch.Tensor, k: torch.Tensor, threads: int) -> bool:
    """PyTorch's choice of the packed (brgemm) path of its CPU flash kernel for a bf16 call on a CPU where
    `cpublas::could_pack(kBFloat16)` holds (oneDNN's ISA reaches AMX): aten/src/ATen/native/cpu/
    FlashAttentionKernel.cpp at pytorch 27a4844d7fb, `flash_attention_kernel_impl` (lines 1161-1182: the query split
    is 256 rows from 768 query rows, 64 from 192, else 32; `could_pack` at 1165-1166) and `cpu_flash_attention`
    (lines 421-425: qSplitSize = min(split, qSize), qSlice; lines 431-446: need_pack for BFloat16 when
    kvSize >= 64 and qSize >= 64 and gemm_size_per_thread / pack_size >= 4, non-causal)."""
    B, heads, q_size, D = q.shape
    kv_heads, kv_size = k.shape[1], k.shape[2]
    split = 256 if q_size >= 768 else 64 if q_size >= 192 else 32
    q_split = min(split, q_size)
    q_slice = -(-q_size // q_split)
    if not (kv_size >= 64 and q_size >= 64):
        return False
    pack_size = B * kv_heads * kv_size * D
    qs_per_thread = (B * heads * q_slice + threads - 1) // threads  # int64 division in the C++
    return qs_per_thread * q_split * kv_size * D / pack_size >= 4


def packed_kernel(hits: list):
    """chunked.kernel as on AMX: where `need_pack` holds, the same attention with its sums in another order (scores
    and values in blocks of 64 keys, last block first, as a packed brgemm might), else the real kernel."""

    def kernel(q, keys, vals, mask, bias=None):
        if not need_pack(q, keys, torch.get_num_threads()):
            return REAL_KERNEL(q, keys, vals, mask, bias)
        hits.append(tuple(q.shape))
        if bias is None:
            bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        rep = q.shape[1] // keys.shape[1]
        k, v = (t.repeat_interleave(rep, 1).float() for t in (keys, vals))
        s = q.float() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias.float()
        top = s.amax(-1, keepdim=True)
        p = torch.exp(s - top)
        blocks = range(k.shape[2] - 64, -1, -64)
        total = sum(p[..., b : b + 64].sum(-1) for b in blocks)
        o = sum(p[..., b : b + 64].to(q.dtype).float() @ v[..., b : b + 64, :] for b in blocks)
        return (o / total.unsqueeze(-1)).to(q.dtype), top.squeeze(-1) + torch.log(total)

    return kernel


def random_model(heads: int, kv_heads: int, vocab: int = 512, dtype=torch.bfloat16) -> CausalLM:
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64, eos_token_id=[2])
    torch.manual_seed(0)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.05)
    return model.eval().to(dtype)


def prefill_and_decode(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prompt of CHUNK + 40 tokens prefilled alone and beside a 30-token prompt, and its last token decoded: the
    last token's logits from each."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (CHUNK + 40,), generator=g)
    short = torch.randint(0, model.config.vocab_size, (30,), generator=g)
    P = len(ids)
    with torch.inference_mode():
        kv = KVCache(model.config, 64 << 20, "cpu", model.dtype)
        kv.layout(2, 2 * CHUNK)
        alone = model(ids, make_step([0], [P], [0], invariant=True), kv)[0][-1:]
        together = model(torch.cat([short, ids]), make_step([0, 0], [30, P], [1, 0], invariant=True), kv)[0][-1:]
        decode = model(ids[-1:], make_step([P - 1], [1], [0], invariant=True), kv)[0]
    return alone, together, decode


@pytest.fixture
def amx_attention(chunked_route, monkeypatch):
    hits = []
    fake = packed_kernel(hits)
    monkeypatch.setattr(chunked, "kernel", fake)
    monkeypatch.setattr(probe, "kernel", fake)
    monkeypatch.setattr(probe, "_CACHE", {})
    return hits


def test_the_simulated_rule_packs_where_pytorch_does():
    """The rule as the kernel applies it to our calls: a one-block item of 12 rows never packs, an item of 64 rows
    does at any thread count we run, and the batch count moves the ratio only through the per-thread rounding."""
    q = lambda n, rows, heads=3: torch.zeros(n, heads, rows, 64)
    k = torch.zeros(1, 3, CHUNK, 64)
    assert not need_pack(q(16, 60), k.expand(16, -1, -1, -1), 2) and not need_pack(q(1, 12), k, 1)
    assert all(need_pack(q(n, 64), k.expand(n, -1, -1, -1), t) for n in (1, 16, 17) for t in (1, 2, 16))
    assert not need_pack(q(1, 64), torch.zeros(1, 3, 32, 64), 1)  # fewer than 64 keys


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (14, 2), (16, 1)])
def test_folded_items_stay_out_of_the_packed_path(amx_attention, heads, kv_heads):
    """Groups of 4, 7 and 16 query heads a K/V head (Llama-3.2, Qwen2.5-0.5B, a wide MQA): with the packed path
    simulated, no kernel call of the invariant passes or of the probe takes it, the probe holds where this CPU's own
    kernels do, and a prompt prefilled alone, beside another prompt and its last token decoded give the same bits."""
    model = random_model(heads, kv_heads)
    group = heads // kv_heads
    sub, fold = chunked.kernel_split(group)
    assert sub * QUERY_BLOCK * fold < chunked.PACK_ROWS and group % sub == 0
    alone, together, decode = prefill_and_decode(model)
    verdict = probe.probe_invariance(model)
    assert amx_attention == [], "an item reached the packed path"
    with pytest.MonkeyPatch.context() as m:  # the same model and data on this CPU's real kernel: the simulation added nothing
        m.setattr(chunked, "kernel", REAL_KERNEL)
        assert all(torch.equal(a, b) for a, b in zip(prefill_and_decode(model), (alone, together, decode)))
    if verdict.ok:
        assert torch.equal(together, alone) and torch.equal(decode, alone)


def test_the_old_folding_reaches_the_packed_path_and_the_probe_names_it(amx_attention, monkeypatch):
    """Folded items of up to 5 blocks whatever the group (a1b8f59): with 4 query heads a K/V head an item of 4 blocks
    has 64 rows and packs, so a block computes otherwise in it than alone, and the probe names that."""
    model = random_model(8, 2)
    capped = probe.probe_invariance(model)  # this CPU's kernels with the items capped: no call packs
    monkeypatch.setattr(chunked, "PACK_ROWS", 10**6)
    monkeypatch.setattr(probe, "_CACHE", {})
    verdict = probe.probe_invariance(model)
    assert amx_attention, "the old folding should have met the packed path"
    assert not verdict.ok
    if capped.ok:  # else this CPU's own kernels fail first, and the verdict names that
        assert "a block's rows differ in an item of 4 blocks" in verdict.summary(), verdict.summary()


def test_chunked_attention_with_split_head_groups_matches_dense_attention(chunked_route):
    """16 query heads on one K/V head: the kernel items take 8 heads each (kernel_split), and the invariant pass
    computes the dense pass's attention. In float64, so the bound comes from what runs in fp32 in both passes (the
    chunks' merge, model/chunked.py, and RMSNorm): a few fp32 roundings of eps/2 each, allowed as 32 eps of fp32 at
    the logits' scale; a wrong head mapping would be off by the logits' own scale."""
    model = random_model(16, 1, dtype=torch.float64)
    assert chunked.kernel_split(16) == (8, 1)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (CHUNK + 9,), generator=g)
    outs = []
    with torch.inference_mode():
        for invariant in (False, True):
            kv = KVCache(model.config, 64 << 20, "cpu", torch.float64)
            kv.layout(1, 2 * CHUNK)
            pre = model(ids[:-5], make_step([0], [len(ids) - 5], [0], invariant=invariant), kv)[0]
            step = make_step([len(ids) - 5], [5], [0], invariant=invariant)
            outs.append((pre, model(ids[-5:], step, kv)[0]))
    for dense, chunk in zip(*outs):
        bound = 32 * torch.finfo(torch.float32).eps * float(dense.abs().max())
        torch.testing.assert_close(chunk, dense, rtol=0, atol=bound)



def other_order(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x @ weight.T in fp32 with the inner columns summed in blocks of 32, last block first: another kernel's order."""
    K = x.shape[-1]
    y = sum(x[..., i : i + 32].float() @ weight[:, i : i + 32].float().T for i in reversed(range(0, K, 32)))
    return (y if bias is None else y + bias.float()).to(x.dtype)


def test_probe_sizes_product_calls_on_cancelling_data(monkeypatch):
    """What oneDNN did on AMX, simulated: products of 1,536 inner columns run another kernel from 160 rows a call, one
    that differs only in its order of summation. On random data a 16-row tile rounds the same in all but a few
    outputs (the probe's old witness held by chance on an Emerald Rapids: issue 45), on the probe's cancelling data
    in most. The probe sizes that product's calls to 144 rows (where this CPU's own kernels allow it) and the
    passes then give a prompt the same bits alone, beside another prompt and decoded."""
    model = random_model(9, 3, vocab=2048).to(torch.float32)
    with torch.no_grad():  # SmolLM2's widths (hidden 576, MLP 1,536), 2 layers
        cfg = model.config
        cfg.hidden_size, cfg.intermediate_size = 576, 1536
        model = CausalLM(cfg)
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.05)
        model = model.eval().to(torch.bfloat16)
    w = model.model.layers[0].mlp.down_proj.weight.detach()
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(16, 1536, generator=g).to(torch.bfloat16)
    cancel, wc = cancelling_product(w, 16, g)
    linear = torch.nn.functional.linear
    hidden = (other_order(rand, w) != linear(rand, w)).float().mean().item()
    shown = (other_order(cancel, wc) != linear(cancel, wc)).float().mean().item()
    assert hidden < 0.02 and shown > 0.3, (hidden, shown)
    monkeypatch.setattr(probe, "pack_weight", lambda w: None)  # products through F.linear, as where oneDNN cannot pack
    monkeypatch.setattr(packed, "pack_weight", lambda w: None)
    monkeypatch.setattr(probe, "_CACHE", {})
    real = probe.probe_invariance(model)
    monkeypatch.setattr(probe, "_CACHE", {})

    def amx_linear(x, weight, bias=None):
        if x.dim() == 2 and x.shape[0] >= 160 and x.shape[1] == 1536:
            return other_order(x, weight, bias)
        return linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", amx_linear)
    verdict = probe.probe_invariance(model)
    want = {**real.call_rows, (576, 1536): min(144, real.call_rows[(576, 1536)])}
    assert verdict.call_rows == want and model.model.layers[1].mlp.down_proj.call_rows == want[(576, 1536)]
    assert verdict.ok == real.ok, verdict.summary()
    if verdict.ok:
        alone, together, decode = prefill_and_decode(model)
        assert torch.equal(together, alone) and torch.equal(decode, alone)


ISAS = ["", "AVX512_CORE", "AVX512_CORE_BF16", "AVX2"]


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return set()


def _run_isa(isa: str, *args: str) -> dict:
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa, "TAILRL_TEST_THREADS": str(torch.get_num_threads())}
    if not isa:
        env.pop("ONEDNN_MAX_CPU_ISA")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-m", "tests.engine.invariance_run", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def top_isa(flags: set) -> str | None:
    """The ISA cap that is this CPU's own top level for oneDNN (the cap then changes nothing: the default run's
    kernels), or None where /proc/cpuinfo shows a level above the caps tested (AVX2-VNNI, AVX512-VNNI, AVX512-FP16,
    AMX-FP16: oneDNN's default then differs from every cap) or nothing known. oneDNN's order: AVX2 < AVX2_VNNI <
    AVX512_CORE < AVX512_CORE_VNNI < AVX512_CORE_BF16 < AVX512_CORE_FP16 < AVX512_CORE_AMX < AVX512_CORE_AMX_FP16."""
    if "amx_bf16" in flags:
        return None if "amx_fp16" in flags else "AVX512_CORE_AMX"
    if "avx512_fp16" in flags:
        return None
    if "avx512_bf16" in flags:
        return "AVX512_CORE_BF16"
    if "avx512f" in flags:
        core = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags and "avx512_vnni" not in flags
        return "AVX512_CORE" if core else None
    return "AVX2" if "avx2" in flags and "avx_vnni" not in flags else None


def test_top_isa_names_the_cap_that_changes_nothing():
    """/proc/cpuinfo flags of a Zen 3, a Zen 4, a Sapphire Rapids, an Alder Lake and a Cascade Lake."""
    zen3 = {"avx2", "fma", "avx"}
    zen4 = zen3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}
    spr = zen4 | {"avx512_fp16", "amx_bf16", "amx_tile", "amx_int8"}
    assert [top_isa(f) for f in (zen3, zen4, spr)] == ["AVX2", "AVX512_CORE_BF16", "AVX512_CORE_AMX"]
    assert top_isa(zen3 | {"avx_vnni"}) is None and top_isa(zen4 - {"avx512_bf16"}) is None
    assert top_isa(spr | {"amx_fp16"}) is None and top_isa(set()) is None


_RUNS: dict = {}  # the subprocess's output per distinct kernel set: a cap at the CPU's top ISA shares the default's


@pytest.mark.slow  # a bf16 engine in a process of its own per ISA cap
@pytest.mark.parametrize("isa", ISAS + ["AVX512_CORE_AMX"])
def test_engine_is_invariant_or_says_why_under_each_cpu_isa(isa):
    """oneDNN picks other bf16 kernels under each ISA cap (AMX, AVX512-BF16, plain AVX-512, AVX2): in a process of
    its own under each, either the probe holds and SD off and history drafting emit the very same tokens, or the
    probe names what broke and `batch_invariant=true` refuses to start with that name. A cap at this CPU's top ISA
    (AVX2 on an AVX2-only CPU, AVX512_CORE_BF16 on a Zen 4, AMX on a Sapphire Rapids) selects the default run's
    kernels: that case and the default one assert on one process's output (a minute a run on a 2-core Zen 3)."""
    needs = {"AVX512_CORE_AMX": "amx_bf16", "AVX512_CORE_BF16": "avx512_bf16", "AVX512_CORE": "avx512f"}.get(isa)
    flags = _cpu_flags()
    if needs and needs not in flags:  # a cap above the CPU's ISA leaves oneDNN the default run's kernels
        pytest.skip(f"this CPU has no {needs} (/proc/cpuinfo): under {isa} oneDNN runs the default ISA's kernels, "
                    "which the default case checks")
    kernels = "" if isa == top_isa(flags) else isa
    if kernels not in _RUNS:
        _RUNS[kernels] = _run_isa(isa, "--generate")
    out = _RUNS[kernels]
    if out["ok"]:
        assert out["accepted"] > 100, f"speculation barely ran under {isa or 'the default ISA'}: {out}"
        assert out["identical"], f"the probe held under {isa or 'the default ISA'} but {out['differ']} responses differ"
    else:
        assert out["failed"] and "error" in out and out["failed"][0] in out["error"], out


@pytest.mark.slow  # 5.4 s: the fast tier stays under 3 minutes; scripts/amx_check.sh runs it
def test_probe_finds_row_count_kernels_when_the_tiles_are_undone():
    """Without row tiles (tiles of one row), the LM head's product picks another kernel from 4 rows under plain
    AVX-512 (oneDNN, measured 2026-11): the probe must see it, and either name it or keep that product's calls below
    4 rows. On a CPU without AVX-512 that cap is AVX2's kernels, which do not differ: nothing to find there."""
    if "avx512f" not in _cpu_flags():
        pytest.skip("no AVX-512 on this CPU: ONEDNN_MAX_CPU_ISA=AVX512_CORE cannot select the kernel that differs")
    out = _run_isa("AVX512_CORE", "--break-tiles")
    head = out["call_rows"]["49152x576"]
    assert (not out["ok"] and any("linear" in f for f in out["failed"])) or (out["ok"] and head < 4), out
