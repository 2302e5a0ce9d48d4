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
  (model and observation tokens together, as TRL's max_completion_length) has no room for the next observation;
- partial rollouts (tool_partial.py): a run may start from carried trajectories (`carry_in`) and stop early (`stop`:
  the calls in flight answer first), its unfinished trajectories carried mid-turn or after a call's observation
  (`carry_out`), each resuming exactly where it stopped."""

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
from ..engine.requests import SeqState
from ..engine.tail import tail_size
from .tool_partial import carried, resumed

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
        self.reset()

    def reset(self) -> None:
        """A run starts. Its state: its trajectories and the state each began from (label, sample, the request's
        params), the trajectory and params of each sequence in the engine, the tool calls in flight (future ->
        (trajectory, the next turn's params, calls)), and after a stop the turns taken out of the engine."""
        self.trajs: list[Trajectory] = []
        self.origins: list[SeqState] = []
        self.owner: dict[int, tuple[Trajectory, SamplingParams]] = {}
        self.pending: dict = {}
        self.current: dict[int, SeqState] = {}  # id(trajectory) -> its turn as exported at the stop

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
        """One trajectory per sample of each request (sample j of a seeded request draws its turns from seed + j),
        owning its turn-0 sequence, labelled as the request is (its place in the batch without a label)."""
        k = 0
        for i, (q, p) in enumerate(zip(requests, params)):
            label = i if q.label is None else q.label
            for j in range(p.n):
                seed = (p.seed + j) if p.seed is not None else hash((i, j, t0)) % (1 << 62)
                tr = Trajectory(label, j, seed, list(q.ids), list(q.messages), seq_id=ids[k])
                self.trajs.append(tr)
                self.origins.append(SeqState(label, j, list(q.ids), [], [], dataclasses.replace(q.params, n=1), seed,
                                             q.params.max_tokens, list(q.params.stop_token_ids)))
                self.owner[ids[k]] = (tr, dataclasses.replace(p, n=1, seed=None))
                k += 1

    def carry_in(self, engine, states: list, messages: list) -> list[int]:
        """Carried trajectories (tool_partial.TrajState, or states not begun: a first turn) re-enter, each at its
        current turn: the request _resume would make of its ids so far, whose tokens so far (a turn cut mid-way)
        go back in through export / import_, so the turn draws on from the next position as it would have. messages:
        each state's prompt as chat messages. Returns their sequence ids."""
        ids = []
        for st, msgs in zip(states, messages):
            tr, out, lps = resumed(st, msgs)
            p = dataclasses.replace(self.first_params([st.params])[0], n=1, seed=None, resume=None)
            k = len(tr.turns)
            nxt = dataclasses.replace(p, max_tokens=p.max_tokens - len(tr.ids), seed=turn_seed(tr.seed, k),
                                      history=(tr.prompt_ids, k) if k else p.history)
            (sid,) = engine.add_requests([tr.prompt_ids + tr.ids], nxt)
            if out and sid in engine.unfinished_ids():  # (a rejected request ends its trajectory at the next step)
                (fresh,) = engine.export([sid])
                (sid,) = engine.import_([dataclasses.replace(fresh, output_ids=out, logprobs=lps)])
            tr.seq_id = sid
            self.owner[sid] = (tr, p)
            self.trajs.append(tr)
            self.origins.append(st)
            ids.append(sid)
        return ids

    def running(self, lens: dict[int, int]) -> list[tuple[int, int, int]]:
        """(label, sample, drawn tokens so far) of every unfinished trajectory (a partial rollout's Horizon reads
        them); lens: the tokens so far of the engine's unfinished sequences by id."""
        return ([(tr.prompt_index, tr.sample_index, tr.drawn + lens.get(sid, 0)) for sid, (tr, _) in self.owner.items()]
                + [(tr.prompt_index, tr.sample_index, tr.drawn) for tr, _, _ in self.pending.values()])

    def movable(self, lens: dict[int, int]) -> list[tuple[int, int, int, int, int]]:
        """(label, sample, context, current turn's tokens, drawn tokens) of every trajectory whose turn is in the
        engine (one waiting on its call is not: the call runs here): what a driver may move (`hand_over`)."""
        return [(tr.prompt_index, tr.sample_index, len(tr.prompt_ids) + len(tr.ids), lens[sid], tr.drawn + lens[sid])
                for sid, (tr, _) in self.owner.items() if sid in lens]

    def hand_over(self, engine, keys: list[tuple[int, int]]) -> list:
        """These trajectories (label, sample) leave this run mid-rollout, for another worker's (the driver's
        reallocation, remote_partial.py): each comes out of the engine with its current turn's tokens so far, as the
        carried state a stop would give (tool_partial.carried, never cut), so the importer re-prefills it and draws
        on from the next position with the turn's seed: the very tokens it would have drawn here. Any that is not in
        the engine now (its call running, or it ended) stays."""
        want, live = set(keys), set(engine.unfinished_ids())
        sids = [sid for sid, (tr, _) in self.owner.items()
                if sid in live and (tr.prompt_index, tr.sample_index) in want]
        out = []
        for sid, st in zip(sids, engine.export(sids)):
            tr, p = self.owner.pop(sid)
            i = next(i for i, x in enumerate(self.trajs) if x is tr)
            origin = self.origins.pop(i)
            del self.trajs[i]
            if self.cfg.keep_kv and p.resume is not None:  # the K/V this turn continued from stays here: freed
                engine.drop_kept([p.resume])
            out.append(carried(origin, tr, st.output_ids, st.logprobs))
        return out

    def stop(self, engine) -> None:
        """The rollout stops early: the calls still running answer first and their observations go in (a call runs
        once, in the rollout that drew it), then every turn left in the engine comes out with its tokens so far."""
        while self.pending:
            wait(list(self.pending))
            self.resume_ready(engine, False)
        sids = [i for i in engine.unfinished_ids() if i in self.owner]
        for sid, st in zip(sids, engine.export(sids)):
            self.current[id(self.owner.pop(sid)[0])] = st
        if self.owner and engine.has_work():  # turns the engine rejected at their start: their errors end them
            for c in engine.step().finished:
                self.end_turn(engine, c)
        now = time.perf_counter()
        for tr in self.trajs:
            tr.t_done = tr.t_done if tr.finish_reason is not None else now

    def carry_out(self, limit) -> tuple[list[tuple[Trajectory, Completion]], list]:
        """After `stop`: (the trajectories that finished within the horizon, each with its Completion; the rest as
        carried states cut at it). limit(label, sample) -> the drawn tokens that trajectory keeps (None: all;
        rollout/partial.py's Horizon.limit)."""
        done, left = [], []
        for tr, origin in zip(self.trajs, self.origins):
            n = limit((tr.prompt_index, tr.sample_index)) if limit is not None else None
            if tr.finish_reason is not None and (n is None or tr.drawn <= n):
                done.append((tr, self._completion(tr)))
                continue
            cur = self.current.get(id(tr))
            st = carried(origin, tr, cur.output_ids if cur else (), cur.logprobs if cur else ())
            left.append(st.cut(n) if n is not None else st)
        return done, left

    def resume_ready(self, engine, lock_step: bool) -> list[Completion]:
        """Trajectories whose tools answered re-enter the engine (lock_step: only once every turn in flight has
        ended and every tool has answered); returns those that ended there instead (no room for the observation)."""
        ready = [f for f in self.pending if f.done()]
        if lock_step and (engine.has_work() or len(ready) < len(self.pending)):
            return []
        ended = []
        for fut in ready:
            tr, p, calls = self.pending.pop(fut)
            if not self._resume(engine, tr, p, calls, fut.result()):
                ended.append(self._completion(tr))
                if self.cfg.keep_kv:
                    engine.drop_kept([p.resume])
        return ended

    def wait(self, lock_step: bool, timeout: float | None = None) -> None:
        """Nothing left to decode: block on the pool (the first answer, or all of them with lock_step), at most
        `timeout` seconds (a worker's round ends on time while its tools run on)."""
        if self.pending:
            wait(list(self.pending), timeout, ALL_COMPLETED if lock_step else FIRST_COMPLETED)

    def end_turn(self, engine, c: Completion) -> Completion | None:
        """A turn finished: its calls go to the pool, or its trajectory ends (and its kept K/V is dropped); returns
        the trajectory's Completion when it ended."""
        tr, p = self.owner.pop(c.seq_id)
        calls = self._end_turn(tr, c)
        if calls:  # the next turn continues this one's parked KV (if the engine kept it)
            self.pending[self.pool.submit(self.tools, calls)] = (tr, dataclasses.replace(p, resume=c.seq_id), calls)
            return None
        if self.cfg.keep_kv:  # the trajectory ended: this turn's K/V, and the last one's if this turn never took it
            engine.drop_kept([c.seq_id, p.resume])
        return self._completion(tr)

    def result(self, stats, t0: float, kept_tokens: int, ended: list | None = None) -> tuple[Completions, dict]:
        """(one Completion per trajectory in (prompt, sample) order, the agent/* metrics); kept_tokens: positions
        the run's resumed turns did not prefill. ended: a partial rollout's trajectories that finished within its
        horizon, which the metrics are over (so they do not depend on how far past it the rollout ran, nor count a
        trajectory carried now and ended again later)."""
        trajs = self.trajs
        comps = Completions(self._completion(tr) for tr in trajs)
        comps.stats = stats
        self.last = trajs
        metrics = self._metrics(ended if ended is not None else trajs, t0, stats.total_s)
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
        if self.cfg.strict_tokens:  # (a carried trajectory's conversation is unclosed: it has none yet)
            m["agent/token_drift"] = sum(self._drifts(tr) for tr in trajs if tr.finish_reason is not None) / n
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

