"""Partial rollouts (rollout/partial.py): a step ends its rollout once it has its groups and carries the unfinished
responses, which continue next step with their old tokens, logprobs and policy versions; the staleness bound
restarts the oldest; the update weighs carried tokens by their recorded logprobs; a resumed run continues exactly."""

import dataclasses
import json

import pytest
import torch

from tailrl.cluster.config import ClusterConfig
from tailrl.cluster.partial import partial_rollout
from tailrl.cluster.rollout import ClusterRollout
from tailrl.config import ConfigError
from tailrl.engine import SamplingParams
from tailrl.engine.requests import SeqState
from tailrl.engine.sequence import Completion
from tailrl.rl.checkpoint.state_io import read_state, write_state
from tailrl.rollout.partial import Horizon, PartialBuffer, launch_count, staleness, version_runs
from tailrl.rl.run import train
from tailrl.rl.trainer import Trainer
from tests.rl_helpers import check_rounds, tiny_cfg

from tests.cluster_fakes import CPU, PARAMS, PROMPTS, fake_rollout, spec

PARTIAL = ("rollout.partial=true", "rollout.max_tokens=48", "rollout.n=4", "algo.mini_batch_size=8")
# runs compared token for token: fp32 (bf16 batch invariance is established for SmolLM2's shapes, engine/invariant.py;
# this tiny model's products may take other kernels on another CPU)
EXACT = ("model.dtype=float32", "rollout.batch_invariant=true")


def start(label, j, prompt_ids, params, seed):
    return SeqState(label, j, list(prompt_ids), [], [], dataclasses.replace(params, n=1), seed, params.max_tokens, [2])


def done(gid, j, tokens, reason="stop"):
    return Completion(seq_id=0, prompt_index=gid, sample_index=j, prompt_token_ids=[5, 6], token_ids=list(tokens),
                      text="", logprobs=[-0.5] * len(tokens), finish_reason=reason)


def test_version_runs():
    assert version_runs([3, 3, 4, 4, 4, 6]) == [[3, 2], [4, 3], [6, 1]] and version_runs([]) == []


def test_launch_keeps_oversample_times_the_need_in_flight():
    assert launch_count(2.0, 4, 0) == 8 and launch_count(2.0, 4, 5) == 3 and launch_count(1.5, 3, 0) == 5
    assert launch_count(1.0, 4, 9) == 0


def test_buffer_records_each_tokens_version_and_restarts_past_the_bound():
    buf = PartialBuffer(n=2, max_staleness=1)
    g = buf.launch(7, [5, 6], SamplingParams(n=2, max_tokens=20, temperature=0.7, seed=40), 0, start)
    assert [r.state.seed for r in g.responses] == [40, 41]
    assert not buf.finished(done(g.gid, 0, [9, 9, 2]), version=0)  # its sibling still runs
    st = dataclasses.replace(g.responses[1].state, output_ids=[3, 4], logprobs=[-1.0, -2.0])
    buf.carry([st], version=0)
    assert buf.complete_count() == 0 and buf.unfinished() == [st]
    st2 = dataclasses.replace(st, output_ids=[3, 4, 8], logprobs=[-1.0, -2.0, -3.0])
    buf.carry([st2], version=1)
    assert g.responses[1].versions == [0, 0, 1]
    with pytest.raises(RuntimeError, match="without the tokens it had"):  # a continuation that lost its tokens
        buf.carry([dataclasses.replace(st, output_ids=[3, 5, 8])], version=2)
    # before version 2's rollout: both responses hold version-0 tokens, 2 versions old > 1: both restart
    assert buf.restart_stale(2) == 2
    fresh = g.responses[1].state
    assert fresh.output_ids == [] and fresh.logprobs == [] and fresh.seed != 41 and fresh.prompt_ids == [5, 6]
    assert not g.responses[0].done and g.responses[0].versions == []
    assert buf.finished(done(g.gid, 0, [1, 2]), 2) is False and buf.finished(done(g.gid, 1, [7]), 2) is True
    trained = [dataclasses.replace(r.comp, stats={"policy_versions": version_runs(r.versions)})
               for g in buf.take(1) for r in g.responses]
    assert buf.metrics()["rollout/partial_restarted"] == 2 and buf.groups == []
    m = staleness(trained, version=2)
    assert m["rollout/staleness_max"] == 0 and m["rollout/offpolicy_token_frac"] == 0.0


