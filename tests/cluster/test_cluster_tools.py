"""Partial rollouts with tools on rollout workers (rollout/remote_partial.py): two rollouts (one stopped at its horizon,
its trajectories carried mid-turn or after a call's observation, then one that ends them) on two workers give, on
the batch-invariant engine, the very buffer one engine in process gives (tokens, mask, logprobs, calls, versions),
also when a worker fails holding carried trajectories (they re-run from their carried state) or after the
horizon was told of its trajectories' ends (told once); trajectories moved to an idle worker mid-rollout end as
they would have where they were."""

import dataclasses

import pytest
import torch

from tailrl.cluster.config import ClusterConfig
from tailrl.cluster.cost import StepCost
from tailrl.cluster.rollout import ClusterRollout
from tailrl.cluster.workers import WorkerSpec
from tailrl.config.agent import AgentConfig
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.engine.requests import SeqState
from tailrl.model import load_model
from tailrl.model.tiny import TOOL_WORDS, make_tiny_chat_model
from tailrl.rollout.base import requests_of
from tailrl.rollout.partial import Horizon, PartialBuffer
from tailrl.rollout.remote_partial import cluster_tool_partial, cluster_tool_rollout
from tailrl.rollout.tool_worker import worker_round, worker_start
from tailrl.rollout.tool_partial import TrajState
from tailrl.rollout.tool_turns import ToolTurns
from tailrl.rollout.turns import TurnLoop, seq_lens
from tailrl.speculative.config import SpecConfig

MSGS = [[{"role": "user", "content": f"{a} + {b} ?"}] for a, b in ((1, 2), (3, 4), (5, 6))]
AGENT = AgentConfig(tools=["calculator"], max_turns=3)
ENGINE = EngineConfig(kv_cache_gb=0.2, batch_invariant=True, seed=0, spec=SpecConfig(mode="ngram", min_match=1))
LOGPROB_TOL = 1e-5  # the same fp32 batch-invariant passes on the same weights: equal in practice, bounded here


def _params():
    return [SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=31 + i) for i in range(len(MSGS))]


def _start(label, j, prompt_ids, params, seed):
    return SeqState(label, j, list(prompt_ids), [], [], dataclasses.replace(params, n=1), seed, params.max_tokens, [2])


def _two_rollouts(prompts, rollout) -> tuple[PartialBuffer, dict]:
    """Rollout 0 launches 3 groups and stops once 1 is complete; rollout 1 ends the carried ones. rollout(requests,
    states, horizon) -> (completions, carried states, lost keys). Returns the buffer and the carried after rollout 0."""
    buf = PartialBuffer(n=4, max_staleness=2)
    for i, p in enumerate(_params()):
        buf.launch(i, prompts[i], p, 0, _start)
    carried = {}
    for version, need in ((0, 1), (1, 3)):
        if buf.complete_count() >= need:  # (as the trainer: no rollout when the buffer has the groups)
            break
        horizon = Horizon(buf, need)
        reqs = requests_of(prompts, _params(), MSGS, [0, 1, 2]) if version == 0 else []
        comps, left, lost = rollout(reqs, [] if version == 0 else buf.unfinished(), horizon)
        assert lost == [] and horizon.stop is not None
        buf.settle(comps, left, horizon, version)
        if version == 0:
            carried = {(g.gid, j): r.state for g in buf.groups for j, r in enumerate(g.responses) if not r.done}
    return buf, carried


@torch.no_grad()
def _next_weights(model) -> dict:
    """The policy after an update, in place (the same in every run): rollout 1 decodes under other weights than
    rollout 0, so a carried trajectory restarted from its prompt would not end as the one continued from its state."""
    g = torch.Generator().manual_seed(5)
    for name, w in sorted(model.state_dict().items()):
        if w.dim() == 2:
            w.add_(torch.randn(w.shape, generator=g) * 0.05)
    return model.state_dict()


