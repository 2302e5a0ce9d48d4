"""The two kinds of engine step: a prefill pass over newly admitted groups, and a decode pass over every running
sequence (plain, or verifying the speculator's draft trees in the same forward). Each returns its StepRecord."""

from __future__ import annotations

import time

from ..speculative.selector import OFF
from ..speculative.speculator import Speculator
from .invariant import contiguous_prefix
from .output import append_tokens
from .runner import ModelRunner
from .sampler import decide, sample_first
from .scheduler import prefill_len
from .sequence import Sequence
from .stats import StepRecord


def prefill_pass(runner: ModelRunner, speculator: Speculator | None, tokenizer, groups: list[list[Sequence]]) -> StepRecord:
    """Prefills the leaders of newly admitted groups (prompts, or prompt and tokens so far for imported
    sequences), forks each prompt's cache to its samples and draws their first tokens."""
    t = time.perf_counter()
    leaders = [g[0] for g in groups]
    lists = [(s.prompt_ids + s.output_ids[:-1])[s.kept:] for s in leaders]  # kept: a resumed request's held K/V
    logits, hidden = runner.prefill(lists, [s.slot for s in leaders], [s.kept for s in leaders])
    fwd = time.perf_counter() - t
    chunks = hidden.split([len(x) for x in lists]) if hidden is not None else [None] * len(groups)
    fresh, rows = [], []
    for i, (g, chunk) in enumerate(zip(groups, chunks)):
        for s in g[1:]:  # the samples of a prompt share its prefill
            runner.fork(g[0].slot, s.slot, prefill_len(g[0]))
        for s in g:
            s.stats.t_admit, s.hidden = t, [chunk] if chunk is not None else []
        if not g[0].output_ids:
            fresh += g
            rows += [i] * len(g)
    emitted = 0
    if fresh:  # each sample draws its first token from the shared prompt's logits with its own seed
        tokens, lps = sample_first(logits[rows], fresh)
        emitted = sum(append_tokens(s, [x], [lp], tokenizer) for s, x, lp in zip(fresh, tokens, lps))
    if speculator is not None:
        speculator.start([s for g in groups for s in g])
    return StepRecord("prefill", batch=len(leaders), tokens_in_pass=sum(map(len, lists)), emitted=emitted,
                      forward_s=fwd, total_s=time.perf_counter() - t, reused=sum(s.kept for s in leaders))

def decode_pass(runner: ModelRunner, speculator: Speculator | None, tokenizer, running: list[Sequence]) -> StepRecord:
    """One decode pass for every running sequence; with speculation, each verifies its draft tree in the same
    forward and emits 1 + accepted tokens."""
    t0 = time.perf_counter()
    rooms = [runner.kv.room(s.slot, s.cache_len) for s in running]  # draft rows the rows' blocks hold
    arm, trees = speculator.plan(running, rooms) if speculator is not None else (OFF, None)
    t1 = time.perf_counter()
    cache_lens = [s.cache_len for s in running]
    logits, hidden, q_lens, depths = runner.decode([s.output_ids[-1] for s in running], cache_lens, trees)
    t2 = time.perf_counter()
    verdicts = decide(logits, running, trees, q_lens, depths)
    if trees and runner.invariant:
        verdicts = [contiguous_prefix(v) for v in verdicts]
    if trees:
        runner.keep_accepted(cache_lens, [v.accepted_nodes for v in verdicts])
    if hidden is not None:  # the verified path's hidden states: the root, then the accepted nodes
        for s, chunk in zip(running, runner.path_rows(hidden, q_lens, [v.accepted_nodes for v in verdicts])):
            s.hidden.append(chunk)
    emitted = 0
    for s, v in zip(running, verdicts):
        n = append_tokens(s, v.tokens, v.logprobs, tokenizer)
        v.tokens, v.logprobs = v.tokens[:n], v.logprobs[:n]
        s.stats.decode_steps += 1
        s.stats.decode_tokens += n
        emitted += n
    t3 = time.perf_counter()
    B = len(running)
    cap = runner.last_capture_s  # a CUDA graph captured in this pass: one-time, kept out of the step's times
    record = StepRecord("decode", B, sum(q_lens), str(arm), arm.drafter, sum(1 for t in trees or () if t),
                        sum(len(t) for t in trees or () if t), emitted, emitted - B if arm != OFF else 0,
                        t1 - t0, t2 - t1 - cap, t3 - t2, t3 - t0 - cap, capture_s=cap)
    if speculator is not None:
        for s, drafts in zip(running, speculator.observe(record, running, verdicts)):
            if drafts is not None:
                s.stats.add_draft(*drafts)
        record.total_s = time.perf_counter() - t0 - cap  # the feedback (drafters' indexes, shadows) costs too
    return record