def test_staleness_metrics_are_over_the_trained_tokens():
    buf = PartialBuffer(n=2, max_staleness=3)
    g = buf.launch(0, [5, 6], SamplingParams(n=2, max_tokens=20, temperature=0.7, seed=1), 0, start)
    buf.carry([dataclasses.replace(g.responses[0].state, output_ids=[3], logprobs=[-1.0])], 0)
    buf.finished(done(g.gid, 0, [3, 4, 2]), 2)  # 1 token of version 0, 2 of version 2
    buf.finished(done(g.gid, 1, [1]), 2)
    m = staleness([dataclasses.replace(r.comp, stats={"policy_versions": version_runs(r.versions)})
                   for g in buf.take(1) for r in g.responses], version=2)
    assert m["rollout/offpolicy_token_frac"] == pytest.approx(1 / 4)
    assert m["rollout/staleness_mean"] == pytest.approx(2 / 4) and m["rollout/staleness_max"] == 2
    assert m["rollout/offpolicy_responses"] == 1
    assert staleness([], 2) == {"rollout/offpolicy_token_frac": 0.0, "rollout/staleness_mean": 0.0,
                                "rollout/staleness_max": 0, "rollout/offpolicy_responses": 0}


def test_a_rejected_group_leaves_whole_and_is_counted():
    buf = PartialBuffer(n=2, max_staleness=2)
    g = buf.launch(0, [5], SamplingParams(n=2, max_tokens=20, temperature=0.7, seed=1), 0, start)
    buf.finished(dataclasses.replace(done(g.gid, 0, []), finish_reason="error", prompt_token_ids=[]), 0)
    buf.finished(dataclasses.replace(done(g.gid, 1, []), finish_reason="error", prompt_token_ids=[]), 0)
    assert buf.complete_count() == 0 and buf.take(4) == [] and buf.metrics()["rollout/rejected"] == 1


def test_buffer_state_round_trips_through_the_checkpoint_files(tmp_path):
    buf = PartialBuffer(n=2, max_staleness=2)
    g = buf.launch(3, [5, 6], SamplingParams(n=2, max_tokens=20, temperature=0.7, seed=9, stop=["##"]), 0, start)
    buf.finished(done(g.gid, 0, [4, 2]), 0)
    buf.carry([dataclasses.replace(g.responses[1].state, output_ids=[3], logprobs=[-0.123456789012345])], 0)
    write_state(tmp_path, {"partial": buf.state_dict()})
    back = PartialBuffer(n=2, max_staleness=2)
    back.load_state_dict(read_state(tmp_path)["partial"])
    assert back.state_dict() == buf.state_dict()
    r = back.groups[0].responses
    assert r[1].state.logprobs == [-0.123456789012345] and r[1].state.params.stop == ["##"] and r[0].comp.token_ids == [4, 2]


def test_partial_with_vllm_or_a_bad_oversample_is_a_config_error(tiny_chat, task_file, tmp_path):
    with pytest.raises(ConfigError, match="rollout.partial"):
        tiny_cfg(tiny_chat, task_file, tmp_path, "rollout.partial=true", "rollout.backend=vllm")
    with pytest.raises(ConfigError, match="rollout.partial_oversample"):
        tiny_cfg(tiny_chat, task_file, tmp_path, "rollout.partial=true", "rollout.partial_oversample=0.5")