def _in_process(folder):
    model, tok = load_model(folder, device="cpu", dtype=torch.float32)
    loop, eng = TurnLoop(AGENT, tok), Engine(model, tok, ENGINE)
    prompts = [loop.encode_prompt(m) for m in MSGS]

    def rollout(reqs, states, horizon):
        if states:
            _next_weights(model)
        out = loop.run(eng, reqs, done=lambda fin: horizon(fin, lambda: loop.turns.running(seq_lens(eng))),
                       states=states, messages=[MSGS[st.prompt_index] for st in states], limit=horizon.limit)
        eng.end_rollout(out.completions.stats)
        return out.completions, out.left, []

    try:
        return prompts, *_two_rollouts(prompts, rollout)
    finally:
        loop.close()


def _failing(worker, at_round: int | None) -> dict:
    """The worker raises at its `at_round`-th round from now (None: at the round after the first that reported a
    trajectory's end, which the horizon was told of); returns what it was handed (its carried states)."""
    real, seen = worker.run_held, {"rounds": 0, "states": [], "ended": 0}

    def run_held(fn, *args):
        if fn is worker_start:
            seen["states"] += args[3]
        if fn is worker_round:
            seen["rounds"] += 1
            if seen["rounds"] == at_round or (at_round is None and seen["ended"]):
                raise RuntimeError("injected failure")
        out = real(fn, *args)
        if fn is worker_round:
            seen["ended"] += len(out[0])
        return out

    worker.run_held = run_held
    return seen


def _on_workers(folder, prompts):
    threads = torch.get_num_threads()
    cluster = ClusterRollout(WorkerSpec(model=folder, engine=ENGINE, dtype="float32"), 2,
                             ClusterConfig(round_steps=3), local=True)
    metrics, seen = [], []
    policy, _ = load_model(folder, device="cpu", dtype=torch.float32)

    def rollout(reqs, states, horizon):
        if states:
            cluster.sync_weights(_next_weights(policy))
        # rollout 0: worker 0 fails once it has told the horizon of an end (its groups re-run from their prompts);
        # rollout 1: worker 1 fails at its second round, holding carried trajectories (re-run from their states)
        seen.append(_failing(cluster.pool.workers[1], 2) if states else _failing(cluster.pool.workers[0], None))
        cluster.revive()
        comps, left, lost, m = cluster_tool_partial(cluster, AGENT, reqs, states,
                                                    {i: MSGS[i] for i in range(len(MSGS))}, horizon)
        metrics.append(m)
        return comps, left, lost

    try:
        return *_two_rollouts(prompts, rollout), metrics, seen
    finally:
        cluster.shutdown()
        torch.set_num_threads(threads)  # an in-process worker sets its thread count for the whole process


def _calls(c) -> list:
    return [{k: v for k, v in x.items() if k != "seconds"} for x in c.trajectory["tool_calls"]]


@pytest.mark.slow  # an engine in process and two workers' engines, two tool rollouts each: ~5-8 s
def test_two_workers_carry_and_end_the_trajectories_one_engine_does_through_a_worker_failure(tmp_path):
    folder = str(make_tiny_chat_model(tmp_path / "toolchat", seed=3, words=TOOL_WORDS))
    prompts, ref, ref_carried = _in_process(folder)
    buf, carried, metrics, seen = _on_workers(folder, prompts)
    # rollout 0 stopped early and carried trajectories, begun, some mid-turn past a call; rollout 1 had a failure
    assert ref_carried and any(isinstance(st, TrajState) and st.trajectory["turns"] for st in ref_carried.values())
    assert [m["cluster/worker_failures"] for m in metrics] == [1, 1] and all(m["cluster/requeued"] for m in metrics)
    assert seen[0]["ended"] > 0 and any(st.output_ids for st in seen[1]["states"])
    assert sorted(carried) == sorted(ref_carried)
    for k, st in ref_carried.items():  # carried at the same horizon, cut at the same token
        got = carried[k]
        assert (got.output_ids, got.trajectory["mask"], got.trajectory["start"]) == (
            st.output_ids, st.trajectory["mask"], st.trajectory["start"]), k
        assert max((abs(a - b) for a, b in zip(got.logprobs, st.logprobs)), default=0.0) <= LOGPROB_TOL
    assert buf.complete_count() == ref.complete_count() == 3
    for g, h in zip(buf.groups, ref.groups):
        assert g.gid == h.gid
        for r, q in zip(g.responses, h.responses):
            a, b = r.comp, q.comp
            assert (a.token_ids, a.response_mask, a.finish_reason, a.text, r.versions) == (
                b.token_ids, b.response_mask, b.finish_reason, b.text, q.versions), (g.gid, a.sample_index)
            assert a.trajectory["conversation"] == b.trajectory["conversation"] and _calls(a) == _calls(b)
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= LOGPROB_TOL
    versions = [v for g in buf.groups for r in g.responses for v in r.versions]
    assert 0 in versions and 1 in versions  # tokens of both rollouts, each tagged with its own
    assert sum(len(_calls(r.comp)) for g in buf.groups for r in g.responses) > 0


