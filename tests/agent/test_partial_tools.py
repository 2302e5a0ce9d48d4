"""Partial rollouts with tools (rollout/tool_partial.py): a trajectory carried over a step boundary mid-turn or at a
tool call resumes, on the batch-invariant engine, to the very trajectory an uninterrupted run draws (tokens,
logprobs, mask, tool calls and results: all a reward reads); each token keeps the policy version that drew it; a
tools run stopped after step 2 and resumed equals the run that never stopped."""

import dataclasses
import json
import time

import pytest
import torch

from tailrl.config import ConfigError, load_config
from tailrl.agent.toolbox import load_tools
from tailrl.config.agent import AgentConfig
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.engine.requests import SeqState
from tailrl.rl.checkpoint.state_io import read_state, write_state
from tailrl.rl.run import train
from tailrl.rollout.base import requests_of
from tailrl.rollout.partial import Horizon, PartialBuffer, staleness, version_runs
from tailrl.rollout.tool_partial import TrajState, carried
from tailrl.rollout.turns import TurnLoop
from tailrl.speculative.config import SpecConfig

MSGS = [[{"role": "user", "content": f"{a} + {b} ?"}] for a, b in ((1, 2), (3, 4), (5, 6))]


def _setup(model_tok, spec: str = "off", tools: dict | None = None):
    model, tok = model_tok
    loop = TurnLoop(AgentConfig(tools=["calculator"], max_turns=3), tok, tools)
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=0.2, batch_invariant=True, seed=0,
                                          spec=SpecConfig(mode=spec, min_match=1)))
    return loop, eng, [loop.encode_prompt(m) for m in MSGS]


def _params():
    return [SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=11 + i) for i in range(len(MSGS))]


def _straight(model_tok):
    loop, eng, prompts = _setup(model_tok)
    try:
        out = loop.run(eng, requests_of(prompts, _params(), MSGS))
        return out.completions, list(loop.last)
    finally:
        loop.close()


def _same(a, b) -> bool:
    """Two trajectories alike in everything the update and a reward read (a tool's seconds aside)."""
    calls = [[{k: v for k, v in x.items() if k != "seconds"} for x in c.trajectory["tool_calls"]] for c in (a, b)]
    return ((a.token_ids, a.logprobs, a.response_mask, a.finish_reason, a.text, a.trajectory["conversation"])
            == (b.token_ids, b.logprobs, b.response_mask, b.finish_reason, b.text, b.trajectory["conversation"])
            and calls[0] == calls[1])


def _reward(c) -> float:
    """A reward of the kind a tool run's gets: the answer line, the calls that went through, the turns taken."""
    calls = c.trajectory["tool_calls"]
    return c.text.count("####") + sum(x["status"] == "ok" for x in calls) + len(c.trajectory["conversation"]) / 10


def test_a_trajectory_stopped_at_any_of_its_tokens_resumes_to_the_uninterrupted_one(tool_chat):
    """Every multi-turn trajectory of a straight run, cut after each of its drawn tokens (mid-turn, or at a call with
    its observation) and resumed in one batch, ends as the straight run's trajectory: the turn cut mid-way draws on
    from its next position with its own seed, and later calls run again to the same results."""
    comps, trajs = _straight(tool_chat)
    multi = [k for k, tr in enumerate(trajs) if len(tr.turns) > 1]
    assert multi, "no trajectory of the straight run called a tool"
    states, want = [], []
    for k in multi:
        tr = trajs[k]
        origin = SeqState(tr.prompt_index, tr.sample_index, tr.prompt_ids, [], [],
                          dataclasses.replace(_params()[tr.prompt_index], n=1), tr.seed, 40, [])
        whole = carried(origin, tr)
        assert whole.output_ids == comps[k].token_ids and whole.drawn == sum(comps[k].response_mask)
        for n in range(tr.drawn):
            states.append(whole.cut(n))
            want.append(comps[k])
    at_call = [st for st in states if st.trajectory["turns"] and st.trajectory["start"] == len(st.output_ids)]
    mid_turn = [st for st in states if st.trajectory["turns"] and st.trajectory["start"] < len(st.output_ids)]
    assert at_call and mid_turn  # carried across a tool call, and in the middle of a later turn
    for st in at_call:  # the call's observation came with it: the state ends on mask-0 tokens
        assert st.trajectory["mask"][-1] == 0 and st.trajectory["turns"][-1]["results"]
    loop, eng, _ = _setup(tool_chat, "ngram")
    try:
        out = loop.run(eng, [], states=states, messages=[MSGS[st.prompt_index] for st in states])
    finally:
        loop.close()
    assert out.left == [] and len(out.completions) == len(states)
    assert [st.drawn for st, a, b in zip(states, want, out.completions) if not _same(a, b)] == []
    assert [_reward(c) for c in out.completions] == [_reward(c) for c in want]


