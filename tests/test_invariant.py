"""Batch-invariant decoding (engine/invariant.py): in bf16, speculation changes not one sampled token."""

import pytest
import torch

from tailrl.config import ConfigError, load_config
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.engine.invariant import contiguous_prefix, resolve_invariant
from tailrl.model import load_model, make_step
from tailrl.model.step import plan_split
from tailrl.spec.config import SpecConfig
from tailrl.spec.tree import DraftTree
from tailrl.spec.verify import Verdict
from tests.helpers import CHATS, first_difference

MATH = [[{"role": "user", "content": f"What is {a} times {b}? Think step by step, then answer after ####."}]
        for a, b in [(12, 7), (33, 4), (9, 14), (25, 25)]]


@pytest.fixture(scope="module")
def smollm_bf16():
    return load_model("smollm2-135m", device="cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("allocate", [False, True])
def test_bf16_sampling_with_speculation_emits_the_very_same_tokens(smollm_bf16, allocate):
    """Exact equality of every sampled token, no near-tie allowance: without the invariant passes this fails
    (18 of 32 responses diverged when it was measured). Epsilon 0.3 makes the selector mix budgets, and sequences
    without a match decode plainly beside drafted ones, so tokens meet passes of many shapes: plain and verify,
    batch 32 down to a lone sequence. With `allocate` the drafts are cut by their odds, which may change what is
    verified but never what is emitted. (Mode history, not auto: auto's choice of plain decoding follows measured
    timings, and in one full-suite run it chose plain for every step and the test exercised nothing.)"""
    model, tok = smollm_bf16
    chats = CHATS + MATH
    params = SamplingParams(temperature=1.0, max_tokens=64, n=4, seed=5)
    plain = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, batch_invariant=True)).generate(chats, params)
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, batch_invariant=True,
                                          spec=SpecConfig(mode="history", min_match=1, epsilon=0.3, allocate=allocate)))
    eng.generate(chats, params)  # the history of the second epoch
    outs = eng.generate(chats, params)
    assert sum(o.stats["accepted"] for o in outs) > 50, "speculation barely ran: the test exercised little"
    diffs = [(i, first_difference(a.token_ids, b.token_ids)) for i, (a, b) in enumerate(zip(plain, outs))]
    assert [d for d in diffs if d[1] is not None] == []


def test_invariant_steps_pad_queries_and_fix_the_key_length():
    step = make_step([5, 3], [1, 2], [0, 1], min_q=4, num_keys=16)
    assert step.max_q == 4 and step.max_k == 16 and step.mask.shape == (2, 1, 4, 16)
    assert step.pad_idx.tolist() == [0, 4, 5]  # the real rows in the padded [seqs x 4] layout
    assert step.mask[0, 0, 0].tolist() == [True] * 6 + [False] * 10  # 5 cached + itself; the rest is never read
    assert step.mask[1, 0, 1, :5].tolist() == [True] * 5  # 3 cached, the root, itself
    assert step.mask[0, 0, 1].any()  # a padded row sees a key (finite softmax); its output is dropped
    with pytest.raises(ValueError, match="num_keys=5 is less than the 6"):
        make_step([5, 3], [1, 2], [0, 1], min_q=4, num_keys=5)


def test_split_attention_plans_the_cheaper_calls():
    assert plan_split([5] * 60 + [17] * 4, min_q=4) == (5, list(range(60, 64)))  # 60 x 5 + 4 x 17 + 16 < 64 x 17
    assert plan_split([1, 2, 17], min_q=4) == (4, [2])  # 3 x 4 + 17 + 16 < 3 x 17
    assert plan_split([1, 17], min_q=4) is None  # 2 x 17 rows cost less than two calls
    assert plan_split([4] * 8, min_q=4) is None  # nothing to split


