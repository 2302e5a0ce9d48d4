"""Batch-invariant decoding (engine/invariant.py): in bf16, speculation changes not one sampled token."""

import copy
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from tailrl.config import ConfigError, load_config
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.engine.invariant import contiguous_prefix
from tailrl.engine.probe import resolve_invariant
from tailrl.model import load_model, make_step
from tailrl.model.chunked import CHUNK, QUERY_BLOCK, ROW_TILE
from tailrl.speculative.config import SpecConfig
from tailrl.speculative.selector import OFF
from tailrl.speculative.tree import DraftTree
from tailrl.speculative.verify import Verdict
from tests.helpers import CHATS, first_difference

MATH = [[{"role": "user", "content": f"What is {a} times {b}? Think step by step, then answer after ####."}]
        for a, b in [(12, 7), (33, 4), (9, 14), (25, 25)]]


@pytest.fixture(scope="module")
def smollm_bf16():
    return load_model("smollm2-135m", device="cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("allocate", [False, True])
def test_bf16_sampling_with_speculation_emits_the_very_same_tokens(smollm_bf16, allocate):
    """Exact equality of every sampled token, no near-tie allowance: without the invariant passes this fails
    (18 of 32 responses diverged when it was measured). The selector's arms are taken in turn (history at budgets
    2, 7 and 15, and plain decoding), and sequences without a match decode plainly beside drafted ones, so tokens
    meet passes of many shapes: plain and verify, batch 32 down to a lone sequence. With `allocate` the drafts are cut by their odds, which may change what is
    verified but never what is emitted. (Mode history, not auto: auto's choice of plain decoding follows measured
    timings, and in one full-suite run it chose plain for every step and the test exercised nothing; here the
    arms are taken in turn.)"""
    model, tok = smollm_bf16
    chats = CHATS + MATH
    params = SamplingParams(temperature=1.0, max_tokens=64, n=4, seed=5)
    plain = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, batch_invariant=True)).generate(chats, params)
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, batch_invariant=True,
                                          spec=SpecConfig(mode="history", min_match=1, epsilon=0.3, allocate=allocate)))
    if allocate:  # rows priced by the prior, not by measured seconds: a loaded machine must not make it verify nothing
        eng.speculator.selector.step_cost.coefficients = lambda B: None
    # the selector's own choice follows measured seconds: where bf16 is emulated (ONEDNN_MAX_CPU_ISA=AVX2) wide
    # passes cost so much that it chose plain decoding for every step. Its arms are taken in turn instead, plain
    # decoding among them, so every machine meets the same mix of plain and verify passes
    sel = eng.speculator.selector
    turn = itertools.cycle([a for a in sel.arms if a.drafter == "history" and a.budget in (2, 7, 15)] + [OFF])
    sel.choose = lambda B, contexts=None: next(turn)
    eng.generate(chats, params)  # the history of the second epoch
    outs = eng.generate(chats, params)
    assert sum(o.stats["accepted"] for o in outs) > 50, "speculation barely ran: the test exercised little"
    diffs = [(i, first_difference(a.token_ids, b.token_ids)) for i, (a, b) in enumerate(zip(plain, outs))]
    assert [d for d in diffs if d[1] is not None] == []


def test_chunked_attention_matches_dense_attention_in_fp32(tiny_ckpt):
    """The chunked pass (keys in CHUNK-position items at absolute offsets, merged by log-sum-exp) computes the same
    attention as the dense-mask pass, up to fp32 rounding: sequences whose keys span one to three chunks, plain rows
    and draft trees (one crossing a chunk boundary), and a prefill of several prompts in one pass."""
    from tailrl.engine.kv_cache import KVCache

    _, folder, _ = tiny_ckpt
    model, _ = load_model(folder, device="cpu")
    cache = [3, CHUNK - 2, CHUNK + 17, 2 * CHUNK + 5]
    q_lens = [1, 6, 3, 9]
    parents = torch.tensor([[0] + list(range(1, 9)), [0, 0, 1, 1, 2, 0, 6, 7, 8], [0, 0, 1] + list(range(3, 9)),
                            [0, 0, 1, 2, 3, 1, 5, 0, 7]])
    torch.manual_seed(0)
    V = model.config.vocab_size
    prompts = [torch.randint(0, V, (c,)) for c in cache]
    new = torch.randint(0, V, (sum(q_lens),))
    outs = []
    with torch.inference_mode():
        for invariant in (False, True):
            kv = KVCache(model.config, 64 << 20, "cpu", torch.float32)
            kv.layout(4, 3 * CHUNK)
            pre = model(torch.cat(prompts), make_step([0] * 4, cache, [0, 1, 2, 3], invariant=invariant), kv)[0]
            step = make_step(cache, q_lens, [0, 1, 2, 3], tree_parents=parents, invariant=invariant)
            assert (step.chunks is not None) == invariant and (step.mask is None) == invariant
            outs.append((pre, model(new, step, kv)[0]))
    for dense, chunked in zip(*outs):
        assert dense.shape == chunked.shape
        torch.testing.assert_close(chunked, dense, rtol=1e-4, atol=1e-4)


