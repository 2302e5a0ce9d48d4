"""agent.tools on rollout.backend=vllm (rollout/vllm/turns.py) with a tiny chat model vLLM's CPU kernels take, on one
in-process LLM and on two Ray actors. Run by tests/rollout/test_vllm.py in a process of its own (one more LLM in
vllm_checks.py's process spins or fails in vLLM 0.32)."""

import os

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from tailrl.model import load_model  # noqa: E402
from tailrl.rollout.vllm.llm import make_llm  # noqa: E402
from tailrl.model.tiny import make_tiny_vllm_model as make_folder  # noqa: E402
from tests.rollout.vllm_checks import TOL, our_logprobs  # noqa: E402


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    from tailrl.model.tiny import VLLM_TOOL_WORDS

    return make_folder(tmp_path_factory.mktemp("tiny_vllm_chat"), VLLM_TOOL_WORDS, scale=1.0, chat=True)


def check_trajectories(model, comps) -> None:
    """Every model token's logprob is our model's log p of it given the trajectory so far (T = 1, no warping), within
    TOL; observation tokens are mask 0 with logprob 0."""
    for c in comps:
        assert len(c.token_ids) == len(c.response_mask) == len(c.logprobs) <= 40
        ours = our_logprobs(model, c.prompt_token_ids + c.token_ids)[len(c.prompt_token_ids) - 1:]
        model_tokens = torch.tensor(c.response_mask, dtype=torch.bool)
        assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64)[model_tokens], ours[model_tokens],
                              atol=TOL)
        assert all(lp == 0.0 for lp, k in zip(c.logprobs, c.response_mask) if k == 0)


def test_tool_trajectories_on_vllm_keep_sampled_ids_mask_observations_and_logprobs(chat_folder):
    """agent.tools on rollout.backend=vllm: the agent's turn loop over vLLM's engine (rollout/vllm/turns.py).
    A near-uniform tiny chat model (LM head scale 1, 64 words) writes `</calc>` with probability ~1/64 a token, so
    over 16 trajectories of 40 tokens some turns end at a call (P(none) < 1e-4). Every model token's logprob is our
    model's log p of it given the trajectory so far (T = 1, no warping), within TOL; observation tokens are mask 0."""
    from tailrl.engine import SamplingParams
    from tailrl.config.agent import AgentConfig
    from tailrl.rollout.base import requests_of
    from tailrl.rollout.turns import TurnLoop
    from tailrl.rollout.vllm.turns import VllmTurns
    folder = chat_folder
    llm = make_llm(folder, "float32", seed=0, max_model_len=256, max_num_seqs=16)
    model, tok = load_model(folder, device="cpu", dtype=torch.float32)
    loop = TurnLoop(AgentConfig(tools=["calculator"], max_turns=3), tok)
    msgs = [[{"role": "user", "content": f"{a} + {b}"}] for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))]
    prompts = [loop.encode_prompt(m) for m in msgs]
    params = [SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=11 + i) for i in range(4)]
    try:
        comps, _, m, _ = loop.run(VllmTurns(llm), requests_of(prompts, params, msgs))
    finally:
        loop.close()
    assert len(comps) == 16 and m["agent/tool_calls"] > 0 and any(c.trajectory["turns"] > 1 for c in comps)
    check_trajectories(model, comps)


def test_two_ray_actors_run_the_turn_loop_each_on_its_prompts(chat_folder):
    """agent.tools with rollout.backend=vllm and rollout.workers=2: each actor runs its prompts' trajectories to their
    end (VllmActor.run, rollout/remote.py); they come back in (prompt, sample) order, from both actors, with tool
    calls, masked observations and our model's logprobs of the model's tokens (a trajectory merged under the wrong
    prompt would not match)."""
    from types import SimpleNamespace

    import ray

    from tailrl.config import load_config
    from tailrl.rollout.vllm.rollout import VllmRollout

    cfg = load_config(overrides=[f"model.path={chat_folder}", "rollout.workers=2", "rollout.n=4", "rollout.max_tokens=40",
                                 "rollout.temperature=1.0", "rollout.top_k=0", "rollout.top_p=1.0",
                                 "rollout.vllm_spec=off", "rollout.max_num_seqs=16", "data.max_prompt_tokens=64",
                                 "agent.tools=[calculator]", "agent.max_turns=3"])
    model, tok = load_model(chat_folder, device="cpu", dtype=torch.float32)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        ro = VllmRollout(cfg, model, tok)
        try:
            questions = [f"{a} + {b}" for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))]
            examples = [SimpleNamespace(prompt=q, ids=ro.encode([{"role": "user", "content": q}])) for q in questions]
            comps = ro.generate(examples, 0, None, 0.0)
            m = ro.metrics()
        finally:
            ro.close()
    finally:
        ray.shutdown()
    assert [(c.prompt_index, c.sample_index) for c in comps] == [(i, j) for i in range(4) for j in range(4)]
    assert all(c.prompt_token_ids[: len(examples[c.prompt_index].ids)] == examples[c.prompt_index].ids for c in comps)
    assert m["agent/tool_calls"] > 0 and any(c.trajectory["turns"] > 1 for c in comps)
    check_trajectories(model, comps)