def test_a_carried_response_continues_to_the_tokens_one_rollout_draws(tiny_chat, task_file, tmp_path):
    """Stopped after the first group completes and continued under the same weights, every response ends with the
    tokens and logprobs of the uninterrupted rollout (the noise is keyed by seed and position)."""
    # invariant passes (fixed row blocks, decode == prefill): a re-prefilled response goes on bit for bit
    tr = Trainer(tiny_cfg(tiny_chat, task_file, tmp_path, *PARTIAL, *EXACT, "rollout.batch_invariant=true"))
    try:
        ro, ex = tr.rollout, tr.train_set[:3]
        params = [SamplingParams(n=4, max_tokens=48, temperature=0.7, seed=11 * i) for i in range(3)]
        ref = ro.engine.generate([e.ids for e in ex], params)
        first, left, _ = ro.generate_partial([e.ids for e in ex], params, [10, 11, 12], [], 0, 0.0,
                                             lambda fin, running: any(c.finish_reason == "stop" for c in fin))
        assert left and len(first) + len(left) == 12
        assert all(0 < len(st.output_ids) == len(st.logprobs) for st in left)
        rest, none, _ = ro.generate_partial([], [], [], left, 0, 0.0, lambda fin, running: False)
        assert none == []
        got = {(c.prompt_index - 10, c.sample_index): (c.token_ids, c.logprobs) for c in [*first, *rest]}
        assert got == {(c.prompt_index, c.sample_index): (c.token_ids, c.logprobs) for c in ref}
    finally:
        tr.close()


def _train_steps(tr, k):
    for _ in range(k):
        tr.train_step()


def test_carried_responses_keep_old_tokens_logprobs_and_versions_and_the_update_weighs_them(tiny_chat, task_file,
                                                                                            tmp_path):
    tr = Trainer(tiny_cfg(tiny_chat, task_file, tmp_path, *PARTIAL, "trainer.steps=4"))
    try:
        assert tr.cfg.algo.tis_cap == 2.0  # partial rollouts weigh tokens by the policy that drew them
        seen = []
        update = tr.actor.update
        tr.actor.update = lambda batch, adv, step, timing: (seen.append(batch), update(batch, adv, step, timing))[1]
        tr.train_step()
        carried = {(g.gid, j): (list(r.tokens), list(r.state.logprobs))
                   for g in tr.partial.groups for j, r in enumerate(g.responses) if not r.done and r.tokens}
        assert carried, "the first step should end with unfinished responses"
        finished = {}
        for _ in range(3):
            taken = []
            take = tr.partial.take
            tr.partial.take = lambda k: taken.extend(take(k)) or taken
            m = tr.train_step()
            tr.partial.take = take
            for k, g in enumerate(taken):
                for j, r in enumerate(g.responses):
                    finished[(g.gid, j)] = (r, k, len(seen) - 1, tr.step - 1)
            assert m["rollout/staleness_max"] <= 2
        cont = [key for key in carried if key in finished]
        assert cont, "a carried response should be trained within 3 steps"
        for key in cont:
            r, k, b, version = finished[key]
            toks, lps = carried[key]
            assert r.comp.token_ids[: len(toks)] == toks and r.comp.logprobs[: len(lps)] == lps
            assert r.versions[: len(toks)] == [0] * len(toks) and set(r.versions[len(toks):]) <= set(range(1, version + 1))
            assert len(r.versions) == len(r.comp.token_ids)
            # the update's behaviour logprobs of that row are the recorded ones, old policy's included
            batch = seen[b]
            row = next(i for i, s in enumerate(batch.seqs) if list(s[batch.prompt_lens[i]:]) == r.comp.token_ids)
            p = batch.prompt_lens[row] - 1 - batch.start
            got = batch.rollout_lp[row, p : p + len(lps)]
            assert torch.equal(got, torch.tensor(lps, dtype=got.dtype))
    finally:
        tr.close()


def test_no_trained_token_is_past_the_staleness_bound(tiny_chat, task_file, tmp_path):
    out = tmp_path / "run"
    train(tiny_cfg(tiny_chat, task_file, out, *PARTIAL, "rollout.partial_max_staleness=0", "trainer.steps=4"))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout/staleness_max"] == 0 and r["rollout/offpolicy_token_frac"] == 0.0 for r in rows)
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all([v for v, _ in s["policy_versions"]] == [s["step"] - 1] for s in samples)
    assert all(sum(k for _, k in s["policy_versions"]) == s["length"] for s in samples)
    assert sum(r["rollout/partial_restarted"] for r in rows) > 0  # carried ones were restarted, not trained on