def test_chunk_plan_reads_only_the_chunks_each_sequence_reaches():
    """A pass's attention cost follows what the sequences hold: one sequence at 10 keys reads one chunk, one at
    CHUNK + 10 reads two, whatever the cache's capacity; a deep draft adds query blocks, not chunks, and its blocks
    share one kernel item per chunk."""
    step = make_step([10, CHUNK + 10], [1, 9], [0, 1], invariant=True,
                     tree_parents=torch.tensor([[0] * 9, [0] + list(range(8))]))
    plan = step.chunks
    assert sorted(zip(plan.pair_slot.tolist(), plan.pair_chunk.tolist())) == [(0, 0), (1, 0), (1, 1)]
    assert plan.grid.shape == (1 + 3, 2)  # seq 0: one query block; seq 1: 9 rows in 3 blocks of QUERY_BLOCK
    assert plan.token_rows.tolist() == [0] + [QUERY_BLOCK + i for i in range(9)]
    # seq 1's three blocks all reach both its chunks: one item of 3 blocks per chunk, in a call of its own size
    assert [(c.blocks, c.rows.shape[0]) for c in plan.calls] == [(1, 1), (3, 2)]
    n_items = sum(c.rows.shape[0] * c.blocks for c in plan.calls)
    assert plan.grid[0].tolist() == [plan.grid[0, 0].item(), n_items]  # seq 0 has no second chunk: the empty item
    assert step.row_tile == ROW_TILE and step.mask is None


def test_bf16_prefill_and_decode_give_a_token_the_same_bits(smollm_bf16):
    """The property a re-prefill (a preempted or migrated sequence) needs: a token's logits are the same bits from
    its prompt's prefill, from a decode step alone, and from a verify pass beside other sequences; and prompts
    prefilled together get the bits each gets alone. Keys span two chunks."""
    from tailrl.engine.kv_cache import KVCache

    model, _ = smollm_bf16
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (CHUNK + 40,))
    short = torch.randint(0, model.config.vocab_size, (30,))
    with torch.inference_mode():
        kv = KVCache(model.config, 256 << 20, "cpu", torch.bfloat16)
        kv.layout(2, 2 * CHUNK)
        alone = model(ids, make_step([0], [len(ids)], [0], invariant=True), kv)[0]
        together = model(torch.cat([short, ids]), make_step([0, 0], [30, len(ids)], [1, 0], invariant=True), kv)[0]
        P = len(ids) - 1
        decode = model(ids[P:], make_step([P], [1], [0], invariant=True), kv)[0]
        tree = torch.cat([ids[P:], short[:4], short[20:21]])
        verify = model(tree, make_step([P, 20], [1, 5], [0, 1], invariant=True,
                                       tree_parents=torch.tensor([[0] * 5, [0, 0, 1, 1, 0]])), kv)[0]
    assert torch.equal(together[30:], alone)
    assert torch.equal(decode, alone[-1:]) and torch.equal(verify[:1], alone[-1:])


def test_probe_holds_here_and_names_a_broken_construction(smollm_bf16, monkeypatch):
    """On this machine's kernels the invariant passes hold for SmolLM2 (else the engine says so: see the ISA tests).
    With the row tiles undone, `true` is an error that names the product that broke, where the CPU's kernels
    change with the row count, and `auto` falls back to the plain passes with a warning."""
    import tailrl.engine.probe as probe

    model, tok = smollm_bf16
    verdict = probe.probe_invariance(model)
    assert verdict.ok, verdict.summary()
    assert Engine(model, tok, EngineConfig(kv_cache_gb=0.2)).runner.invariant
    assert resolve_invariant("auto", model) == (True, verdict) and resolve_invariant(False, model) == (False, None)
    fp32 = copy.deepcopy(model).float()
    assert resolve_invariant("auto", fp32) == (False, None)  # fp32 rounds apart only at near-ties: no probe
    broken = probe.ProbeResult(False, ["linear 576->49152 (lm_head): a row's product differs among other rows"])
    monkeypatch.setattr(probe, "probe_invariance", lambda m: broken)
    with pytest.raises(RuntimeError, match=r"batch_invariant=true.*576->49152 \(lm_head\)"):
        Engine(model, tok, EngineConfig(kv_cache_gb=0.2, batch_invariant=True))
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=0.2))
    assert not eng.runner.invariant and eng.invariance is broken


