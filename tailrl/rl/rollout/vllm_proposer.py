"""Our history speculation inside vLLM: a `custom_class` proposer (vllm/v1/spec_decode/custom_class_proposer.py).

    LLM(..., speculative_config={"method": "custom_class", "num_speculative_tokens": k,
                                 "model": "tailrl.rl.rollout.vllm_proposer.HistoryProposer"})

vLLM calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)` once per step with every running
row; it passes no request ids and no prompt lengths. So the rollout pushes its prompts first (`push_prompts`,
through `collective_rpc`), and a row is matched to its prompt by token prefix: the row's tokens start with the
prompt's. Each row then drafts from its prompt's history (SuffixDecoding / RhymeRL HistoSpec: earlier epochs'
responses to the same prompt, and this step's sibling samples as they grow: speculative/drafters.PromptHistory),
a chain of at most k tokens (vLLM verifies chains). Our selector (speculative/selector.py) decides per step whether
drafting pays at this batch size and how many tokens: a row gets an empty draft where it does not.

Lossless by construction of vLLM's rejection sampler, where the engine's SD passes our audit (vllm_audit.py): the
drafts only decide which tokens are verified, never what is emitted. Greedy requests emit what plain decoding emits.
Counters (`stats`) come back through `collective_rpc` as our spec/* metrics."""

from __future__ import annotations

import json
import os
import time

import numpy as np

from ...speculative.config import SpecConfig
from ...speculative.drafters import PromptHistory
from ...speculative.selector import OFF, Arm, Selector
from ...speculative.suffix import TreeShape, build_tree

PROBE = 8  # tokens of a prompt compared to confirm a row still holds the request it held last step


