"""Multi-turn tool rollouts on vLLM: the `StepEngine` calls (rollout/base.py) the turn loop (rollout/turns.py)
makes of our engine, answered by vLLM's own LLMEngine, so the same loop runs on both backends.

Each turn is a request (add_request / step): a trajectory that stops at a tool call leaves vLLM's batch, its tool
runs in the loop's pool while vLLM keeps stepping the others, and it comes back as a new request of all its ids so
far plus the observation, whose earlier turns vLLM's prefix cache holds (no lock-step; prefix caching is what
keeps the KV of earlier turns here). Token in, token out as on our engine: the loop keeps the sampled ids and the
logprobs vLLM reports for them (the warped distribution's, llm.make_llm).

Our history proposer (proposer.py) inside the LLM: each request's prompt goes to it before the request goes in, with
the (prompt, turn) the turn loop names for turn k >= 1 (SamplingParams.history), so a later turn drafts from turn
k of the same prompt in earlier epochs and from its siblings' turn k, as our engine's history drafter does;
`end_rollout` makes the rollout's turns history and reads its counters into the rollout's stats.

Seeds: each sample is a request of its own with its own seed (turn k of sample j draws from turn_seed(seed + j,
k), the loop's), so a trajectory is reproducible on vLLM whatever its batch composition allows, and comparable
run to run; vLLM's kernels are not batch-invariant, so (unlike our engine) it need not equal another batch's draw
bit for bit."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from ...engine.sampling import SamplingParams
from ...engine.sequence import Completion
from ...engine.stats import Collector, StepRecord


@dataclass
class TurnStep:
    finished: list[Completion]
    record: StepRecord


class VllmTurns:
    """The `StepEngine` (rollout/base.py) over a vllm.LLM's engine, returning our `Completion`s. vLLM's prefix
    cache keeps the K/V of earlier turns, so there is nothing parked to drop (keep_kv and resume are ignored);
    export/import_ (partial rollouts) are not built on vLLM yet. proposer: the LLM drafts with our proposer."""

    _ids = itertools.count(1)

    def __init__(self, llm, proposer: bool = False):
        self.llm, self.engine, self.proposer = llm, llm.llm_engine, proposer
        self.spec: dict | None = None  # our proposer's counters of the last rollout (end_rollout)
        self.live: dict[str, tuple[int, int, int, list[int]]] = {}  # request id -> (seq id, prompt, sample, prompt ids)
        self.seen: dict[str, int] = {}  # request id -> tokens reported so far

    def add_requests(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                     prompt_indices: list[int] | None = None) -> list[int]:
        """One vLLM request per sample (seed + j for sample j, as our engine seeds a group's samples)."""
        from vllm import SamplingParams as VP

        params = params if isinstance(params, list) else [params] * len(prompts)
        labels = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
        if self.proposer:
            from .proposer import push_prompts

            self.llm.collective_rpc(push_prompts, args=([list(q) for q in prompts], [p.history for p in params]))
        ids = []
        for i, prompt, p in zip(labels, prompts, params):
            for j in range(p.n):
                sid = next(self._ids)
                rid = f"turn-{sid}"
                greedy = p.temperature == 0
                vp = VP(n=1, temperature=p.temperature, top_p=1.0 if greedy else p.top_p,
                        top_k=0 if greedy else p.top_k, max_tokens=p.max_tokens,
                        stop=list(p.stop) or None, stop_token_ids=list(p.stop_token_ids) or None,
                        include_stop_str_in_output=True, ignore_eos=p.ignore_eos, logprobs=0,
                        seed=None if p.seed is None else p.seed + j)
                self.engine.add_request(rid, {"prompt_token_ids": list(prompt)}, vp)
                self.live[rid] = (sid, i, j, list(prompt))
                ids.append(sid)
        return ids

    @property
    def tokenizer(self):
        return self.llm.get_tokenizer()

    def has_work(self) -> bool:
        return bool(self.live)

    def step(self) -> TurnStep:
        t0 = time.perf_counter()
        running = len(self.live)
        outs = self.engine.step()
        emitted, done = 0, []
        for out in outs:
            if out.request_id not in self.live:
                continue
            o = out.outputs[0]
            emitted += len(o.token_ids) - self.seen.get(out.request_id, 0)
            self.seen[out.request_id] = len(o.token_ids)
            if out.finished:
                sid, i, j, prompt = self.live.pop(out.request_id)
                self.seen.pop(out.request_id, None)
                ids = list(o.token_ids)
                lps = [float(d[t].logprob) for t, d in zip(ids, o.logprobs)] if o.logprobs else [0.0] * len(ids)
                reason = {"stop": "stop", "length": "length"}.get(o.finish_reason, "error")
                done.append(Completion(sid, i, j, prompt, ids, o.text, lps, reason,
                                       None if reason != "error" else f"vLLM finish reason {o.finish_reason!r}"))
        s = time.perf_counter() - t0
        return TurnStep(done, StepRecord("decode", batch=running, emitted=emitted, total_s=s, forward_s=s))

    def collector(self, ids: list[int]) -> Collector:
        return Collector(ids)

    def unfinished_ids(self) -> list[int]:
        return [v[0] for v in self.live.values()]

    def export(self, ids: list[int]) -> list:
        raise NotImplementedError("partial rollouts on vLLM (export/import_ of its sequences): not built yet")

    def import_(self, states: list) -> list[int]:
        if states:
            raise NotImplementedError("partial rollouts on vLLM (export/import_ of its sequences): not built yet")
        return []

    def drop_kept(self, ids: list[int]) -> None:
        pass  # nothing parked: vLLM's prefix cache holds earlier turns

    @property
    def kept_tokens(self) -> int:
        return 0

    def end_rollout(self, stats=None) -> None:
        """With our proposer: the rollout's turns become its history, and its counters go into stats (a
        GenerateStats: drafters["history"], draft_s) and `spec`."""
        if not self.proposer:
            return
        from .io import history_counts
        from .proposer import end_rollout

        self.spec = self.llm.collective_rpc(end_rollout)[0]
        if stats is not None:
            stats.draft_s += self.spec["draft_s"]
            stats.drafters["history"] = history_counts(self.spec, stats.generated_tokens)
