"""A trajectory's turns, for the turn loop (turns.py) with tools: the first turn's params (the format's stop strings,
kept K/V), each finished turn parsed for tool calls that go to the pool, each answer turned into the next turn's
request (its ids so far + the observation), and the trajectories as Completions with their agent/* metrics.

Invariants:
- a trajectory's tokens do not depend on when its tools answered or what it was batched with: turn k of sample j
  draws from `turn_seed(seed + j, k)` by position in that turn, and on the batch-invariant engine a request's tokens
  do not depend on its batch, so speculation on and off give the very same trajectories, tool calls included;
- the engine sees plain requests (it never imports agent/); a returning trajectory's prompt is all its ids. With
  agent.keep_kv a turn that stops at a call asks the engine to park its KV (SamplingParams.keep_kv) and the next
  turn names it (resume): only the observation and template tokens are prefilled. Parked KV is the first thing the
  engine frees under memory pressure (then the turn prefills all its ids), and it is dropped the moment its
  trajectory ends; on the batch-invariant engine both ways give the same bits, so the tokens do not depend on it;
- speculation across turns: turn k's request names (prompt, k) as its history key (SamplingParams.history), so the
  history drafter drafts it from turn k of the same prompt in earlier epochs and from its siblings' turn k now, not
  from whole-trajectory prompts that differ from epoch to epoch; the ngram drafter copies tool outputs and earlier
  calls from the request's own ids;
- a trajectory ends at EOS, at a turn without a tool call, after agent.max_turns turns, or when rollout.max_tokens
  (model and observation tokens together, as TRL's max_completion_length) has no room for the next observation."""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, wait

from ..agent.formats import make_format
from ..agent.pool import ToolPool
from ..agent.toolbox import load_tools
from ..agent.trajectory import ChatDelta, Trajectory, drift, turn_seed
from ..config.agent import AgentConfig
from ..engine import Completion, Completions, SamplingParams
from ..engine.tail import tail_size

log = logging.getLogger(__name__)