@pytest.mark.slow
def test_a_partial_run_resumes_exactly(tiny_chat, task_file, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(tiny_cfg(tiny_chat, task_file, a, *PARTIAL, *EXACT, "trainer.steps=3"))
    train(tiny_cfg(tiny_chat, task_file, b, *PARTIAL, *EXACT, "trainer.steps=2"))
    state = read_state(b / "checkpoints" / "step_000002")
    assert any(not r["comp"] for g in state["partial"]["groups"] for r in g["responses"])  # carried ones saved
    train(tiny_cfg(tiny_chat, task_file, b, *PARTIAL, *EXACT, "trainer.steps=3", "trainer.resume=true",
                   "trainer.overwrite=false"))
    ra = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    keys = [k for k in ra[-1] if k.startswith(("reward/", "rollout/partial", "rollout/stale", "response_length/"))]
    assert keys and {k: ra[-1][k] for k in keys} == {k: rb[-1][k] for k in keys}
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "checkpoints/step_000003/model/model.safetensors")), load_file(str(b / "checkpoints/step_000003/model/model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_cluster_driver_hands_back_and_continues_sequences_exactly():
    ref = fake_rollout(PROMPTS, PARAMS)
    cr = ClusterRollout(spec(), 2, ClusterConfig(round_steps=2, migrate=False), CPU, local=True)
    first, left, lost = partial_rollout(cr, PROMPTS, PARAMS, [], lambda fin, running: bool(fin))  # the first round with a finish
    assert left and not lost and len(first) + len(left) == 32
    assert any(st.output_ids for st in left)
    rest, none, _ = partial_rollout(cr, [], [], left, lambda fin, running: False)
    assert none == []
    got = {(c.prompt_index, c.sample_index): (c.token_ids, c.logprobs, c.finish_reason) for c in first}
    # continued sequences come back under their own slots: map them to their carried (prompt, sample)
    got.update({(st.prompt_index, st.sample_index): (c.token_ids, c.logprobs, c.finish_reason)
                for st, c in zip(left, sorted(rest, key=lambda c: c.prompt_index))})
    assert got == {(i, j): ref[i * 4 + j] for i in range(8) for j in range(4)}


def _settled(round_steps: int, workers: int):
    buf = PartialBuffer(n=4, max_staleness=2)
    for i, (p, prm) in enumerate(zip(PROMPTS, PARAMS)):
        buf.launch(i, p, prm, 0, start)
    horizon = Horizon(buf, 3)
    cr = ClusterRollout(spec(), workers, ClusterConfig(round_steps=round_steps, migrate=False), CPU, local=True)
    comps, left, lost = partial_rollout(cr, PROMPTS, PARAMS, [], horizon)
    assert not lost
    buf.settle(comps, left, horizon, 0)
    return horizon.stop, [[(r.done, r.tokens, r.versions) for r in g.responses] for g in buf.groups]


def test_where_a_rollout_stops_does_not_depend_on_rounds_or_workers():
    """The horizon counts tokens, not engine steps: rounds of 1 or 7 steps on 1 or 3 workers keep the same tokens."""
    ref = _settled(1, 1)
    assert ref[0] is not None and any(not done for g in ref[1] for done, _, _ in g)
    assert _settled(7, 1) == ref and _settled(3, 3) == ref


@pytest.mark.slow
def test_partial_rollouts_compose_with_dynamic_sampling(tiny_chat, task_file, tmp_path):
    """Each round asks the partial rollout for the informative groups still missing; the update gets them."""
    out = tmp_path / "run"
    train(tiny_cfg(tiny_chat, task_file, out, *PARTIAL, "trainer.steps=3", "algo.dynamic_sampling=true",
                   "reward.functions=[tests.rl_helpers:odd_prompts_only]", "algo.filter_metric=reward",
                   "trainer.prompts_per_step=2"))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # the update gets the informative groups found; fewer than 2 only at the round limit, reported
        check_rounds(r, 2, 4)
    assert sum(r["rollout/informative_groups"] for r in rows) > 0
    assert any(r["rollout/filtered_groups"] > 0 for r in rows)  # groups of even prompts score all 0
    assert sum(r["rollout/partial_carried"] for r in rows) > 0


@pytest.mark.slow
def test_partial_rollouts_train_the_same_tokens_with_speculation_on_and_off(tiny_chat, task_file, tmp_path):
    """Composed with lossless speculation: the horizon counts tokens, so SD (several tokens a step) changes neither
    where a rollout stops nor what it carries; the runs train on the very same tokens. SD auto, and a fixed drafter
    (history: it drafts on every step, where auto may rightly decode this tiny model plainly throughout)."""
    rows = {}
    for mode in ("auto", "history", "off"):
        out = tmp_path / mode
        train(tiny_cfg(tiny_chat, task_file, out, *PARTIAL, *EXACT, "trainer.steps=4", f"rollout.spec.mode={mode}"))
        rows[mode] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    keys = ["reward/mean", "response_lengths", "rollout/partial_carried", "rollout/partial_horizon",
            "rollout/staleness_mean"]
    for mode in ("auto", "history"):
        assert [[r[k] for k in keys] for r in rows[mode]] == [[r[k] for k in keys] for r in rows["off"]], mode
    assert sum(r["rollout/partial_carried"] for r in rows["off"]) > 0
    assert max(r.get("spec/accept_length", 0) for r in rows["history"]) > 1.0  # speculation did draft and accept


def text_len(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def test_staleness_is_over_the_trained_tokens_when_a_round_is_served_from_the_buffer(tiny_chat, task_file, tmp_path):
    """Partial rollouts with dynamic sampling (issue 64): round 0 is served from the buffer (no token drawn) with an
    informative group drawn 2 versions ago and one without a spread; later rounds draw fresh groups. The staleness
    metrics are over the tokens the update trains, the buffered group's included (merged by tokens drawn, it read 0)."""
    tr = Trainer(tiny_cfg(tiny_chat, task_file, tmp_path, *PARTIAL, "algo.dynamic_sampling=true",
                          "trainer.prompts_per_step=2", "reward.functions=[tests.rl.test_partial:text_len]",
                          "algo.filter_metric=reward"))
    try:
        tr.step = 2
        for i, texts in enumerate((["a", "bb", "a", "ccc"], ["a"] * 4)):  # informative, then all equal (filtered)
            ex = tr.train_set[i]
            g = tr.partial.launch(i, ex.ids, SamplingParams(n=4, max_tokens=48, temperature=0.7, seed=i), 0,
                                  tr.rollout.start_state)
            for j, t in enumerate(texts):
                ids = tr.tokenizer.encode(t, add_special_tokens=False)
                tr.partial.finished(Completion(0, g.gid, j, list(ex.ids), ids, t, [-1.0] * len(ids), "stop"), 0)
        trained = []
        learn = tr._learn
        tr._learn = lambda got, timing: (trained.extend(got.comps), learn(got, timing))[1]
        m = tr.train_step()
        old = sum(len(c.token_ids) for c in trained[:4])
        assert [c.text for c in trained[:4]] == ["a", "bb", "a", "ccc"] and m["rollout/filtered_groups"] >= 1
        assert {k: m[k] for k in staleness(trained, 2)} == staleness(trained, 2)
        total = sum(len(c.token_ids) for c in trained)
        assert m["rollout/staleness_max"] == 2 and m["rollout/offpolicy_responses"] == 4
        assert m["rollout/staleness_mean"] == pytest.approx(2 * old / total) and m["rollout/staleness_mean"] > 0
        assert m["rollout/offpolicy_token_frac"] == pytest.approx(old / total)
    finally:
        tr.close()
