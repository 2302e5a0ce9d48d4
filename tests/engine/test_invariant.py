"""Batch-invariant decoding (engine/invariant.py): in bf16, speculation changes not one sampled token."""

import copy
import itertools

import pytest
import torch

from tailrl.config import ConfigError, load_config
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.engine.invariant import contiguous_prefix
from tailrl.engine.probe import probe_invariance, resolve_invariant
from tailrl.model import load_model, make_step
from tailrl.model.chunked import CHUNK, QUERY_BLOCK, ROW_TILE
from tailrl.speculative.config import SpecConfig
from tailrl.speculative.selector import OFF
from tailrl.speculative.tree import DraftTree
from tailrl.speculative.verify import Verdict
from tests.helpers import CHATS, assert_falls_back, first_difference

pytestmark = pytest.mark.slow  # the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray

MATH = [[{"role": "user", "content": f"What is {a} times {b}? Think step by step, then answer after ####."}]
        for a, b in [(12, 7), (33, 4), (9, 14), (25, 25)]]


@pytest.fixture(scope="module")
def smollm_bf16():
    return load_model("smollm2-135m", device="cpu", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def smol_kernels(request):
    """SmolLM2 in bf16 where the CPU multiplies bf16 in hardware; elsewhere (emulated bf16: its probe took 22 s on a
    Zen 3) 2 layers of its widths, heads and vocabulary, no tokenizer (tests/engine/invariance_run.py): its every kernel."""
    from tailrl.model.load import cpu_has_bf16
    from tests.engine.invariance_run import smol_shaped

    return request.getfixturevalue("smollm_bf16") if cpu_has_bf16() else (smol_shaped(), None)


@pytest.mark.parametrize("allocate", [False, True])
def test_bf16_sampling_with_speculation_emits_the_very_same_tokens(request, tiny_chat, allocate):
    """Exact equality of every sampled token, no near-tie allowance: without the invariant passes this fails
    (18 of 32 responses diverged when it was measured). The selector's arms are taken in turn (history at budgets
    2, 7 and 15, and plain decoding), and sequences without a match decode plainly beside drafted ones, so tokens
    meet passes of many shapes: plain and verify, batch 32 down to a lone sequence. With `allocate` the drafts are cut by their odds, which may change what is
    verified but never what is emitted. (Mode history, not auto: auto's choice of plain decoding follows measured
    timings, and in one full-suite run it chose plain for every step and the test exercised nothing; here the
    arms are taken in turn.) On a CPU without bf16 matrix hardware (AVX2 only: oneDNN's reference path) the tiny chat
    model runs instead of SmolLM2, whose rollouts took 4 minutes a case there."""
    from tailrl.model.load import cpu_has_bf16

    model, tok = (request.getfixturevalue("smollm_bf16") if cpu_has_bf16()
                  else load_model(tiny_chat, device="cpu", dtype=torch.bfloat16))
    verdict = probe_invariance(model)
    if not verdict.ok:  # this CPU's kernels break the passes: the engine must say so (the distribution test covers SD)
        return assert_falls_back(model, tok, verdict)
    chats = CHATS + MATH
    params = SamplingParams(temperature=1.0, max_tokens=64, n=4, seed=5)
    plain = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, batch_invariant=True)).generate(chats, params)
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, batch_invariant=True,
                                          spec=SpecConfig(mode="history", min_match=1, epsilon=0.3, allocate=allocate)))
    if allocate:  # rows priced by the prior, not by measured seconds: a loaded machine must not make it verify nothing
        eng.speculator._seconds_of_rows = lambda: None
    # the selector's own choice follows measured seconds: where bf16 is emulated (ONEDNN_MAX_CPU_ISA=AVX2) wide
    # passes cost so much that it chose plain decoding for every step. Its arms are taken in turn instead, plain
    # decoding among them, so every machine meets the same mix of plain and verify passes
    sel = eng.speculator.selector
    turn = itertools.cycle([a for a in sel.arms if a.drafter == "history" and a.budget in (2, 7, 15)] + [OFF])
    sel.choose = lambda B, contexts=None, *_, **__: next(turn)
    eng.generate(chats, params)  # the history of the second epoch
    outs = eng.generate(chats, params)
    assert sum(o.stats["accepted"] for o in outs) > 50, "speculation barely ran: the test exercised little"
    diffs = [(i, first_difference(a.token_ids, b.token_ids)) for i, (a, b) in enumerate(zip(plain, outs))]
    assert [d for d in diffs if d[1] is not None] == []