class ToolTurns:
    def __init__(self, cfg: AgentConfig, tokenizer, tools: dict | None = None):
        """tools: loaded tools by name (None: load cfg.tools; a spec that does not load is a ValueError naming it)."""
        if tokenizer is None:
            raise ValueError("agent.tools needs a tokenizer with a chat template; this model has none")
        self.cfg, self.tok = cfg, tokenizer
        self.tools = tools if tools is not None else load_tools(cfg.tools)
        self.fmt = make_format(cfg.format, self.tools)
        self.delta = ChatDelta(tokenizer, self.fmt.template_kwargs())
        self.pool = ToolPool(cfg.max_parallel_calls, cfg.tool_timeout_s, None)
        self.eos = {tokenizer.eos_token_id}
        self._warned_drift = False
        self.last: list[Trajectory] = []
        # one run's state: its trajectories, the trajectory and params of each sequence in the engine, and the
        # tool calls in flight (future -> (trajectory, the next turn's params, calls))
        self.trajs: list[Trajectory] = []
        self.owner: dict[int, tuple[Trajectory, SamplingParams]] = {}
        self.pending: dict = {}

    def encode_prompt(self, messages: list[dict]) -> list[int]:
        """A prompt's ids as the format shows tools (hermes: the schemas through the chat template)."""
        ids = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                           **self.fmt.template_kwargs())
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def close(self) -> None:
        self.pool.close()

    def first_params(self, params: list[SamplingParams]) -> list[SamplingParams]:
        """Turn 0's params: the format's stop strings added, K/V kept at a call with agent.keep_kv."""
        return [dataclasses.replace(p, stop=list(p.stop) + self.fmt.stop, keep_kv=self.cfg.keep_kv) for p in params]

    def begin(self, requests: list, params: list[SamplingParams], ids: list[int], t0: float) -> None:
        """A run starts: one trajectory per sample of each request (sample j of a seeded request draws its turns
        from seed + j), owning its turn-0 sequence."""
        self.trajs, self.owner, self.pending = [], {}, {}
        k = 0
        for i, (q, p) in enumerate(zip(requests, params)):
            for j in range(p.n):
                seed = (p.seed + j) if p.seed is not None else hash((i, j, t0)) % (1 << 62)
                tr = Trajectory(i, j, seed, list(q.ids), list(q.messages), seq_id=ids[k])
                self.trajs.append(tr)
                self.owner[ids[k]] = (tr, dataclasses.replace(p, n=1, seed=None))
                k += 1

    def resume_ready(self, engine, lock_step: bool) -> None:
        """Trajectories whose tools answered re-enter the engine (lock_step: only once every turn in flight has
        ended and every tool has answered)."""
        ready = [f for f in self.pending if f.done()]
        if lock_step and (engine.has_work() or len(ready) < len(self.pending)):
            return
        for fut in ready:
            tr, p, calls = self.pending.pop(fut)
            if not self._resume(engine, tr, p, calls, fut.result()) and self.cfg.keep_kv:
                engine.drop_kept([p.resume])

    def wait(self, lock_step: bool) -> None:
        """Nothing left to decode: block on the pool (the first answer, or all of them with lock_step)."""
        if self.pending:
            wait(list(self.pending), return_when=ALL_COMPLETED if lock_step else FIRST_COMPLETED)

    def end_turn(self, engine, c: Completion) -> None:
        """A turn finished: its calls go to the pool, or its trajectory ends (and its kept K/V is dropped)."""
        tr, p = self.owner.pop(c.seq_id)
        calls = self._end_turn(tr, c)
        if calls:  # the next turn continues this one's parked KV (if the engine kept it)
            self.pending[self.pool.submit(self.tools, calls)] = (tr, dataclasses.replace(p, resume=c.seq_id), calls)
        elif self.cfg.keep_kv:  # the trajectory ended: this turn's K/V, and the last one's if this turn never took it
            engine.drop_kept([c.seq_id, p.resume])

    def result(self, stats, t0: float, kept_tokens: int) -> tuple[Completions, dict]:
        """(one Completion per trajectory in (prompt, sample) order, the agent/* metrics); kept_tokens: positions
        the run's resumed turns did not prefill."""
        trajs = self.trajs
        comps = Completions(self._completion(tr) for tr in trajs)
        comps.stats = stats
        self.last = trajs
        metrics = self._metrics(trajs, t0, stats.total_s)
        metrics["agent/kv_kept_tokens"] = kept_tokens / max(len(trajs), 1) if self.cfg.keep_kv else 0.0
        return comps, metrics

    def _end_turn(self, tr: Trajectory, c: Completion) -> list:
        """Appends a finished turn; returns the tool calls to run next (none: the trajectory has ended)."""
        text = self.tok.decode(c.token_ids, skip_special_tokens=True)
        tr.add_model(c.token_ids, c.logprobs, text)
        if c.finish_reason != "stop" or (c.token_ids and c.token_ids[-1] in self.eos):
            return self._finish(tr, c.finish_reason, c.error)
        calls = self.fmt.parse_calls(text)
        if not calls:
            return self._finish(tr, "stop")
        tr.turns[-1].calls = calls
        if len(tr.turns) >= self.cfg.max_turns:
            return self._finish(tr, "max_turns")
        return calls

    def _finish(self, tr: Trajectory, reason: str, error: str | None = None) -> list:
        tr.finish_reason, tr.error, tr.t_done = reason, error, time.perf_counter()
        return []

    def _resume(self, engine, tr: Trajectory, p: SamplingParams, calls: list, results: list) -> bool:
        """The tool answered: the observation's ids go in (mask 0) and the trajectory re-enters as a new request
        (p.resume: the finished turn's sequence, whose parked KV it continues). False: it ended here instead."""
        for r in results:
            r.text = self.delta.truncate(r.text, self.cfg.max_tool_tokens, self.cfg.truncate_side)
        turn = tr.turns[-1]
        turn.results = results
        obs = self.fmt.observation(results)
        join = self.delta.close_ids + self.delta.observation_ids(obs)
        room = p.max_tokens - len(tr.ids) - len(join)
        if room < 1:  # no room for the observation and a token after it: the trajectory ends at its call
            self._finish(tr, "length")
            return False
        turn.observation = obs
        tr.add_template(join)
        k = len(tr.turns)  # the next turn: history drafts from turn k of this prompt in earlier epochs and siblings
        nxt = dataclasses.replace(p, max_tokens=room, seed=turn_seed(tr.seed, k), history=(tr.prompt_ids, k))
        (sid,) = engine.add_requests([tr.prompt_ids + tr.ids], nxt)
        self.owner[sid] = (tr, p)
        return True

    def _completion(self, tr: Trajectory) -> Completion:
        reason = {"max_turns": "stop"}.get(tr.finish_reason, tr.finish_reason or "error")
        return Completion(tr.seq_id, tr.prompt_index, tr.sample_index, tr.prompt_ids, tr.ids, tr.model_text,
                          tr.logprobs, reason, tr.error, stats={"turns": len(tr.turns)}, response_mask=tr.mask,
                          trajectory=tr.record())

    def _metrics(self, trajs: list[Trajectory], t0: float, total_s: float) -> dict:
        """agent/*: per trajectory means, tool outcomes, the masked share, token drift and the tail by trajectory."""
        n = max(len(trajs), 1)
        results = [r for tr in trajs for t in tr.turns for r in t.results]
        status = [r.status for r in results]
        masked = sum(len(tr.mask) - sum(tr.mask) for tr in trajs)
        m = {"agent/turns": sum(len(tr.turns) for tr in trajs) / n, "agent/tool_calls": len(results) / n,
             "agent/tool_errors": sum(s not in ("ok", "timeout") for s in status),
             "agent/tool_timeouts": status.count("timeout"), "agent/tool_s": sum(r.seconds for r in results),
             "agent/masked_share": masked / max(sum(len(tr.mask) for tr in trajs), 1),
             "agent/max_turns_hit": sum(tr.finish_reason == "max_turns" for tr in trajs) / n}
        if self.cfg.strict_tokens:
            m["agent/token_drift"] = sum(self._drifts(tr) for tr in trajs) / n
        done = sorted(tr.t_done - t0 for tr in trajs)  # the tail by trajectory: the last quarter still unfinished
        k = len(done) - tail_size(len(done))
        m["agent/tail_share"] = (total_s - done[k - 1]) / total_s if 0 < k <= len(done) and total_s > 0 else 0.0
        return m

    def _drifts(self, tr: Trajectory) -> bool:
        at = drift(self.tok, tr, self.fmt.template_kwargs())
        if at is not None and not self._warned_drift:
            self._warned_drift = True
            ours = tr.prompt_ids + tr.ids
            log.warning("agent: trajectory ids differ from a re-tokenization of its conversation at position %d "
                        "(ours %s): training on re-tokenized text would train on tokens the policy never sampled; "
                        "the trainer uses the ids as sampled (agent/token_drift counts these)", at, ours[at:at + 5])
        return at is not None

