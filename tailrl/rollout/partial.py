"""Partial rollouts (APRIL, arXiv 2509.18521; Kimi k1.5's partial rollouts; verl's fully-async `partial_rollout`):
a step launches `rollout.partial_oversample` x the groups it needs, ends its rollout once enough groups are complete,
and carries the unfinished responses into the next step, where they continue under the new weights.

The buffer holds the groups in flight across steps: per response its tokens so far, the logprob each token was drawn
with, and the policy version that drew it (`versions`, one per token). Version v is the policy the rollout of
step v+1 samples from (v updates applied). A token trained by the update of version u has staleness u - v.

Invariants:
- A group is trained whole, once all `rollout.n` of its responses finished (GRPO's mean and std stay exact).
- Where a rollout stops is counted in tokens drawn in it, never in engine steps (`Horizon`): it stops at the
  fewest tokens T at which `need` groups are complete, and every response keeps exactly the tokens it drew up to T.
  A tool trajectory's drawn tokens are its model's (mask 1; its observations come with their calls): it is cut
  mid-turn or at a call and resumes there (rollout/tool_partial.py).
  Speculation (several tokens a step, by acceptance), batching, preemption and Ray workers' rounds change how
  fast a rollout gets there, never what the step trains on or carries: a run is reproducible and resumes exactly.
- No trained token is more than `rollout.partial_max_staleness` versions old: before each rollout, a response whose
  oldest token would exceed it (finished or not) is restarted from its prompt with a fresh seed, its tokens dropped.
- Each token keeps the logprob of the policy that drew it (the engine's, under speculation too: lossless per token),
  which the update's truncated importance weight (`algo.tis_cap`) divides by.
- The buffer is plain data (ints, floats, lists): it is part of every checkpoint, so a resumed run continues the
  very responses the run that never stopped would have, under the same staleness bound."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from ..engine import SamplingParams
from ..engine.requests import SeqState
from .tool_partial import TrajState, state_from

RESTART_SALT = 7_919  # a restarted response's seed: seed * RESTART_SALT + version (never its old noise)


@dataclass
class Response:
    """One sample of a carried group: `state` is where it stands (continued by the engine while unfinished; its
    prompt, seed and sampling settings also restart it), `comp` the engine's Completion once it finished."""

    state: SeqState
    comp: object = None
    versions: list[int] = field(default_factory=list)  # the policy version of each token drawn so far

    @property
    def done(self) -> bool:
        return self.comp is not None

    @property
    def tokens(self) -> list[int]:
        return self.comp.token_ids if self.comp is not None else self.state.output_ids

    @property
    def drawn(self) -> int:
        return drawn(self.comp if self.comp is not None else self.state)


def drawn(x) -> int:
    """The tokens the policy drew in a response (a Completion or a state): all of them, or a trajectory's model
    tokens (mask 1)."""
    if isinstance(x, TrajState):
        return x.drawn
    mask = getattr(x, "response_mask", None)
    return sum(mask) if mask is not None else len(x.token_ids if hasattr(x, "token_ids") else x.output_ids)


@dataclass
class Group:
    gid: int  # unique in the run: the engine's prompt label
    index: int  # the prompt's row in the train set
    launched: int  # the version whose rollout launched it
    responses: list[Response]

    @property
    def complete(self) -> bool:
        return all(r.done for r in self.responses)

    @property
    def failed(self) -> bool:  # the engine rejected its prompt: the group is dropped whole
        return any(r.done and r.comp.finish_reason == "error" for r in self.responses)


