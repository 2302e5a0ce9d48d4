"""The agent's turn loop on our engine: config, call formats, the trajectory kept as ids (token in, token out), the
loop itself (tools beside the engine, SD on = off, user tools), and the update's mask over observation tokens."""

import sys
import textwrap

import pytest

from tailrl.config import ConfigError, load_config
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.config.agent import AgentConfig
from tailrl.agent.formats import HermesFormat, TagsFormat
from tailrl.rollout.base import requests_of
from tailrl.rollout.turns import TurnLoop
from tailrl.agent.toolbox import load_tools
from tailrl.speculative.config import SpecConfig


# ---- config -------------------------------------------------------------------------------------------------------

def test_agent_keys_are_validated_and_empty_tools_is_the_single_turn_run():
    cfg = load_config(None, [])
    assert cfg.agent.tools == [] and not cfg.agent.enabled
    cfg = load_config(None, ["agent.tools=[calculator]", "agent.max_turns=2", "agent.format=hermes"])
    assert cfg.agent.enabled and cfg.agent.max_turns == 2
    for bad, key in (("agent.format=json", "agent.format"), ("agent.max_turns=0", "agent.max_turns"),
                     ("agent.truncate_side=up", "agent.truncate_side"), ("agent.tool_timeout_s=0", "tool_timeout_s")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="did you mean agent.max_turns"):
        load_config(None, ["agent.max_turn=3"])


def test_tools_validate_with_every_backend_placement_and_partial_rollouts():
    """Every combination with tools is built: none is refused (partial rollouts on vLLM are, tools or not)."""
    load_config(None, ["agent.tools=[calculator]", "rollout.partial=true"])  # in process: tests/agent/test_partial_tools.py
    # partial rollouts with tools on Ray workers: rollout/remote_partial.py (tests/cluster/test_cluster_tools.py)
    load_config(None, ["agent.tools=[calculator]", "rollout.partial=true", "rollout.workers=2"])
    load_config(None, ["agent.tools=[calculator]", "rollout.workers=2"])  # our engine's Ray workers run it
    # vLLM runs the turn loop itself (rollout/vllm/turns.py), on its Ray actors too, with our proposer inside or not
    # (tests/rollout/vllm_agent_checks.py, vllm_turns_checks.py)
    for spec in ("off", "tailrl"):
        for workers in ("1", "2"):
            load_config(None, ["agent.tools=[calculator]", "rollout.backend=vllm", f"rollout.vllm_spec={spec}",
                               f"rollout.workers={workers}"])


# ---- formats ------------------------------------------------------------------------------------------------------

def test_tags_format_parses_the_call_that_ends_a_turn_and_names_malformed_ones():
    fmt = TagsFormat(load_tools(["calculator"]))
    assert fmt.stop == ["</calc>"]
    (call,) = fmt.parse_calls("I will compute. <calc>347*29</calc>")
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "347*29"}, None)
    (bad,) = fmt.parse_calls("347*29</calc>")
    assert bad.arguments is None and "without an opening <calc>" in bad.error
    assert fmt.parse_calls("#### 10063") == []
    (obs,) = fmt.observation([type("R", (), {"text": "10063"})()])
    assert obs == {"role": "user", "content": "<result>10063</result>"}


def test_hermes_format_parses_json_calls_and_returns_errors_as_calls():
    fmt = HermesFormat(load_tools(["calculator"]))
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    (call,) = fmt.parse_calls(text)
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "2+2"}, None)
    (s,) = fmt.parse_calls('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>')
    assert s.arguments == {"expression": "1"}
    (bad,) = fmt.parse_calls("<tool_call>{name: calculator}</tool_call>")
    assert bad.arguments is None and "not JSON" in bad.error
    assert fmt.template_kwargs()["tools"][0]["function"]["name"] == "calculator"


# ---- the loop on the engine ---------------------------------------------------------------------------------------

def run_loop(model_tok, spec: str, tools=("calculator",), max_turns=3, n=4, epochs=1, keep_kv=True, kv_gb=0.2,
             invariant=True):
    """epochs > 1: the same prompts again on the same engine (new seeds, as RL's next epoch), history kept."""
    model, tok = model_tok
    loop = TurnLoop(AgentConfig(tools=list(tools), max_turns=max_turns, keep_kv=keep_kv), tok)
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=kv_gb, batch_invariant=invariant, seed=0,
                                          spec=SpecConfig(mode=spec, min_match=1)))
    msgs = [[{"role": "user", "content": f"{a} + {b} ?"}] for a, b in ((1, 2), (3, 4), (5, 6))]
    prompts = [loop.encode_prompt(m) for m in msgs]
    for e in range(epochs):
        params = [SamplingParams(n=n, max_tokens=40, temperature=1.0, seed=11 + i + 100 * e) for i in range(len(msgs))]
        comps, records, metrics, _ = loop.run(eng, requests_of(prompts, params, msgs))
        loop.parked_after = len(eng.scheduler.parked)  # kept K/V of ended trajectories is dropped at once
        eng.end_rollout(comps.stats)
    loop.close()
    loop.engine = eng
    return loop, comps, metrics