def test_probe_finds_a_prompt_that_prefills_differently_beside_another(smollm_bf16, monkeypatch):
    """What broke on an Intel CPU with AMX at 2 threads (benchmarks/RESULTS.md, session 19), simulated: matrix products
    of 320 rows or more round their rows otherwise, which no linear-row check sees (they stop at 272 rows) and no
    decode step meets. Only a prompt prefilled beside another prompt (336 rows) against alone (304) shows it, and
    the probe must name that."""
    import tailrl.engine.probe as probe

    model, _ = smollm_bf16
    linear = torch.nn.functional.linear

    def large_passes_round_otherwise(x, weight, bias=None):
        y = linear(x, weight, bias)
        return y * (1 + 2**-6) if x.dim() == 2 and x.shape[0] >= 320 else y

    monkeypatch.setattr(torch.nn.functional, "linear", large_passes_round_otherwise)
    monkeypatch.setattr(probe, "_CACHE", {})
    monkeypatch.setattr(probe, "_call_rows", lambda m: {})  # no call sizes: one call a product, as before them
    verdict = probe.probe_invariance(model)
    assert verdict.failed == ["end to end: a prompt prefilled beside another prompt differs from it prefilled alone"]


def test_probe_sizes_each_products_calls_to_the_kernels(smollm_bf16, monkeypatch):
    """What the AMX kernels did (benchmarks/RESULTS.md, session 20), simulated: a product of 1,536 inner columns
    rounds every tile otherwise in calls of 160 rows or more. The probe finds the largest call whose tiles hold for
    that shape (144 rows) and leaves the others at the most it checks; the passes then split that product into calls
    of 144 rows, and a prompt prefilled beside another gives the bits it gets alone (the probe holds end to end)."""
    import tailrl.engine.probe as probe

    model, _ = smollm_bf16
    linear = torch.nn.functional.linear

    def wide_products_round_otherwise(x, weight, bias=None):
        y = linear(x, weight, bias)
        return y * (1 + 2**-6) if x.dim() == 2 and x.shape[0] >= 160 and x.shape[1] == 1536 else y

    monkeypatch.setattr(torch.nn.functional, "linear", wide_products_round_otherwise)
    monkeypatch.setattr(probe, "_CACHE", {})
    try:
        verdict = probe.probe_invariance(model)
        assert verdict.ok, verdict.summary()
        assert verdict.call_rows[(576, 1536)] == 144
        assert verdict.call_rows[(1536, 576)] == probe.CALL_MAX and verdict.call_rows[(49152, 576)] == 64
        assert model.model.layers[3].mlp.down_proj.call_rows == 144
    finally:
        monkeypatch.undo()
        probe.probe_invariance(model).apply(model)  # this machine's own call sizes back on the shared model


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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", "tests.invariance_run", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("isa", ISAS + ["AVX512_CORE_AMX"])
def test_engine_is_invariant_or_says_why_under_each_cpu_isa(isa):
    """oneDNN picks other bf16 kernels under each ISA cap (AMX, AVX512-BF16, plain AVX-512, AVX2): in a process of
    its own under each, either the probe holds and SD off and history drafting emit the very same tokens, or the
    probe names what broke and `batch_invariant=true` refuses to start with that name."""
    if isa == "AVX512_CORE_AMX" and "amx_bf16" not in _cpu_flags():
        pytest.skip("this CPU has no AMX (no amx_bf16 in /proc/cpuinfo): the AMX kernels cannot run here")
    out = _run_isa(isa, "--generate")
    if out["ok"]:
        assert out["accepted"] > 100, f"speculation barely ran under {isa or 'the default ISA'}: {out}"
        assert out["identical"], f"the probe held under {isa or 'the default ISA'} but {out['differ']} responses differ"
    else:
        assert out["failed"] and "error" in out and out["failed"][0] in out["error"], out