def test_chunked_attention_matches_dense_attention(tiny_ckpt, chunked_route):
    """The chunked pass (keys in CHUNK-position items at absolute offsets, merged by log-sum-exp) computes the same
    attention as the dense-mask pass, up to fp32 rounding: sequences whose keys span one to three chunks, plain rows
    and draft trees (one crossing a chunk boundary), and a prefill of several prompts in one pass. In float64, so the
    bound comes from what runs in fp32 in the passes (the chunks' merge and RMSNorm): 32 eps of fp32 at the logits'
    scale, where a wrong mask or chunk would be off by the logits' own scale."""
    from tailrl.engine.kv_cache import KVCache

    _, folder, _ = tiny_ckpt
    model = load_model(folder, device="cpu")[0].double()
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
            kv = KVCache(model.config, 64 << 20, "cpu", torch.float64)
            kv.layout(4, 3 * CHUNK)
            pre = model(torch.cat(prompts), make_step([0] * 4, cache, [0, 1, 2, 3], invariant=invariant), kv)[0]
            step = make_step(cache, q_lens, [0, 1, 2, 3], tree_parents=parents, invariant=invariant)
            assert (step.chunks is not None) == invariant and (step.mask is None) == invariant
            outs.append((pre, model(new, step, kv)[0]))
    for dense, chunked in zip(*outs):
        assert dense.shape == chunked.shape
        bound = 32 * torch.finfo(torch.float32).eps * float(dense.abs().max())
        torch.testing.assert_close(chunked, dense, rtol=0, atol=bound)


def test_chunk_plan_reads_only_the_chunks_each_sequence_reaches(chunked_route):
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


def test_bf16_prefill_and_decode_give_a_token_the_same_bits(smol_kernels):
    """The property a re-prefill (a preempted or migrated sequence) needs: a token's logits are the same bits from
    its prompt's prefill, from a decode step alone, and from a verify pass beside other sequences; and prompts
    prefilled together get the bits each gets alone. Keys span two chunks. Where it does not hold, the probe must
    have said so (and the engine falls back): no machine passes with the property broken and unreported."""
    from tailrl.engine.kv_cache import KVCache

    model, tok = smol_kernels
    verdict = probe_invariance(model)  # first, as the engine runs it at start-up before any pass
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
    same = torch.equal(together[30:], alone) and torch.equal(decode, alone[-1:]) and torch.equal(verify[:1], alone[-1:])
    assert same or not verdict.ok, "the passes differ and the probe did not see it"
    if not verdict.ok:
        assert_falls_back(model, tok, verdict)


def test_the_probes_verdict_decides_the_passes_and_names_a_broken_construction(smol_kernels, monkeypatch):
    """`auto` runs the invariant passes where this machine's kernels hold them for SmolLM2's shapes, and falls back
    with the property named where they do not. With a verdict that names a broken product, `true` is an error that
    names it and `auto` falls back to the plain passes."""
    import tailrl.engine.probe as probe

    model, tok = smol_kernels
    verdict = probe.probe_invariance(model)
    assert Engine(model, tok, EngineConfig(kv_cache_gb=0.2)).runner.invariant == verdict.ok
    assert resolve_invariant("auto", model) == (verdict.ok, verdict) and resolve_invariant(False, model) == (False, None)
    if not verdict.ok:
        assert_falls_back(model, tok, verdict)
    fp32 = copy.deepcopy(model).float()
    assert resolve_invariant("auto", fp32) == (False, None)  # fp32 rounds apart only at near-ties: no probe
    broken = probe.ProbeResult(False, ["linear 576->49152 (lm_head): a row's product differs among other rows"])
    monkeypatch.setattr(probe, "probe_invariance", lambda m: broken)
    with pytest.raises(RuntimeError, match=r"batch_invariant=true.*576->49152 \(lm_head\)"):
        Engine(model, tok, EngineConfig(kv_cache_gb=0.2, batch_invariant=True))
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=0.2))
    assert not eng.runner.invariant and eng.invariance is broken