def _slow_calculator(delay: float) -> dict:
    """The calculator, answering `delay` seconds late (the same results)."""
    (calc,) = load_tools(["calculator"]).values()
    return {"calculator": dataclasses.replace(calc, fn=lambda **kw: (time.sleep(delay), calc.fn(**kw))[1])}


def test_a_rollout_stopped_while_tools_run_waits_for_them_and_resumes_after_their_observations(tool_chat):
    """Stopped the moment a turn ends at a call (its tool still running), the rollout waits for every call in flight
    and carries those trajectories with the calls' observations; resumed, they end as the straight run's (the calls
    of the stopped rollout are not made again)."""
    comps, _ = _straight(tool_chat)
    loop, eng, prompts = _setup(tool_chat, tools=_slow_calculator(0.05))
    at_stop = []
    stop = loop.turns.stop
    loop.turns.stop = lambda engine: (at_stop.append(len(loop.turns.pending)), stop(engine))[1]
    try:
        first = loop.run(eng, requests_of(prompts, _params(), MSGS), done=lambda fin: bool(loop.turns.pending))
        rest = loop.run(eng, [], states=first.left, messages=[MSGS[st.prompt_index] for st in first.left])
    finally:
        loop.close()
    assert at_stop and at_stop[0] > 0 and first.left  # calls were in flight when it stopped
    at_call = [st for st in first.left if st.trajectory["turns"] and st.trajectory["start"] == len(st.output_ids)]
    assert at_call and all(st.trajectory["turns"][-1]["results"] for st in at_call)
    got = {(c.prompt_index, c.sample_index): c for c in [*first.completions, *rest.completions]}
    assert len(got) == len(comps) and all(_same(c, got[(c.prompt_index, c.sample_index)]) for c in comps)


def _start(label, j, prompt_ids, params, seed):
    return SeqState(label, j, list(prompt_ids), [], [], dataclasses.replace(params, n=1), seed, params.max_tokens, [2])


def _rollout(loop, eng, buf, need, version, requests=()):
    """One partial rollout on the loop (what EngineRollout.generate_partial does with tools), settled into buf: the
    requests of new groups, or (none) the buffer's unfinished responses."""
    horizon = Horizon(buf, need)

    def lens():
        s = eng.scheduler
        return {q.seq_id: len(q.output_ids) for q in [*s.running, *(q for g in s.waiting for q in g)]}

    states = [] if requests else buf.unfinished()
    out = loop.run(eng, list(requests), done=lambda fin: horizon(fin, lambda: loop.turns.running(lens())),
                   states=states, messages=[MSGS[st.prompt_index] for st in states], limit=horizon.limit)
    eng.end_rollout(out.completions.stats)
    buf.settle(out.completions, out.left, horizon, version)
    return horizon, out


@pytest.mark.parametrize("spec", ["off", "ngram"])
def test_a_stopped_tool_rollout_carries_its_trajectories_and_they_end_as_the_straight_ones(tool_chat, tmp_path, spec):
    """A rollout stopped once one group is complete (version 0) carries the rest at its horizon, through a
    checkpoint's files, into the next rollout (version 1), which ends them: each trajectory is the straight run's,
    its tokens drawn before the stop tagged 0 (its observations with the rollout that appended them) and the rest 1,
    and the staleness metrics count the model's tokens only."""
    ref, _ = _straight(tool_chat)
    ref = {(c.prompt_index, c.sample_index): c for c in ref}
    loop, eng, prompts = _setup(tool_chat, spec)
    try:
        buf = PartialBuffer(n=4, max_staleness=2)
        groups = [buf.launch(i, prompts[i], p, 0, _start) for i, p in enumerate(_params())]
        assert [g.gid for g in groups] == [0, 1, 2]
        horizon, out = _rollout(loop, eng, buf, 1, 0, requests_of(prompts, _params(), MSGS, [0, 1, 2]))
        assert horizon.stop is not None and buf.complete_count() >= 1
        kept = {(g.gid, j): (list(r.tokens), r.drawn) for g in buf.groups for j, r in enumerate(g.responses)
                if not r.done}
        assert kept and all(n == horizon.limit(k) for k, (_, n) in kept.items())  # cut at T drawn tokens
        assert all(isinstance(r.state, TrajState) for g in buf.groups for r in g.responses if not r.done)
        write_state(tmp_path, {"partial": buf.state_dict()})  # a checkpoint between the two steps
        back = PartialBuffer(n=4, max_staleness=2)
        back.load_state_dict(read_state(tmp_path)["partial"])
        assert back.state_dict() == buf.state_dict()
        _rollout(loop, eng, back, 3, 1)
    finally:
        loop.close()
    assert back.complete_count() == 3
    resp = [(g.gid, j, r) for g in back.groups for j, r in enumerate(g.responses)]
    for gid, j, r in resp:
        assert _same(r.comp, ref[(gid, j)]), (gid, j)
        had = kept[(gid, j)][0] if (gid, j) in kept else r.tokens  # a response that ended in the first rollout: all
        assert r.tokens[: len(had)] == had and r.versions == [0] * len(had) + [1] * (len(r.tokens) - len(had))
    comps = [dataclasses.replace(r.comp, stats={"policy_versions": version_runs(r.versions)}) for _, _, r in resp]
    old = sum(m for c, (_, _, r) in zip(comps, resp) for m, v in zip(c.response_mask, r.versions) if v == 0)
    assert 0 < old and staleness(comps, 1)["rollout/offpolicy_token_frac"] == pytest.approx(
        old / sum(sum(c.response_mask) for c in comps))