@pytest.mark.slow  # an engine in process and two workers' engines, one tool rollout each: ~2 s
def test_trajectories_moved_to_an_idle_worker_mid_rollout_end_as_they_would_have_where_they_were(tmp_path):
    """rollout.partial off: the rounds run every trajectory to its end (cluster_tool_rollout). Group 1 is short, so
    its worker idles while the other still runs two groups and takes trajectories from it, mid-turn and after a
    call's observation; each ends as the unmoved run's does."""
    folder = str(make_tiny_chat_model(tmp_path / "toolchat", seed=3, words=TOOL_WORDS))
    params = [SamplingParams(n=4, max_tokens=m, temperature=1.0, seed=11 + i) for i, m in enumerate((40, 6, 40))]
    model, tok = load_model(folder, device="cpu", dtype=torch.float32)
    loop = TurnLoop(AGENT, tok)
    prompts = [loop.encode_prompt(m) for m in MSGS]
    try:
        one, _, m_one, _ = loop.run(Engine(model, tok, ENGINE), requests_of(prompts, params, MSGS))
    finally:
        loop.close()
    threads = torch.get_num_threads()
    cheap_prefill = StepCost(prefill_token_s=0.0005)  # (a re-prefill then pays for a trajectory a few tokens long)
    cluster = ClusterRollout(WorkerSpec(model=folder, engine=ENGINE, dtype="float32"), 2, ClusterConfig(round_steps=2),
                             cost=cheap_prefill, local=True)
    moved, real = [], ToolTurns.hand_over

    def hand_over(self, engine, keys):
        out = real(self, engine, keys)
        moved.extend(out)
        return out

    try:
        ToolTurns.hand_over = hand_over
        two, m_two = cluster_tool_rollout(cluster, AGENT, requests_of(prompts, params, MSGS))
        n_moved = len(moved)
        # again, the receiver failing once it holds moved trajectories: they re-run from the states they moved with
        seen = _failing(cluster.pool.workers[1], 9)
        again, m_again = cluster_tool_rollout(cluster, AGENT, requests_of(prompts, params, MSGS))
    finally:
        ToolTurns.hand_over = real
        cluster.shutdown()
        torch.set_num_threads(threads)
    assert m_two["cluster/migrated"] == n_moved > 0 and m_two["cluster/worker_failures"] == 0
    assert any(st.output_ids[st.trajectory["start"]:] for st in moved)  # moved mid-turn
    assert m_again["cluster/worker_failures"] == 1 and m_again["cluster/migrated"] > 0
    assert m_again["cluster/requeued"] > params[1].n  # its own group and trajectories it had taken
    assert seen["rounds"] == 9 and any(st.output_ids for st in seen["states"])  # it failed holding moved ones
    assert m_one["agent/tool_calls"] > 0
    for run, m in ((two, m_two), (again, m_again)):
        assert [(c.prompt_index, c.sample_index) for c in run] == [(c.prompt_index, c.sample_index) for c in one]
        for a, b in zip(run, one):
            assert (a.token_ids, a.response_mask, a.finish_reason, a.text) == (
                b.token_ids, b.response_mask, b.finish_reason, b.text), (a.prompt_index, a.sample_index)
            assert a.trajectory["conversation"] == b.trajectory["conversation"] and _calls(a) == _calls(b)
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= LOGPROB_TOL
        assert abs(m["agent/tool_calls"] - m_one["agent/tool_calls"]) < 1e-9