def test_split_attention_gives_the_very_same_bits(smollm_bf16):
    """A verify pass whose sequences add 1 to 17 rows, once with the attention split by query rows (most at 4, the
    deep drafts apart) and once padded to 17 for all: every logit the same, bit for bit, in bf16."""
    from tailrl.engine.kv_cache import KVCache

    model, _ = smollm_bf16
    q_lens = [1] * 20 + [3] * 10 + [17, 9]
    B, cache = len(q_lens), [12 + b for b in range(len(q_lens))]
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (max(cache),))
    new = torch.randint(0, model.config.vocab_size, (sum(q_lens),))
    outs = []
    with torch.inference_mode():
        for split in (False, True):
            kv = KVCache(model.config, 64 << 20, "cpu", torch.bfloat16)
            kv.layout(B, 64)
            kv.ensure(B, 64)
            model(torch.cat([prompt[:c] for c in cache]), make_step([0] * B, cache, list(range(B))), kv)
            step = make_step(cache, q_lens, list(range(B)), min_q=4, num_keys=64, split=split)
            assert (step.split is not None) == split
            outs.append(model(new, step, kv)[0])
    assert torch.equal(outs[0], outs[1])


def test_invariant_decode_matches_the_plain_pass_in_fp32(smollm):
    """The padded rows, the fixed key length and a lone sequence's second row change nothing but rounding."""
    model, tok = smollm
    params = SamplingParams(temperature=0, max_tokens=24)
    a = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, batch_invariant=False)).generate(CHATS[:3], params)
    b = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, batch_invariant=True)).generate(CHATS[:3], params)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4


def test_batch_invariant_setting():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_invariant("auto", cpu, torch.bfloat16) and not resolve_invariant("auto", cpu, torch.float32)
    assert not resolve_invariant("auto", cuda, torch.bfloat16) and resolve_invariant(True, cuda, torch.float32)
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
    """Prefill runs each prompt alone and decode passes are invariant: a prompt's samples are the same whether it
    shares the engine with other prompts (another worker's share, another step's batch) or runs alone."""
    model, tok = smollm_bf16
    params = SamplingParams(temperature=1.0, max_tokens=40, n=3, seed=9)
    together = Engine(model, tok, EngineConfig(kv_cache_gb=1.0)).generate(MATH + CHATS[:2], params)
    alone = Engine(model, tok, EngineConfig(kv_cache_gb=1.0)).generate(MATH[1:2], params)
    assert [c.token_ids for c in together[3:6]] == [c.token_ids for c in alone]


def test_bf16_training_steps_are_identical_with_and_without_speculation(tmp_path):
    """The trainer's engine is invariant by default in bf16 on this CPU: two steps of the default task (SmolLM2,
    bf16 engine, fp32 master) give the same rollouts, rewards and gradients with SD auto as with SD off. With
    rollout.batch_invariant=false the response lengths differed at this size when it was written."""
    from tailrl.rl.trainer import Trainer

    rows = {}
    for mode in ("off", "auto"):
        cfg = load_config(None, [f"rollout.spec.mode={mode}", "trainer.prompts_per_step=4", "rollout.n=8",
                                 "rollout.max_tokens=48", "trainer.eval_every=0", "model.dtype=bfloat16",
                                 f"trainer.out_dir={tmp_path / mode}", "rollout.spec.epsilon=0.3"])
        trainer = Trainer(cfg)
        try:
            assert trainer.engine.runner.invariant
            rows[mode] = [trainer.train_step() for _ in range(2)]
        finally:
            trainer.close()
    assert sum(r["spec/accept_length"] for r in rows["auto"]) > 2.0, "speculation never accepted a token"
    for a, b in zip(rows["off"], rows["auto"]):
        assert a["response_lengths"] == b["response_lengths"] and a["reward/mean"] == b["reward/mean"]
        assert a["actor/grad_norm"] == b["actor/grad_norm"] and a["actor/pg_loss"] == b["actor/pg_loss"]


def _drafted_trees(model, tok, invariant: bool, monkeypatch) -> list[DraftTree]:
    from tailrl.spec.speculator import Speculator

    seen, plan = [], Speculator.plan

    def spy(self, running):
        arm, trees = plan(self, running)
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
