"""The agent's turn loop on rollout workers (rollout/remote.py): each worker runs its prompts' trajectories to their
end, and on the batch-invariant engine the split changes nothing: the very trajectories one engine draws."""

import pytest
import torch

from tailrl.cluster.rollout import ClusterRollout
from tailrl.cluster.workers import WorkerSpec
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import load_model
from tailrl.config.agent import AgentConfig
from tailrl.rollout.base import requests_of
from tailrl.rollout.remote import cluster_agent_rollout, split
from tailrl.rollout.turns import TurnLoop
from tailrl.speculative.config import SpecConfig
from tailrl.model.tiny import TOOL_WORDS, make_tiny_chat_model


def test_prompts_split_round_robin_and_cover_every_prompt():
    assert split(5, 2) == [[0, 2, 4], [1, 3]] and split(1, 3) == [[0], [], []]


@pytest.mark.slow  # two in-process workers' engines and tool rollouts: ~40 s on 2 loaded cores
def test_two_workers_draw_the_trajectories_one_engine_draws(tmp_path):
    folder = str(make_tiny_chat_model(tmp_path / "toolchat", seed=3, words=TOOL_WORDS))
    engine_cfg = EngineConfig(kv_cache_gb=0.2, batch_invariant=True, seed=0, spec=SpecConfig(mode="ngram", min_match=1))
    cfg = AgentConfig(tools=["calculator"], max_turns=3)
    msgs = [[{"role": "user", "content": f"{a} + {b} ?"}] for a, b in ((1, 2), (3, 4), (5, 6))]
    params = [SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=11 + i) for i in range(3)]
    model, tok = load_model(folder, device="cpu", dtype=torch.float32)
    loop = TurnLoop(cfg, tok)
    prompts = [loop.encode_prompt(m) for m in msgs]
    try:
        one, _, m_one, _ = loop.run(Engine(model, tok, engine_cfg), requests_of(prompts, params, msgs))
    finally:
        loop.close()
    threads = torch.get_num_threads()
    cluster = ClusterRollout(WorkerSpec(model=folder, engine=engine_cfg, dtype="float32"), 2, local=True)
    try:
        two, m_two = cluster_agent_rollout(cluster, cfg, requests_of(prompts, params, msgs))
    finally:
        cluster.shutdown()
        torch.set_num_threads(threads)  # an in-process worker sets its thread count for the whole process
    assert m_one["agent/tool_calls"] > 0
    assert [(c.prompt_index, c.sample_index) for c in two] == [(c.prompt_index, c.sample_index) for c in one]
    assert [c.token_ids for c in two] == [c.token_ids for c in one]
    assert [c.response_mask for c in two] == [c.response_mask for c in one]
    assert abs(m_two["agent/tool_calls"] - m_one["agent/tool_calls"]) < 1e-9
    assert abs(m_two["agent/masked_share"] - m_one["agent/masked_share"]) < 1e-12  # a share of all tokens
    assert two.stats.generated_tokens == one.stats.generated_tokens