def test_probe_finds_what_only_a_whole_pass_meets(smol_kernels, chunked_route, monkeypatch):
    """A kernel whose items round otherwise in calls of more than 12 items: no item check meets it (their calls hold
    9), but a prefill does (its prompt's 17 items share a call) and its last token decoded alone (2 items) does not,
    so only the probe's end-to-end check sees it, and it must name it. Where this CPU's own kernels already fail the
    probe, the verdict must fail all the same."""
    import tailrl.engine.probe as probe
    import tailrl.model.chunked as chunked

    model, _ = smol_kernels
    real = probe.probe_invariance(model)
    kernel = chunked.kernel

    def many_items_round_otherwise(q, keys, vals, mask, bias=None):
        o, lse = kernel(q, keys, vals, mask, bias)
        return (o * (1 + 2**-6) if q.shape[0] > 12 else o), lse

    monkeypatch.setattr(chunked, "kernel", many_items_round_otherwise)
    monkeypatch.setattr(probe, "kernel", many_items_round_otherwise)
    monkeypatch.setattr(probe, "_CACHE", {})
    verdict = probe.probe_invariance(model)
    assert not verdict.ok
    if real.ok:
        assert verdict.failed == ["end to end: a token decoded alone differs from the same token in its prompt's prefill"]


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


def test_bf16_responses_do_not_depend_on_the_other_prompts(request, tiny_chat):
    """Prefill and decode passes are invariant: a prompt's samples are the same whether it
    shares the engine with other prompts (another worker's share, another step's batch) or runs alone.
    Without bf16 hardware (AVX2) the tiny chat model runs, 40 tokens a response (SmolLM2 took 65 s there, and its
    plain passes gave these very responses too on a Zen 3, 2026-11-26): a sequence reading another's keys shows."""
    from tailrl.model.load import cpu_has_bf16

    hardware = cpu_has_bf16()
    model, tok = (request.getfixturevalue("smollm_bf16") if hardware
                  else load_model(tiny_chat, device="cpu", dtype=torch.bfloat16))
    verdict = probe_invariance(model)
    if not verdict.ok:
        return assert_falls_back(model, tok, verdict)
    params = SamplingParams(temperature=1.0, max_tokens=40, n=3, seed=9, ignore_eos=not hardware)
    together = Engine(model, tok, EngineConfig(kv_cache_gb=1.0)).generate(MATH + CHATS[:2], params)
    alone = Engine(model, tok, EngineConfig(kv_cache_gb=1.0)).generate(MATH[1:2], params)
    assert [c.token_ids for c in together[3:6]] == [c.token_ids for c in alone]


def test_bf16_training_steps_are_identical_with_and_without_speculation(tmp_path, tiny_chat, task_file):
    """The trainer's engine is invariant by default in bf16 where the probe holds: two steps of the default task
    (SmolLM2, bf16 engine, fp32 master) give the same rollouts, rewards and gradients with history drafts as with SD
    off, and report rollout/batch_invariant = 1. With rollout.batch_invariant=false the response lengths differed at
    this size when it was written. Where the probe fails, a step reports rollout/batch_invariant = 0. On a CPU
    without bf16 matrix hardware (AVX2 only: bf16 products run oneDNN's reference path, under 0.5 GFLOP/s) the same
    steps run the tiny chat model: SmolLM2's would take about an hour there."""
    from tailrl.model.load import cpu_has_bf16
    from tailrl.rl.trainer import Trainer

    model = [] if cpu_has_bf16() else [f"model.path={tiny_chat}", f"data.train_file={task_file}", "data.num_eval=4",
                                       "reward.functions=[tailrl.rl.smoke:count_a]", "reward.weights=[1.0]"]
    rows = {}
    for mode in ("off", "history"):  # history, not auto: auto's choice follows measured timings and may decode plainly
        cfg = load_config(None, [f"rollout.spec.mode={mode}", "trainer.prompts_per_step=4", "rollout.n=8",
                                 "rollout.max_tokens=48", "trainer.eval_every=0", "model.dtype=bfloat16",
                                 f"trainer.out_dir={tmp_path / mode}", "rollout.spec.epsilon=0.3", *model])
        trainer = Trainer(cfg)
        try:
            verdict = probe_invariance(trainer.engine.model)
            assert trainer.engine.runner.invariant == verdict.ok
            rows[mode] = [trainer.train_step() for _ in range(1 if not verdict.ok else 2)]
        finally:
            trainer.close()
        if not verdict.ok:  # the fallback, reported: the rollouts are then the same distribution, not the same tokens
            assert rows[mode][0]["rollout/batch_invariant"] == 0.0
            return
    assert all(r["rollout/batch_invariant"] == 1.0 for r in rows["off"] + rows["history"])
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