def test_tools_with_partial_rollouts_refuse_vllm_by_name_and_run_on_ray_workers():
    cfg = load_config(None, ["agent.tools=[calculator]", "rollout.partial=true"])
    assert cfg.rollout.partial and cfg.agent.enabled
    with pytest.raises(ConfigError, match="rollout.backend=vllm"):
        load_config(None, ["agent.tools=[calculator]", "rollout.partial=true", "rollout.backend=vllm",
                           "rollout.vllm_spec=off"])
    cfg = load_config(None, ["agent.tools=[calculator]", "rollout.partial=true", "rollout.workers=2"])
    assert cfg.rollout.partial and cfg.rollout.workers == 2  # rollout/remote_partial.py


# the tools preset (tool_chain prompts, the calculator, the math reward) on the tiny tool model, small: 3 steps of 2
# prompts x 4 samples of up to 32 tokens, fp32 on the batch-invariant engine (runs compared token for token)
TOOLS = ("rollout.partial=true", "model.dtype=float32", "rollout.batch_invariant=true", "rollout.n=4",
         "rollout.max_tokens=32", "trainer.prompts_per_step=2", "algo.mini_batch_size=8", "algo.micro_batch_size=8",
         "algo.lr=0.02", "algo.lr_schedule=constant", "trainer.save_every=1", "trainer.eval_every=0",
         "data.num_eval=2", "trainer.report=false", "rollout.kv_cache_gb=0.1")


def _tools_run(folder, out, *extra):
    return train(load_config(None, [f"model.path={folder}", f"trainer.out_dir={out}", *TOOLS, *extra], preset="tools"))


def test_the_tools_preset_with_partial_rollouts_resumed_after_step_2_equals_the_straight_run(tool_chat_folder,
                                                                                             tmp_path):
    a, b = tmp_path / "straight", tmp_path / "resumed"
    _tools_run(tool_chat_folder, a, "trainer.steps=3")
    _tools_run(tool_chat_folder, b, "trainer.steps=2")
    state = read_state(b / "checkpoints" / "step_000002")
    carried_ = [r["state"] for g in state["partial"]["groups"] for r in g["responses"] if not r["comp"]]
    assert any(st.get("trajectory") and st["output_ids"] for st in carried_)  # trajectories carried, begun
    _tools_run(tool_chat_folder, b, "trainer.steps=3", "trainer.resume=true")
    ra, rb = ([json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (a, b))
    assert [r["step"] for r in ra] == [1, 2, 3] == [r["step"] for r in rb]
    assert sum(r["agent/tool_calls"] for r in ra) > 0 and ra[1]["rollout/partial_buffered"] > 0
    keys = [k for k in ra[-1] if k.startswith(("reward/", "response_length", "rollout/partial", "rollout/stale",
                                               "rollout/offpolicy", "actor/pg_loss", "agent/turns", "agent/tool_calls",
                                               "agent/masked_share"))]
    assert "reward/mean" in keys and {k: ra[-1][k] for k in keys} == {k: rb[-1][k] for k in keys}
    from safetensors.torch import load_file

    wa, wb = (load_file(str(d / "checkpoints/step_000003/model/model.safetensors")) for d in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