def test_trajectories_keep_sampled_ids_mask_observations_and_call_tools(tool_chat):
    """Statistical with a fixed seed: 12 trajectories of up to 40 tokens from a 31-word random model write `</calc>`
    (p ~ 1/31 a token) with probability above 1 - 1e-4, so some turns end at a call."""
    loop, comps, m = run_loop(tool_chat, "off")
    assert len(comps) == 12 and [c.prompt_index for c in comps] == [i for i in range(3) for _ in range(4)]
    assert m["agent/tool_calls"] > 0 and m["agent/turns"] > 1
    multi = [c for c in comps if c.trajectory["turns"] > 1]
    assert multi
    for c, tr in zip(comps, loop.last):
        assert len(c.token_ids) == len(c.response_mask) == len(c.logprobs) <= 40
        # the model's tokens are the ones sampled, turn by turn; everything else is mask 0 with logprob 0
        assert all(lp == 0.0 for lp, k in zip(c.logprobs, c.response_mask) if k == 0)
        assert all(lp < 0.0 or lp == 0.0 for lp in c.logprobs)
        assert c.trajectory["turns"] == len(tr.turns)
    c = multi[0]
    calls = c.trajectory["tool_calls"]
    assert calls and all(x["status"] in ("ok", "error", "malformed", "bad_arguments") for x in calls)
    conv = c.trajectory["conversation"]
    assert [x["role"] for x in conv[1:4]] == ["assistant", "user", "assistant"]
    assert conv[2]["content"].startswith("<result>")
    assert 0 < m["agent/masked_share"] < 1 and m["agent/token_drift"] >= 0


def test_speculation_on_and_off_give_the_very_same_trajectories_tool_calls_included(tool_chat):
    """On the batch-invariant engine a turn's tokens depend on (seed, turn, position) only, whatever the batch, the
    order in which tools answered, or speculation (ngram drafts copy earlier turns and observations)."""
    _, off, m_off = run_loop(tool_chat, "off")
    _, on, m_on = run_loop(tool_chat, "ngram")
    assert m_off["agent/tool_calls"] > 0
    assert sum(v["drafted"] for v in on.stats.drafters.values()) > 0, "speculation did not run"
    for a, b in zip(off, on):
        assert a.token_ids == b.token_ids and a.response_mask == b.response_mask
        assert a.trajectory["tool_calls"] == [dict(x, seconds=y["seconds"]) for x, y in
                                              zip(b.trajectory["tool_calls"], a.trajectory["tool_calls"])]


@pytest.mark.parametrize("spec", ["off", "ngram"])
def test_kept_kv_across_tool_calls_gives_the_very_trajectories_of_a_full_reprefill(tool_chat, spec):
    """agent.keep_kv: a turn that stops at a call keeps its K/V while the tool runs and the next turn prefills only
    the observation; on the batch-invariant engine the trajectories equal those that re-prefill every turn, in a
    roomy pool and in one so small that parked K/V is evicted; nothing stays parked after the loop."""
    loop, kept, m = run_loop(tool_chat, spec)
    _, full, m_full = run_loop(tool_chat, spec, keep_kv=False)
    c = tool_chat[0].config  # a pool of 12 blocks of 16 positions: one trajectory fits (<= 40 + prompt), 12 do not
    gb = 13.5 * 16 * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4 / 2**30
    small, tight, m_tight = run_loop(tool_chat, spec, kv_gb=gb)
    assert m["agent/tool_calls"] > 0 and m["agent/kv_kept_tokens"] > 0 and m_full["agent/kv_kept_tokens"] == 0
    assert loop.parked_after == 0 and small.parked_after == 0
    assert small.engine.scheduler.evicted > 0, "the small pool never evicted parked K/V"
    for a, b, c in zip(kept, full, tight):
        assert a.token_ids == b.token_ids == c.token_ids and a.logprobs == b.logprobs == c.logprobs
        assert a.response_mask == b.response_mask == c.response_mask