class PartialBuffer:
    def __init__(self, n: int, max_staleness: int):
        self.n, self.max_staleness = n, max_staleness
        self.groups: list[Group] = []  # in launch order: the oldest complete groups are trained first
        self.next_gid = 0
        self.counts = dict.fromkeys(("restarted", "launched", "carried", "rejected", "drawn"), 0)

    # ---- before a rollout ---------------------------------------------------------------------------------

    def launch(self, index: int, prompt_ids: list[int], params: SamplingParams, version: int, start) -> Group:
        """A new group of n fresh responses (sample j draws from params.seed + j, as the engine's own groups);
        start(label, j, prompt_ids, params, seed) -> SeqState: the rollout's fresh state (its stop tokens, limits)."""
        g = Group(self.next_gid, index, version, [Response(state=start(self.next_gid, j, prompt_ids, params,
                                                                       params.seed + j)) for j in range(self.n)])
        self.next_gid += 1
        self.groups.append(g)
        self.counts["launched"] += 1
        return g

    def restart_stale(self, version: int) -> int:
        """Responses whose oldest token would be trained more than max_staleness versions late start over."""
        return self.restart([(g.gid, j) for g in self.groups for j, r in enumerate(g.responses)
                             if r.versions and version - min(r.versions) > self.max_staleness], version)

    def restart(self, keys: list[tuple[int, int]], version: int) -> int:
        """These (group, sample) responses start over from their prompt, with a seed of their own, tokens dropped."""
        for gid, j in keys:
            g = self._group(gid)
            st = g.responses[j].state
            seed = (st.seed * RESTART_SALT + version) % 2**62
            g.responses[j] = Response(state=SeqState(gid, j, list(st.prompt_ids), [], [], st.params, seed,
                                                     st.max_tokens, list(st.stop_ids)))
        self.counts["restarted"] += len(keys)
        return len(keys)

    def complete_count(self) -> int:
        return sum(g.complete and not g.failed for g in self.groups)

    def unfinished(self, groups: list[Group] | None = None) -> list[SeqState]:
        """The states to continue, oldest group first (the engine admits them before the new prompts)."""
        return [r.state for g in (self.groups if groups is None else groups) for r in g.responses if not r.done]

    # ---- during and after a rollout -----------------------------------------------------------------------

    def settle(self, comps: list, states: list, horizon: "Horizon", version: int) -> None:
        """The rollout's outcome, cut at the horizon: responses that finished within T tokens are finished; the
        others (finished later, or exported unfinished) are carried with their first T tokens of this rollout."""
        for c in comps:
            key = (c.prompt_index, c.sample_index)
            cut = horizon.limit(key)
            if cut is None or drawn(c) <= cut:
                self.finished(c, version)
            elif getattr(c, "response_mask", None) is not None:  # the rollout cuts trajectories (tool_partial.py)
                raise RuntimeError(f"the rollout returned trajectory {key} past the horizon uncut: the partial "
                                   "rollout's bookkeeping is wrong; stopping rather than carry it")
            else:
                r = self._find(*key)
                self.carry([dataclasses.replace(r.state, output_ids=list(c.token_ids[:cut]),
                                                logprobs=list(c.logprobs[:cut]))], version)
        for st in states:
            cut = horizon.limit((st.prompt_index, st.sample_index))
            if cut is not None:
                st = st.cut(cut) if isinstance(st, TrajState) else dataclasses.replace(
                    st, output_ids=list(st.output_ids[:cut]), logprobs=list(st.logprobs[:cut]))
            self.carry([st], version)

    def _find(self, gid: int, j: int) -> Response:
        for g in self.groups:
            if g.gid == gid:
                return g.responses[j]
        raise RuntimeError(f"the rollout returned a response of group {gid}, which the partial buffer does not hold")

    def finished(self, comp, version: int) -> bool:
        """A response finished under `version`: records it; True when its group is now complete."""
        r = self._find(comp.prompt_index, comp.sample_index)
        if comp.finish_reason != "error" and list(comp.prompt_token_ids) != list(r.state.prompt_ids):
            raise RuntimeError(f"the rollout returned a response labelled group {comp.prompt_index} for another "
                               "prompt: stopping rather than score it against the wrong answer")
        self.counts["drawn"] += _grow(r, comp.token_ids, version)
        r.comp = comp
        return self._group(comp.prompt_index).complete

    def carry(self, states: list[SeqState], version: int) -> None:
        """The rollout ended early: its unfinished responses come back as states, with the tokens they drew."""
        for st in states:
            r = self._find(st.prompt_index, st.sample_index)
            self.counts["drawn"] += _grow(r, st.output_ids, version)
            r.state = st
        self.counts["carried"] += len(states)

    def _group(self, gid: int) -> Group:
        return next(g for g in self.groups if g.gid == gid)

    def take(self, k: int) -> list[Group]:
        """Up to k complete groups, oldest first, out of the buffer; groups the engine rejected leave with them
        (counted), never trained on."""
        out = []
        for g in list(self.groups):
            if g.complete and g.failed:
                self.groups.remove(g)
                self.counts["rejected"] += 1
            elif g.complete and len(out) < k:
                self.groups.remove(g)
                out.append(g)
        return out

    # ---- metrics and checkpoints --------------------------------------------------------------------------

    def metrics(self, horizon: int | None = None) -> dict:
        """Counts since the last call and the rollout's horizon (tokens per response where it stopped; 0: no rollout
        ran, the buffer had the groups; rollout.max_tokens: it ran to the end). The staleness of what the step
        trains is `staleness`'s, over the update's completions."""
        m = {"rollout/partial_launched": self.counts["launched"], "rollout/partial_carried": self.counts["carried"],
             "rollout/partial_restarted": self.counts["restarted"], "rollout/partial_buffered": len(self.groups),
             "rollout/rejected": self.counts["rejected"], "rollout/partial_horizon": horizon or 0}
        self.counts = dict.fromkeys(self.counts, 0)
        return m

    def state_dict(self) -> dict:
        return {"next_gid": self.next_gid, "groups": [
            {"gid": g.gid, "index": g.index, "launched": g.launched,
             "responses": [{"versions": list(r.versions),
                            "state": _state_dict(r.state),
                            "comp": _comp_dict(r.comp) if r.comp is not None else None} for r in g.responses]}
            for g in self.groups]}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {"next_gid": 0, "groups": []}
        self.next_gid = int(state["next_gid"])
        self.groups = [Group(int(g["gid"]), int(g["index"]), int(g["launched"]),
                             [Response(state=_state_from(r["state"]),
                                       comp=_comp_from(r["comp"]) if r["comp"] is not None else None,
                                       versions=[int(v) for v in r["versions"]]) for r in g["responses"]])
                       for g in state["groups"]]
        self.counts = dict.fromkeys(self.counts, 0)