def test_probe_finds_row_count_kernels_when_the_tiles_are_undone():
    """Without row tiles (tiles of one row), the LM head's product picks another kernel from 4 rows under plain
    AVX-512 (oneDNN, measured 2026-11): the probe must see it, and either name it or keep that product's calls below
    4 rows. On a CPU without AVX-512 that cap is AVX2's kernels, which do not differ: nothing to find there."""
    if "avx512f" not in _cpu_flags():
        pytest.skip("no AVX-512 on this CPU: ONEDNN_MAX_CPU_ISA=AVX512_CORE cannot select the kernel that differs")
    out = _run_isa("AVX512_CORE", "--break-tiles")
    head = out["call_rows"]["49152x576"]
    assert (not out["ok"] and any("linear" in f for f in out["failed"])) or (out["ok"] and head < 4), out


def test_invariant_decode_matches_the_plain_pass_in_fp32(smollm):
    """The row tiles and the chunked attention change nothing but rounding."""
    model, tok = smollm
    params = SamplingParams(temperature=0, max_tokens=24)
    a = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, batch_invariant=False)).generate(CHATS[:3], params)
    b = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, batch_invariant=True)).generate(CHATS[:3], params)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4


def test_batch_invariant_setting():
    with pytest.raises(ValueError, match="batch_invariant='sometimes'"):
        EngineConfig(batch_invariant="sometimes")
    with pytest.raises(ConfigError, match="rollout.batch_invariant"):
        load_config(None, ["rollout.batch_invariant=sometimes"])
    assert load_config(None, ["rollout.batch_invariant=false"]).rollout.batch_invariant is False


def test_preorder_puts_the_first_child_path_first_and_keeps_the_tree():
    q = {-1: torch.tensor([0.5, 0.5]), 1: torch.tensor([0.2, 0.8])}
    t = DraftTree([10, 20, 11, 21, 12], [-1, -1, 0, 1, 2], q)  # breadth-first: 10 -> 11 -> 12 and 20 -> 21
    p = t.preorder()
    assert p.tokens == [10, 11, 12, 20, 21] and p.parents == [-1, 0, 1, -1, 3]
    assert p.top_path() == t.top_path() == [10, 11, 12]
    assert torch.equal(p.q[-1], q[-1]) and torch.equal(p.q[3], q[1]) and set(p.q) == {-1, 3}  # node 20 is now 3
    assert p.preorder() is p


def test_contiguous_prefix_cuts_the_path_at_a_branch():
    v = Verdict([0, 1, 4, 5], [7, 8, 9, 10, 11], [-0.1, -0.2, -0.3, -0.4, -0.5])
    cut = contiguous_prefix(v)  # node 4 is off the first-child path: its token stays, drawn from node 1's row
    assert (cut.accepted_nodes, cut.tokens, cut.logprobs) == ([0, 1], [7, 8, 9], [-0.1, -0.2, -0.3])
    assert contiguous_prefix(Verdict([0, 1], [7, 8, 9], [0.0] * 3)).tokens == [7, 8, 9]
    assert contiguous_prefix(Verdict([2], [7, 8], [0.0] * 2)).tokens == [7]


def test_bf16_responses_do_not_depend_on_the_other_prompts(smollm_bf16):
    """Prefill and decode passes are invariant: a prompt's samples are the same whether it
    shares the engine with other prompts (another worker's share, another step's batch) or runs alone."""
    model, tok = smollm_bf16
    params = SamplingParams(temperature=1.0, max_tokens=40, n=3, seed=9)
    together = Engine(model, tok, EngineConfig(kv_cache_gb=1.0)).generate(MATH + CHATS[:2], params)
    alone = Engine(model, tok, EngineConfig(kv_cache_gb=1.0)).generate(MATH[1:2], params)
    assert [c.token_ids for c in together[3:6]] == [c.token_ids for c in alone]