def test_a_users_tool_from_the_command_line_is_called(tool_chat, tmp_path, monkeypatch):
    (tmp_path / "mytools_agent.py").write_text(textwrap.dedent('''
        CALLS = []

        def lookup(key: str) -> str:
            """Look a key up.

            Args:
                key: What to look up.
            """
            CALLS.append(key)
            return "found " + key
        '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["agent.tools=[mytools_agent:lookup]"])
    assert cfg.agent.tools == ["mytools_agent:lookup"]
    loop, comps, m = run_loop(tool_chat, "off", tools=cfg.agent.tools, n=8)
    called = [x for c in comps for x in c.trajectory["tool_calls"] if x["status"] == "ok"]
    # statistical, fixed seeds: 24 trajectories of 40 tokens from a 31-word random model write <lookup> ... </lookup>
    # in a few of them (3 of 18 at n=6 here); none in all 24 would be a loop that drops calls
    assert called and len(sys.modules["mytools_agent"].CALLS) == len(called)
    assert all(x["result"] == "found " + x["arguments"]["key"] for x in called)
    with pytest.raises(ValueError, match="does not import"):
        load_tools(["no_such_module_xyz:lookup"])


# ---- rewards and the task -----------------------------------------------------------------------------------------

def new_style(prompts, completions, answer, conversation, tool_calls):
    return [float(len(t)) + 10 * (conv[-1]["role"] == "assistant") for conv, t in zip(conversation, tool_calls)]


def old_style(prompts, completions, answer):
    return [1.0 for _ in completions]


def test_reward_functions_get_the_conversation_only_if_they_take_it():
    from tailrl.rl.rewards.runner import _call_user

    conv = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "#### 1"}]]
    cols = {"answer": ["1"], "conversation": conv, "tool_calls": [[{"name": "calculator"}, {"name": "calculator"}]]}
    assert _call_user("tests.agent.test_agent_loop:new_style", ["q"], ["#### 1"], cols) == ("ok", [12.0])
    assert _call_user("tests.agent.test_agent_loop:old_style", ["q"], ["#### 1"], cols) == ("ok", [1.0])


def test_tool_arithmetic_rows_carry_the_few_shot_prefix_and_the_right_answer():
    from tailrl.tasks import split_rows

    train, evals = split_rows("tool_arithmetic", 16, 8)
    assert not {r["question"] for r in train} & {r["question"] for r in evals}
    for r in train + evals:
        msgs = r["prompt"]
        assert msgs[0]["role"] == "system" and "<calc>" in msgs[0]["content"]
        assert [m["role"] for m in msgs[1:9]] == ["user", "assistant", "user", "assistant"] * 2
        assert msgs[2]["content"] == "<calc>482*17</calc>" and msgs[3]["content"] == f"<result>{482 * 17}</result>"
        a, op, b = r["question"][len("What is "):-1].split()
        assert 100 <= int(a) and int(r["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b),
                                                     "*": int(a) * int(b)}[op]


def test_tool_chain_rows_show_chained_calls_and_need_each_result_in_the_next():
    """The multi-call task: worked exchanges whose calls use the previous result, and answers that follow from the
    instruction's numbers (two or three calculations)."""
    import re

    from tailrl.tasks import split_rows

    train, evals = split_rows("tool_chain", 32, 8)
    assert not {r["question"] for r in train} & {r["question"] for r in evals} and {r["level"] for r in train} == {1, 2}
    shot = train[0]["prompt"]
    calls = [m["content"] for m in shot if m["role"] == "assistant" and m["content"].startswith("<calc>")]
    results = [m["content"] for m in shot if m["content"].startswith("<result>")]
    assert len(calls) == 5 and results[0] == "<result>1104</result>" and calls[1] == "<calc>1104+595</calc>"
    for r in train + evals:
        nums = [int(x) for x in re.findall(r"\d+", r["question"])]
        sign = 1 if " add " in r["question"] else -1
        want = nums[0] * nums[1] + sign * (nums[2] if r["level"] == 1 else nums[2] * nums[3])
        assert int(r["answer"]) == want


@pytest.mark.slow
def test_a_training_step_with_tools_logs_agent_metrics_and_trajectories(tool_chat_folder, task_file, tmp_path):
    from tailrl.rl.trainer import Trainer
    from tests.rl_helpers import small_cfg

    cfg = small_cfg(tool_chat_folder, task_file, tmp_path / "run", "agent.tools=[calculator]", "rollout.max_tokens=24",
                    "trainer.steps=1", "model.dtype=float32")
    tr = Trainer(cfg)
    try:
        m = tr.train_step()
    finally:
        tr.close()
    assert {"agent/turns", "agent/tool_calls", "agent/masked_share", "agent/tail_share"} <= set(m)
    assert m["agent/turns"] >= 1 and "actor/pg_loss" in m
    assert tr.samples and all("conversation" in r and "tool_calls" in r for r in tr.samples)


def test_the_report_shows_a_trajectory_with_its_tool_calls(tmp_path):
    import json

    from tailrl.report import sample_lines

    conv = [{"role": "user", "content": "What is 1+2?"}, {"role": "assistant", "content": "<calc>1+2</calc>"},
            {"role": "user", "content": "<result>3</result>"}, {"role": "assistant", "content": "#### 3"}]
    row = {"step": 1, "prompt": "What is 1+2?", "completion": "<calc>1+2</calc>\n#### 3", "reward": 1.0, "length": 20,
           "conversation": conv, "turns": 2, "prompt_messages": 1,
           "tool_calls": [{"name": "calculator", "arguments": {"expression": "1+2"}, "result": "3", "status": "ok"}]}
    (tmp_path / "samples.jsonl").write_text(json.dumps(row) + "\n")
    text = "\n".join(sample_lines(tmp_path))
    assert "[assistant] <calc>1+2</calc>\n[tool result] <result>3</result>\n[assistant] #### 3" in text
    assert "(1 tool call: calculator ok)" in text


def test_history_files_later_turns_by_prompt_and_turn_and_stays_lossless_over_epochs(tool_chat):
    """Speculation across turns: a trajectory's turn k is filed under (its prompt, k), so the next epoch's turn k
    drafts from it whatever the earlier turns were; two epochs with history drafting give the very same trajectories
    as with speculation off."""
    loop, on, _ = run_loop(tool_chat, "history", epochs=2)
    _, off, _ = run_loop(tool_chat, "off", epochs=2)
    hist = loop.engine.speculator.drafters["history"]
    turns = {k[1] for k in hist.prompts if isinstance(k[0], tuple)}
    assert turns and min(turns) >= 1 and len(hist.prompts) == 3 + sum(
        1 for k in hist.prompts if isinstance(k[0], tuple))
    assert {k[0] for k in hist.prompts if isinstance(k[0], tuple)} <= {k for k in hist.prompts if isinstance(k[0], int)}
    assert sum(v["drafted"] for v in on.stats.drafters.values()) > 0, "speculation did not run"
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    assert [c.response_mask for c in on] == [c.response_mask for c in off]


def test_response_lengths_count_the_models_tokens_and_the_trajectory_apart():
    from types import SimpleNamespace

    from tailrl.rl.trainer import response_metrics

    single = SimpleNamespace(token_ids=[1] * 6, finish_reason="stop", response_mask=None)
    multi = SimpleNamespace(token_ids=[1] * 10, finish_reason="length", response_mask=[1, 1, 1, 0, 0, 0, 0, 1, 1, 1])
    m = response_metrics([single, multi], [])
    assert m["response_lengths"] == [6, 6] and m["response_length/mean"] == 6.0
    assert m["response_length/trajectory_mean"] == 8.0 and m["response_length/clip_ratio"] == 0.5
    assert "response_length/trajectory_mean" not in response_metrics([single], [])


def test_eval_of_a_tools_run_runs_the_turn_loop(tool_chat_folder, task_file, tmp_path):
    """`tailrl eval` on a run trained with agent.tools scores its held-out prompts through the same turn loop (tools
    called, the model's turns scored), not as single-turn completions."""
    import json

    from tailrl.rl.evaluate import Source, eval_set, run_eval
    from tests.rl_helpers import small_cfg

    cfg = small_cfg(tool_chat_folder, task_file, tmp_path / "run", "agent.tools=[calculator]", "model.dtype=float32")
    examples, _, _ = eval_set(cfg, None, 3)
    out = tmp_path / "eval.jsonl"
    summary = run_eval(Source(tool_chat_folder, cfg, "tools run"), examples, 4, 1.0, 32, None, 0, out)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 12 and all("tool_calls" in r for r in rows)
    assert summary["turns"] >= 1 and summary["tool_calls"] == sum(len(r["tool_calls"]) for r in rows) / 12


def test_generate_with_tools_writes_trajectories_and_names_a_tool_that_does_not_load(tool_chat_folder, tmp_path,
                                                                                       capsys):
    import json

    from tailrl.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a} + {b} ?"}) + "\n" for a, b in ((1, 2), (3, 4))))
    out = tmp_path / "out.jsonl"
    args = ["generate", "--model", tool_chat_folder, "--prompts", str(prompts), "--out", str(out), "--n", "3",
            "--max-tokens", "24", "--seed", "5", "--dtype", "float32", "--quiet"]
    assert main(args + ["--tools", "calculator"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 6 and all("tool_calls" in r and len(r["response_mask"]) == len(r["token_ids"]) for r in rows)
    assert all(r["conversation"][0]["role"] == "user" for r in rows)
    assert main(args + ["--tools", "nosuchmodule:lookup"]) == 2
    assert "nosuchmodule" in capsys.readouterr().err
