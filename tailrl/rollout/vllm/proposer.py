"""Our history speculation inside vLLM: a `custom_class` proposer (vllm/v1/spec_decode/custom_class_proposer.py).

    LLM(..., speculative_config={"method": "custom_class", "num_speculative_tokens": k,
                                 "model": "tailrl.rollout.vllm.proposer.HistoryProposer"})

vLLM calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)` once per step with every running
row; it passes no request ids and no prompt lengths. So the rollout pushes its prompts first (`push_prompts`,
through `collective_rpc`), and a row is matched to its prompt by token prefix: the row's tokens start with the
prompt's. Each row then drafts from its prompt's history (SuffixDecoding / RhymeRL HistoSpec: earlier epochs'
responses to the same prompt, and this step's sibling samples as they grow: speculative/drafters.PromptHistory),
a chain of at most k tokens (vLLM verifies chains). Which of the chains' tokens a step verifies is chosen for the
step's goodput (speculative/goodput.py: vLLM's steps timed from outside and fitted as a cost line, acceptance
estimates calibrated by what verified drafts did): a row gets an empty draft where drafting does not pay.

Lossless by construction of vLLM's rejection sampler, where the engine's SD passes our audit (audit.py): the
drafts only decide which tokens are verified, never what is emitted. Greedy requests emit what plain decoding emits.
Counters (`stats`) come back through `collective_rpc` as our spec/* metrics."""

from __future__ import annotations

import json
import os
import time

import numpy as np

from ...speculative.config import SpecConfig
from ...speculative.drafters import PROMPT_TAIL, PromptHistory, history_key
from ...speculative.goodput import Calibration, StepLine, choose, worth_drafting
from ...speculative.suffix import TreeShape, build_tree

PROBE = 8  # tokens of a prompt compared to confirm a row still holds the request it held last step
# occurrences of a match compared per draft, the most recent: on vLLM's hot path every row drafts every step, and
# a looping row's own stream holds hundreds of its n-grams (256 cost ~0.4 ms a row, 11 ms a step of 25 rows)
OCCURRENCES = 32
EXPLORE_EVERY = 32  # every this many steps a few likely tokens are verified whatever the choice (goodput.choose)