class Horizon:
    """Where a partial rollout stops, on a clock of tokens drawn in this rollout (per response), so that neither
    speculation nor batching nor workers move it. Told of each engine step's finished responses and of the clocks of
    those still running or waiting, it says stop once T is known: T is the `need`-th smallest completion clock of a
    group (a group completes at its last response's finish), and it is known once `need` groups completed by some C
    and every unfinished response has drawn at least C tokens (so none can still complete a group below C)."""

    def __init__(self, buf: PartialBuffer, need: int):
        self.need = need - buf.complete_count()
        self.start = {(g.gid, j): r.drawn for g in buf.groups for j, r in enumerate(g.responses) if not r.done}
        self.left = {g.gid: sum(not r.done for r in g.responses) for g in buf.groups}
        self.clock = {g.gid: 0 for g in buf.groups}
        self.failed: set[int] = {g.gid for g in buf.groups if g.failed}
        self.complete: list[int] = []
        self.stop: int | None = None

    def __call__(self, finished: list, running) -> bool:
        """finished: this engine step's Completions (labelled (group, sample)); running(): (group, sample, tokens
        so far) of every unfinished response."""
        for c in finished:
            gid = c.prompt_index
            self.clock[gid] = max(self.clock[gid], drawn(c) - self.start[(gid, c.sample_index)])
            self.left[gid] -= 1
            if c.finish_reason == "error":
                self.failed.add(gid)
            if self.left[gid] == 0 and gid not in self.failed:
                self.complete.append(self.clock[gid])
        if len(self.complete) < self.need:
            return False
        c = sorted(self.complete)[self.need - 1]
        if any(n - self.start[(gid, j)] < c for gid, j, n in running()):
            return False
        self.stop = c
        return True

    def limit(self, key: tuple[int, int]) -> int | None:
        """The drawn tokens response `key` (group, sample) keeps: those it had, then the horizon's T (None: no
        stop, it keeps all)."""
        return None if self.stop is None else self.start[key] + self.stop


