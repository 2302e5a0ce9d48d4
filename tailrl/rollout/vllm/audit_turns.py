"""The losslessness audit (speculative/audit.py) with tools: each arm's responses are whole trajectories, drawn by
the agent's turn loop (rollout/turns.py) over vLLM's engine (turns.py), our proposer drafting every turn when the
arm's LLM has it (a later turn from that turn of its prompt in earlier draws and from its siblings).

Lossless SD makes every model token a draw from the target given the trajectory so far, so each tool call, each
observation (a function of the calls) and the next turn are distributed as plain decoding's: the audit's
distribution tests read a trajectory as one response (its first output positions, its length in model and
observation tokens), and its token test scores every model token under the target in its full context, the
observation tokens (mask 0: not sampled) left out (speculative/impossible.py)."""

from __future__ import annotations

from ...config.agent import AgentConfig
from ...engine.sampling import SamplingParams
from ...speculative.audit import Response
from ..base import requests_of, step_seed


class TurnsSampler:
    """A Sampler (speculative/audit.py) of tool trajectories on a vllm.LLM: prompt i (its chat messages:
    messages[i]) gets n trajectories of at most max_tokens tokens (model and observation together, as
    rollout.max_tokens), sample j of it seeded step_seed(seed, 0, i) + j as a rollout seeds a group. Each draw is a
    rollout of its own: with our proposer its turns are history for the next (vllm/turns.py end_rollout), and its
    counters are kept in `counters`, one dict per draw."""

    def __init__(self, llm, proposer: bool, agent: AgentConfig, tokenizer, messages: list[list[dict]]):
        self.llm, self.proposer, self.agent, self.tok, self.messages = llm, proposer, agent, tokenizer, messages
        self.counters: list[dict] = []

    def __call__(self, prompts, temperature, n, max_tokens, seed) -> list[list[Response]]:
        from ..turns import TurnLoop
        from .turns import VllmTurns

        params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=step_seed(seed, 0, i))
                  for i in range(len(prompts))]
        loop, engine = TurnLoop(self.agent, self.tok), VllmTurns(self.llm, self.proposer)
        try:
            comps = loop.run(engine, requests_of(prompts, params, self.messages)).completions
        finally:
            loop.close()
        engine.end_rollout(comps.stats)
        if engine.spec is not None:
            self.counters.append(engine.spec)
        out = [[] for _ in prompts]
        for c in comps:
            out[c.prompt_index].append(Response(c.token_ids, c.logprobs, c.response_mask))
        return out