class HistoryProposer:
    def __init__(self, vllm_config, spec: SpecConfig | None = None):
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.cfg = spec or SpecConfig(mode="history")
        self.prompts: dict[tuple, PromptHistory] = {}  # history key (drafters.history_key) -> its history
        # this rollout's requests: prompt ids -> (history key, turn); prompt length -> those prompts' last PROBE tokens
        self.requests: dict[tuple[int, ...], tuple[tuple, int]] = {}
        self.by_len: dict[int, set[tuple[int, ...]]] = {}
        self.rows: dict[int, tuple] = {}  # row -> (request prompt, live stream id, tokens seen)
        self.line, self.calib = StepLine(), Calibration(depth=max(self.k, 1))
        self.pending: dict[tuple, list[float]] = {}  # (history key, stream) -> estimates of the drafts it verifies
        self.last_t, self.last_rows, self.last_drafted, self.last_draft_s = None, 0, 0, 0.0
        self.stats = fresh_stats()
        # TAILRL_VLLM_TRACE=FILE: a JSON line per step (rows, drafted, emitted, seconds, arm) for profiling;
        # TAILRL_VLLM_ARM=off|history:K: that many draft tokens at every step instead of the goodput choice;
        # repeat:K: every row drafts its last token K times, history or not (what verifying K tokens costs)
        self.trace = open(os.environ["TAILRL_VLLM_TRACE"], "a") if os.environ.get("TAILRL_VLLM_TRACE") else None
        forced = os.environ.get("TAILRL_VLLM_ARM")
        self.forced = None if not forced else 0 if forced == "off" else int(forced.split(":")[1])
        self.repeat = bool(forced) and forced.startswith("repeat:")

    # ---- what the rollout pushes, through collective_rpc --------------------------------------------------

    def push_prompts(self, prompts: list[list[int]], history: list[tuple | None] | None = None) -> None:
        """The prompts of requests about to be added, and for each the (prompt ids, turn) its tokens are filed
        under (SamplingParams.history: an agent's turn k >= 1; None, or no list: turn 0, under its own ids)."""
        for i, p in enumerate(prompts):
            req = tuple(p)
            named = history[i] if history is not None else None
            prompt, turn = (list(named[0]), int(named[1])) if named is not None else (list(p), 0)
            key = history_key(prompt, turn)
            if key not in self.prompts:
                self.prompts[key] = ph = PromptHistory(prompt, 3)
                ph.index.max_occurrences = OCCURRENCES
            if req not in self.requests:
                self.requests[req] = (key, turn)
                self.by_len.setdefault(len(req), set()).add(req[-PROBE:])

    def end_rollout(self) -> dict:
        """This step's samples become history (the last `history_epochs` kept) and its later turns' requests are
        forgotten (a trajectory's prompt so far is not asked again; a prompt is); returns and resets the counters."""
        for ph in self.prompts.values():
            ph.commit(self.cfg.history_epochs)
        self.requests = {req: kt for req, kt in self.requests.items() if kt[1] == 0}
        self.by_len = {}
        for req in self.requests:
            self.by_len.setdefault(len(req), set()).add(req[-PROBE:])
        self.rows.clear()
        self.pending.clear()
        self.last_t = None
        if self.trace is not None:
            self.trace.write(json.dumps({"end_rollout": True}) + "\n")
            self.trace.flush()
        out, self.stats = self.stats, fresh_stats()
        return out

    # ---- vLLM's call -----------------------------------------------------------------------------------

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        t0 = time.perf_counter()
        B = len(sampled_token_ids)
        emitted = sum(len(s) for s in sampled_token_ids)
        self.stats["accepted"] += sum(max(len(s) - 1, 0) for s in sampled_token_ids)
        if self.last_t is not None and self.last_rows:  # the step just verified: what the cost line learns from
            step_s = t0 - self.last_t
            self.line.record(self.last_rows, self.last_drafted, step_s)
            if self.trace is not None:
                self.trace.write(json.dumps({"rows": self.last_rows, "drafted": self.last_drafted, "emitted": emitted,
                                             "step_s": round(step_s, 5), "draft_s": round(self.last_draft_s, 5)})
                                 + "\n")
        self._follow(B, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        chains, cands = [None] * B, [[] for _ in range(B)]
        explore = self.stats["steps"] % EXPLORE_EVERY == 0
        worth = self.forced != 0 and (explore or worth_drafting(self.line, B, self.k))
        for i in range(B):
            held = self.rows.get(i)
            if held is None or not sampled_token_ids[i]:
                continue
            key, turn = self.requests[held[0]]
            if turn:
                self.stats["later_accepted"] += len(sampled_token_ids[i]) - 1
            est = self.pending.pop((key, held[1]), None)
            if est is not None:  # its drafts of last step were verified: len - 1 of them accepted
                self.calib.record(est, len(sampled_token_ids[i]) - 1)
            if worth:
                chains[i] = self._chain(i, int(num_tokens_no_spec[i]), token_ids_cpu[i])
                if chains[i] is not None:
                    cands[i] = list(self.calib(chains[i][1]))
        if self.repeat:
            chains = [([int(t[-1])] * self.forced, np.zeros(self.forced)) if len(t) else None
                      for t in sampled_token_ids]
            counts = [self.forced if c is not None else 0 for c in chains]
        elif self.forced is not None:
            counts = [min(len(c), self.forced) for c in cands]
        else:
            counts = choose(self.line, B, cands, explore=explore)
        drafts = [[] for _ in range(B)]
        for i, m in enumerate(counts):
            if m:
                tokens, est = chains[i]
                drafts[i] = tokens[:m]
                if not self.repeat:
                    key, turn = self.requests[self.rows[i][0]]
                    self.pending[(key, self.rows[i][1])] = est[:m]
                    self.stats["later_drafted"] += m if turn else 0
        drafted = sum(counts)
        self.stats["steps"] += 1
        self.stats["spec_steps"] += drafted > 0
        self.stats["drafted"] += drafted
        self.last_draft_s = time.perf_counter() - t0
        self.stats["draft_s"] += self.last_draft_s
        self.last_t, self.last_rows, self.last_drafted = time.perf_counter(), B, drafted
        return drafts

    def load_model(self, *args, **kwargs) -> None:
        pass  # model-free

    # ---- rows to requests, and their live streams ---------------------------------------------------------

    def _follow(self, B: int, sampled, num_tokens, token_ids) -> None:
        """Keeps each row's live stream in its history entry up to date. A row still holds the request it held if it
        grew by exactly the tokens it was just given (vLLM appends them), and its first tokens and the stream's last
        token agree. vLLM reorders its rows as requests finish (and reuses them: a trajectory's next turn may land in
        its last turn's row, its tokens a continuation of that turn's), so a row that no longer continues the stream
        it held is matched again: to its request by prefix, then to the live stream of that request's entry it
        continues (a moved request keeps its stream: its tokens are not indexed twice and its verified drafts are
        credited to it), or to a new one."""
        kept, loose = {}, []
        for i in range(B):
            n, row, held = int(num_tokens[i]), token_ids[i], self.rows.get(i)
            if held is not None:
                req, sid, seen = held
                if len(req) <= seen == n - len(sampled[i]) and tuple(row[:PROBE].tolist()) == req[:PROBE] and \
                        row[seen - 1] == self._entry(req).index.streams[sid][-1]:
                    kept[i] = held
                    continue
            loose.append(i)
        taken = {(self.requests[held[0]][0], held[1]) for held in kept.values()}
        for i in loose:
            n, row = int(num_tokens[i]), token_ids[i]
            req = self._match(row, n)
            if req is None:
                continue
            key = self.requests[req][0]
            held = self._resume(req, row, n, taken) or (req, self.prompts[key].start_live(), len(req))
            taken.add((key, held[1]))
            kept[i] = held
        for i, (req, sid, seen) in kept.items():
            n = int(num_tokens[i])
            if n > seen:
                self._entry(req).index.extend(sid, token_ids[i][seen:n].tolist())
            kept[i] = (req, sid, n)
        self.rows = kept

    def _entry(self, req: tuple) -> PromptHistory:
        return self.prompts[self.requests[req][0]]

    def _resume(self, req: tuple, row: np.ndarray, n: int, taken: set) -> tuple | None:
        """The live stream of `req`'s entry that this row continues (its response so far ends the row's tokens up to
        the stream's length), not held by another row: (req, stream, tokens it covers); None if there is none."""
        key = self.requests[req][0]
        ph, L = self.prompts[key], len(req)
        cut = len(ph.prompt[-PROMPT_TAIL:])
        for sid in ph.live:
            if (key, sid) in taken:
                continue
            stream = ph.index.streams[sid]
            r = len(stream) - cut
            m = min(r, PROBE)
            if 0 < r and L + r <= n and row[L + r - m : L + r].tolist() == stream[-m:]:
                return req, sid, L + r
        return None

    def _match(self, row: np.ndarray, n: int) -> tuple[int, ...] | None:
        """The longest pushed request prompt the row's tokens start with (a later turn's prompt starts with the
        trajectory's prompt and its earlier turns' prompts); a length's prompts are compared by their last tokens
        first, so a row costs a full prompt's comparison only where one ends as the row does there."""
        for L in sorted(self.by_len, reverse=True):
            if L < n and tuple(row[max(L - PROBE, 0) : L].tolist()) in self.by_len[L]:
                req = tuple(row[:L].tolist())
                if req in self.requests:
                    return req
        return None

    def _chain(self, i: int, n: int, row: np.ndarray) -> tuple[list[int], np.ndarray] | None:
        """Row i's draft chain from its entry's history (at most k tokens), and each token's estimated cumulative
        acceptance: the share of the matched continuations that agree with the chain up to it."""
        ph = self._entry(self.rows[i][0])
        ctx = row[max(0, n - self.cfg.max_match - 1) : n].tolist()
        m, occ = ph.index.match(ctx, self.cfg.max_match)
        if m < self.cfg.min_match:
            return None
        tree = build_tree(ph.index.streams, occ, TreeShape(self.k, self.k, self.cfg.min_prob, chain=True), "history")
        if tree is None:
            return None
        return list(tree.tokens), np.cumprod(tree.cond)


def fresh_stats() -> dict:
    """The proposer's counters of one rollout; later_*: those of an agent's turns k >= 1."""
    return {"steps": 0, "spec_steps": 0, "drafted": 0, "accepted": 0, "draft_s": 0.0, "later_drafted": 0,
            "later_accepted": 0}


# ---- functions run on the worker by collective_rpc (they receive the worker) ------------------------------------

def push_prompts(worker, prompts: list[list[int]], history: list[tuple | None] | None = None) -> None:
    worker.model_runner.drafter.push_prompts(prompts, history)


def end_rollout(worker) -> dict:
    return worker.model_runner.drafter.end_rollout()