def test_bf16_training_steps_are_identical_with_and_without_speculation(tmp_path):
    """The trainer's engine is invariant by default in bf16 on this CPU: two steps of the default task (SmolLM2,
    bf16 engine, fp32 master) give the same rollouts, rewards and gradients with history drafts as with SD off. With
    rollout.batch_invariant=false the response lengths differed at this size when it was written."""
    from tailrl.rl.trainer import Trainer

    rows = {}
    for mode in ("off", "history"):  # history, not auto: auto's choice follows measured timings and may decode plainly
        cfg = load_config(None, [f"rollout.spec.mode={mode}", "trainer.prompts_per_step=4", "rollout.n=8",
                                 "rollout.max_tokens=48", "trainer.eval_every=0", "model.dtype=bfloat16",
                                 f"trainer.out_dir={tmp_path / mode}", "rollout.spec.epsilon=0.3"])
        trainer = Trainer(cfg)
        try:
            assert trainer.engine.runner.invariant
            rows[mode] = [trainer.train_step() for _ in range(2)]
        finally:
            trainer.close()
    assert sum(r["spec/accept_length"] for r in rows["history"]) > 2.0, "speculation never accepted a token"
    for a, b in zip(rows["off"], rows["history"]):
        assert a["response_lengths"] == b["response_lengths"] and a["reward/mean"] == b["reward/mean"]
        assert a["actor/grad_norm"] == b["actor/grad_norm"] and a["actor/pg_loss"] == b["actor/pg_loss"]


def _drafted_trees(model, tok, invariant: bool, monkeypatch) -> list[DraftTree]:
    from tailrl.speculative.speculator import Speculator

    seen, plan = [], Speculator.plan

    def spy(self, running, *rest):
        arm, trees = plan(self, running, *rest)
        seen.extend(t for t in trees or () if t)
        return arm, trees

    monkeypatch.setattr(Speculator, "plan", spy)
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, batch_invariant=invariant,
                                          # the drafters' shapes, before the allocator cuts unlikely branches
                                          spec=SpecConfig(mode="history", budgets=(8,), min_match=1, allocate=False)))
    params = SamplingParams(temperature=1.0, max_tokens=24, n=4, seed=3)
    eng.generate(MATH[:2], params)  # the history the second epoch drafts from
    seen.clear()
    eng.generate(MATH[:2], params)
    assert all(d.chains is invariant for d in eng.speculator.drafters.values())
    return seen


def test_an_invariant_verifier_gets_single_path_drafts(smollm, monkeypatch):
    """A batch-invariant pass keeps an accepted path only up to its first side-branch node, so side branches
    would cost rows for nothing: the drafters draft chains there, and best-first trees elsewhere."""
    model, tok = smollm
    branched = lambda trees: sum(any(len(t.children(i)) > 1 for i in range(-1, len(t))) for t in trees)
    trees = _drafted_trees(model, tok, False, monkeypatch)
    assert len(trees) > 20 and branched(trees) > 0  # history trees do branch on this data
    trees = _drafted_trees(model, tok, True, monkeypatch)
    assert len(trees) > 20 and branched(trees) == 0
    assert all(t.parents == list(range(-1, len(t) - 1)) for t in trees)


def test_sd_on_and_off_draw_the_same_distribution_without_invariance(tiny_peaked):
    """Where the probe fails, SD on and off draw from the same distribution, not the same tokens: checked here with
    the invariant passes off, in bf16, by two-sample chi-square tests (significance 0.001, fixed seeds, disjoint
    between the arms) on the first three tokens and on the response lengths of 3000 samples per arm."""
    from scipy.stats import chi2_contingency

    model = copy.deepcopy(tiny_peaked).to(torch.bfloat16)
    prompt, N = [1, 3, 0, 1], 3000
    params = SamplingParams(temperature=1.0, max_tokens=8, n=N, seed=0)
    off = Engine(model, None, EngineConfig(kv_cache_gb=0.5, batch_invariant=False)).generate([prompt], params)
    eng = Engine(model, None, EngineConfig(kv_cache_gb=0.5, batch_invariant=False,
                                           spec=SpecConfig(mode="history", budgets=(2, 3), min_match=1)))
    eng.generate([prompt], SamplingParams(temperature=1.0, max_tokens=8, n=N, seed=10**6))  # history to draft from
    on = eng.generate([prompt], SamplingParams(temperature=1.0, max_tokens=8, n=N, seed=2 * 10**6))
    assert sum(o.stats["accepted"] for o in on) > N // 5, "too few accepted drafts to test anything"
    lengths = {len(o.token_ids) for o in off}
    assert len(lengths) > 3, "responses of too few lengths to compare their distribution"
    for name, key in (("first three tokens", lambda o: tuple(o.token_ids[:3])), ("lengths", lambda o: len(o.token_ids))):
        cells = sorted({key(o) for o in off} | {key(o) for o in on})
        table = [[sum(key(o) == c for o in arm) for c in cells] for arm in (off, on)]
        table = [[a, b] for a, b in zip(*table) if a + b >= 10]  # sparse cells pooled out
        assert chi2_contingency(table).pvalue > 1e-3, f"SD on and off differ in {name}"
