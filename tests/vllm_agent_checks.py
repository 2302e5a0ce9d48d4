"""agent.tools on rollout.backend=vllm (rl/rollout/vllm/turns.py) with a tiny chat model vLLM's CPU kernels take. Run by
tests/test_vllm.py in a process of its own (one more LLM in vllm_checks.py's process spins or fails in vLLM 0.32)."""

import os

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from tailrl.model import load_model  # noqa: E402
from tailrl.rl.rollout.vllm.llm import make_llm  # noqa: E402
from tests.conftest import make_tiny_vllm_model as make_folder  # noqa: E402
from tests.vllm_checks import TOL, our_logprobs  # noqa: E402


def test_tool_trajectories_on_vllm_keep_sampled_ids_mask_observations_and_logprobs(tmp_path_factory):
    """agent.tools on rollout.backend=vllm: the agent's turn loop over vLLM's engine (rl/rollout/vllm/turns.py).
    A near-uniform tiny chat model (LM head scale 1, 64 words) writes `</calc>` with probability ~1/64 a token, so
    over 16 trajectories of 40 tokens some turns end at a call (P(none) < 1e-4). Every model token's logprob is our
    model's log p of it given the trajectory so far (T = 1, no warping), within TOL; observation tokens are mask 0."""
    from tailrl.engine import SamplingParams
    from tailrl.rl.agent.config import AgentConfig
    from tailrl.rl.agent.loop import AgentLoop
    from tailrl.rl.rollout.vllm.turns import VllmTurns
    from tests.conftest import VLLM_TOOL_WORDS

    folder = make_folder(tmp_path_factory.mktemp("tiny_vllm_chat"), VLLM_TOOL_WORDS, scale=1.0, chat=True)
    llm = make_llm(folder, "float32", seed=0, max_model_len=256, max_num_seqs=16)
    model, tok = load_model(folder, device="cpu", dtype=torch.float32)
    loop = AgentLoop(AgentConfig(tools=["calculator"], max_turns=3), tok)
    msgs = [[{"role": "user", "content": f"{a} + {b}"}] for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))]
    prompts = [loop.encode_prompt(m) for m in msgs]
    params = [SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=11 + i) for i in range(4)]
    try:
        comps, _, m = loop.run(VllmTurns(llm), prompts, msgs, params)
    finally:
        loop.close()
    assert len(comps) == 16 and m["agent/tool_calls"] > 0 and any(c.trajectory["turns"] > 1 for c in comps)
    for c in comps:
        assert len(c.token_ids) == len(c.response_mask) == len(c.logprobs) <= 40
        ours = our_logprobs(model, c.prompt_token_ids + c.token_ids)[len(c.prompt_token_ids) - 1:]
        model_tokens = torch.tensor(c.response_mask, dtype=torch.bool)
        assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64)[model_tokens], ours[model_tokens],
                              atol=TOL)
        assert all(lp == 0.0 for lp, k in zip(c.logprobs, c.response_mask) if k == 0)