class HistoryProposer:
    def __init__(self, vllm_config, spec: SpecConfig | None = None):
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.cfg = spec or SpecConfig(mode="history")
        self.prompts: dict[tuple[int, ...], PromptHistory] = {}
        self.by_len: dict[int, set[tuple[int, ...]]] = {}  # prompt length -> prompts of that length
        self.rows: dict[int, tuple] = {}  # row -> (prompt key, live stream id, tokens seen)
        budgets = tuple(b for b in self.cfg.budgets if b <= self.k) or (self.k,)
        self.selector = Selector(SpecConfig(mode="auto", budgets=budgets, seed=self.cfg.seed), ["history"])
        self.arm, self.last_t, self.last_rows, self.last_drafted = OFF, None, 0, 0
        self.stats = {"steps": 0, "spec_steps": 0, "drafted": 0, "accepted": 0, "draft_s": 0.0}
        # TAILRL_VLLM_TRACE=FILE: a JSON line per step (rows, drafted, emitted, seconds, arm) for profiling;
        # TAILRL_VLLM_ARM=off|history:K: that arm at every step instead of the selector's (benchmarks only)
        self.trace = open(os.environ["TAILRL_VLLM_TRACE"], "a") if os.environ.get("TAILRL_VLLM_TRACE") else None
        forced = os.environ.get("TAILRL_VLLM_ARM")
        self.forced = None if not forced else OFF if forced == "off" else Arm("history", int(forced.split(":")[1]))

    # ---- what the rollout pushes, through collective_rpc --------------------------------------------------

    def push_prompts(self, prompts: list[list[int]]) -> None:
        for p in prompts:
            key = tuple(p)
            if key not in self.prompts:
                self.prompts[key] = PromptHistory(list(p), 3)
                self.by_len.setdefault(len(key), set()).add(key)

    def end_rollout(self) -> dict:
        """This step's samples become history (the last `history_epochs` kept); returns and resets the counters."""
        for ph in self.prompts.values():
            ph.commit(self.cfg.history_epochs)
        self.rows.clear()
        self.last_t = None
        if self.trace is not None:
            self.trace.write(json.dumps({"end_rollout": True}) + "\n")
            self.trace.flush()
        out, self.stats = self.stats, {k: 0 if k != "draft_s" else 0.0 for k in self.stats}
        return out

    # ---- vLLM's call -----------------------------------------------------------------------------------

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        t0 = time.perf_counter()
        B = len(sampled_token_ids)
        emitted = sum(len(s) for s in sampled_token_ids)
        self.stats["accepted"] += sum(max(len(s) - 1, 0) for s in sampled_token_ids)
        if self.last_t is not None and self.last_rows:  # the step just verified: what the selector learns from
            step_s = t0 - self.last_t
            self.selector.record(self.arm, self.last_rows, self.last_rows + self.last_drafted, step_s, step_s,
                                 emitted, self.last_drafted, self.last_draft_s)
            if self.trace is not None:
                self.trace.write(json.dumps({"rows": self.last_rows, "drafted": self.last_drafted, "emitted": emitted,
                                             "step_s": round(step_s, 5), "draft_s": round(self.last_draft_s, 5),
                                             "arm": str(self.arm)}) + "\n")
        self._follow(B, num_tokens_no_spec, token_ids_cpu)
        self.arm = (self.forced if self.forced is not None else self.selector.choose(B)) if B else OFF
        drafts = [[] for _ in range(B)]
        if self.arm != OFF:
            for i in range(B):
                if sampled_token_ids[i] and i in self.rows:
                    drafts[i] = self._draft(i, int(num_tokens_no_spec[i]), token_ids_cpu[i], self.arm.budget)
        drafted = sum(len(d) for d in drafts)
        self.stats["steps"] += 1
        self.stats["spec_steps"] += self.arm != OFF
        self.stats["drafted"] += drafted
        self.last_draft_s = time.perf_counter() - t0
        self.stats["draft_s"] += self.last_draft_s
        self.last_t, self.last_rows, self.last_drafted = time.perf_counter(), B, drafted
        return drafts

    def load_model(self, *args, **kwargs) -> None:
        pass  # model-free

    # ---- rows to prompts, and their live streams ----------------------------------------------------------

    def _follow(self, B: int, num_tokens, token_ids) -> None:
        """Keeps each row's live stream in its prompt's index up to date; a row whose request changed (vLLM
        reorders and reuses rows) is matched again by prefix."""
        for i in range(B):
            n = int(num_tokens[i])
            row = token_ids[i]
            held = self.rows.get(i)
            if held is not None:
                key, sid, seen = held
                L = len(key)
                if not (L <= seen <= n and tuple(row[:PROBE].tolist()) == key[:PROBE] and row[seen - 1] ==
                        self.prompts[key].index.streams[sid][-1]):
                    held = None
            if held is None:
                key = self._match(row, n)
                if key is None:
                    self.rows.pop(i, None)
                    continue
                ph = self.prompts[key]
                sid, seen = ph.start_live(), len(key)
            ph = self.prompts[key]
            if n > seen:
                ph.index.extend(sid, row[seen:n].tolist())
            self.rows[i] = (key, sid, n)
        for i in [r for r in self.rows if r >= B]:
            del self.rows[i]

    def _match(self, row: np.ndarray, n: int) -> tuple[int, ...] | None:
        for L, keys in self.by_len.items():
            if L < n:
                key = tuple(row[:L].tolist())
                if key in keys:
                    return key
        return None

    def _draft(self, i: int, n: int, row: np.ndarray, budget: int) -> list[int]:
        key, _, _ = self.rows[i]
        ph = self.prompts[key]
        ctx = row[max(0, n - self.cfg.max_match - 1) : n].tolist()
        m, occ = ph.index.match(ctx, self.cfg.max_match)
        if m < self.cfg.min_match:
            return []
        budget = min(budget, self.k, int(self.cfg.match_factor * m + self.cfg.match_offset))
        tree = build_tree(ph.index.streams, occ, TreeShape(budget, budget, self.cfg.min_prob, chain=True), "history")
        return list(tree.tokens) if tree is not None else []


# ---- functions run on the worker by collective_rpc (they receive the worker) ------------------------------------

def push_prompts(worker, prompts: list[list[int]]) -> None:
    worker.model_runner.drafter.push_prompts(prompts)


def end_rollout(worker) -> dict:
    return worker.model_runner.drafter.end_rollout()