def version_runs(versions: list[int]) -> list[list[int]]:
    """A response's per-token policy versions as [version, tokens] runs (samples.jsonl's `policy_versions`)."""
    runs: list[list[int]] = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


def staleness(comps: list, version: int) -> dict:
    """How old the trained tokens are under the update of `version`, over the completions the update gets (each
    with its `policy_versions` runs): after dynamic sampling's filter and over every round, those served from the
    buffer (no token drawn) included; 0 when nothing is trained."""
    per = [_ages(c, version) for c in comps]
    ages = [x for a in per for x in a]
    tokens = sum(k for _, k in ages)
    return {"rollout/offpolicy_token_frac": sum(k for a, k in ages if a > 0) / tokens if tokens else 0.0,
            "rollout/staleness_mean": sum(a * k for a, k in ages) / tokens if tokens else 0.0,
            "rollout/staleness_max": max((a for a, k in ages if k), default=0),
            "rollout/offpolicy_responses": sum(any(a > 0 for a, k in x if k) for x in per)}


def _ages(c, version: int) -> list[tuple[int, int]]:
    """(age, trained tokens) per run of a completion's policy versions: a trajectory's observation tokens (response
    mask 0, tagged with the rollout that appended them) are not trained and count in none."""
    runs, mask = c.stats["policy_versions"], getattr(c, "response_mask", None)
    if mask is None:
        return [(version - v, k) for v, k in runs]
    out, i = [], 0
    for v, k in runs:
        out.append((version - v, sum(mask[i:i + k])))
        i += k
    return out


def launch_count(oversample: float, need: int, buffered: int) -> int:
    """New groups to launch: the step keeps ceil(oversample * need) groups in flight (the buffered ones count)."""
    return max(math.ceil(oversample * need - 1e-9) - buffered, 0)


def _grow(r: Response, tokens: list[int], version: int) -> int:
    """The response's tokens now: the ones it had, unchanged, then those `version` drew (returns how many)."""
    had = r.tokens
    if list(tokens[: len(had)]) != list(had) or len(had) != len(r.versions):
        raise RuntimeError("a carried response came back without the tokens it had: the partial rollout's "
                           "bookkeeping is wrong; stopping rather than train on mislabelled tokens")
    r.versions = r.versions + [version] * (len(tokens) - len(had))
    return len(tokens) - len(had)


def _state_dict(st: SeqState) -> dict:
    d = dataclasses.asdict(st)
    d["params"] = dataclasses.asdict(st.params)
    return d


def _state_from(d: dict) -> SeqState:
    d = dict(d)
    d["params"] = SamplingParams(**d["params"])
    return state_from(d)


_COMP_FIELDS = ("seq_id", "prompt_index", "sample_index", "prompt_token_ids", "token_ids", "text", "logprobs",
                "finish_reason", "error")


def _comp_dict(c) -> dict:
    d = {k: getattr(c, k) for k in _COMP_FIELDS}
    if getattr(c, "response_mask", None) is not None:  # a trajectory: its mask, and its record (what rewards read) as
        # JSON text (a call's arguments are the model's: any key)
        d.update(response_mask=list(c.response_mask), trajectory=json.dumps(c.trajectory), stats=dict(c.stats))
    return d


def _comp_from(d: dict):
    from ..engine.sequence import Completion

    c = Completion(**{k: d[k] for k in _COMP_FIELDS})
    if d.get("response_mask") is not None:
        c.response_mask, c.trajectory, c.stats = list(d["response_mask"]), json.loads(d["trajectory"]), dict(d["stats"])
    return c
