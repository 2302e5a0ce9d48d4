"""Partial rollouts with tools (rollout/partial.py's, for trajectories): a trajectory carried over a step boundary
mid-turn or at a tool call, as plain data, and resumed where it stopped.

Invariants:
- the clock is the policy's own tokens (mask 1, `drawn`): observation and template tokens are not drawn, they come
  with their call. A trajectory's first T tokens drawn in a rollout do not depend on its batch, on speculation or
  on when its tools answered (tool_turns.py), so where a rollout stops is the same for every run at the same seeds;
- a carried trajectory is cut right after its T-th drawn token (`TrajState.cut`): mid-turn, its turn's tokens so
  far are kept, and when it resumes the engine re-prefills its prompt, its earlier turns and those tokens and
  draws on from the next position, keyed by (turn seed, position) as the uninterrupted turn would (the single-turn
  path's export/import: recomputed, no K/V travels); at a tool call, the trajectory is carried with the call's
  observation appended and resumes at its next turn. The call ran in the rollout that drew it: a rollout that
  stops waits for the calls still running (ToolTurns.stop). So a call drawn within the horizon runs exactly once (a
  tool with side effects or a cost is never called twice for it; one drawn past it goes with the tokens the cut
  drops, and is drawn again at the resume), nothing pending has to go into a checkpoint, and whether a trajectory
  ends at its call (no room left for the observation) is decided before the cut, whatever the tool's timing;
- every token of a carried trajectory keeps its logprob and, in the buffer, the version of the rollout that drew
  (or, for an observation, appended) it; the update's mask keeps observation tokens out of the loss and the
  staleness metrics (partial.staleness)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from ..agent.pool import ToolCall, ToolResult
from ..agent.trajectory import Trajectory, Turn
from ..engine.requests import SeqState


@dataclass
class TrajState(SeqState):
    """A carried trajectory. output_ids / logprobs: all its tokens so far, model and observation, as the Completion
    of the finished trajectory will hold them; `trajectory`: {"mask": 1 on drawn tokens, "turns": its completed
    turns, "start": where its current turn's tokens begin in output_ids}. prompt_ids, params (the request's, n=1),
    seed (the sample's: turn k draws from turn_seed(seed, k)), max_tokens and stop_ids are its first turn's (a
    restart starts from them); the engine never imports one: the turn loop makes its current turn a request."""

    trajectory: dict = field(default_factory=dict)

    @property
    def drawn(self) -> int:
        return sum(self.trajectory["mask"])

    def cut(self, n: int) -> TrajState:
        """This trajectory cut right after its n-th drawn token, with the observation that follows that token when
        its turn ended at a call (a finished trajectory's last turn, cut, becomes its current turn)."""
        mask = self.trajectory["mask"]
        if sum(mask) <= n:
            return self
        idx = seen = 0
        while seen < n:
            seen += mask[idx]
            idx += 1
        while idx < len(mask) and mask[idx] == 0:
            idx += 1
        turns = self.trajectory["turns"]
        kept = [t for t in turns if t["end"] <= idx]
        start = turns[len(kept)]["start"] if len(kept) < len(turns) else self.trajectory["start"]
        return dataclasses.replace(self, output_ids=self.output_ids[:idx], logprobs=self.logprobs[:idx],
                                   trajectory={"mask": mask[:idx], "turns": kept, "start": start})


def carried(origin: SeqState, tr: Trajectory, out_ids=(), out_lps=()) -> TrajState:
    """A trajectory's state: its completed turns and its current turn's tokens so far (out_ids, none at a call's
    observation). origin: the state its first turn came from (label, sample, the request's params)."""
    return TrajState(origin.prompt_index, origin.sample_index, list(tr.prompt_ids), tr.ids + list(out_ids),
                     tr.logprobs + list(out_lps), origin.params, tr.seed, origin.max_tokens, list(origin.stop_ids),
                     trajectory={"mask": tr.mask + [1] * len(out_ids), "turns": [_turn_dict(t) for t in tr.turns],
                                 "start": len(tr.ids)})


def resumed(st: SeqState, messages: list[dict]) -> tuple[Trajectory, list[int], list[float]]:
    """(the trajectory of its completed turns, its current turn's tokens and logprobs so far) from a carried state;
    a plain SeqState (a response not begun, or restarted) is a trajectory at its first turn."""
    d = getattr(st, "trajectory", None) or {"mask": [1] * len(st.output_ids), "turns": [], "start": 0}
    s = d["start"]
    tr = Trajectory(st.prompt_index, st.sample_index, st.seed, list(st.prompt_ids), list(messages),
                    ids=list(st.output_ids[:s]), mask=list(d["mask"][:s]), logprobs=list(st.logprobs[:s]),
                    turns=[_turn_from(t) for t in d["turns"]])
    return tr, list(st.output_ids[s:]), list(st.logprobs[s:])


def state_from(d: dict) -> SeqState:
    """A checkpoint's state dict (partial._state_dict) as the state it was: a TrajState where it holds a trajectory."""
    return TrajState(**d) if d.get("trajectory") is not None else SeqState(**d)


def _turn_dict(t: Turn) -> dict:
    # a call's arguments as JSON text: the model wrote them, and any key must survive the checkpoint's JSON
    return {"text": t.text, "start": t.start, "end": t.end, "observation": [dict(m) for m in t.observation],
            "calls": [[c.name, json.dumps(c.arguments), c.error] for c in t.calls],
            "results": [[r.text, r.status, r.seconds] for r in t.results]}


def _turn_from(d: dict) -> Turn:
    return Turn(d["text"], [ToolCall(n, json.loads(a), e) for n, a, e in d["calls"]],
                [ToolResult(x, s, float(sec)) for x, s, sec in d["results"]], [dict(m) for m in d["observation"]],
                int(d["start"]), int(d["end"]))
