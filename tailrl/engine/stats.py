"""What the engine did: one `StepRecord` per engine step, summed into `GenerateStats`; each sequence's own
timings and counts in its `SeqStats`.

The engine only returns records; counting happens here, outside the decode loop. `GenerateStats.add` folds in
one record and `merge` folds in another stats object, so workers' statistics combine: merging the stats of two
halves of a run's records gives the stats of the whole (times add up; for workers that ran in parallel the
caller sets `total_s` to the wall time)."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field, fields

from ..speculative.selector import batch_bucket
from .tail import tail_size

log = logging.getLogger(__name__)


@dataclass
class StepRecord:
    kind: str  # "prefill" | "decode" | "idle"
    batch: int = 0  # sequences in the pass
    tokens_in_pass: int = 0  # new tokens the forward ran (prompts, or roots + draft nodes)
    arm: str = "off"  # the selector's choice for a decode step ("drafter:budget" or "off")
    drafter: str = ""  # the arm's drafter ("" = none)
    proposals: int = 0  # sequences that got a draft tree
    drafted: int = 0  # draft nodes verified
    emitted: int = 0  # tokens appended to sequences
    accepted: int = 0  # emitted draft tokens (decode: emitted - sequences that emitted)
    draft_s: float = 0.0
    forward_s: float = 0.0
    verify_s: float = 0.0  # sampling, acceptance, KV compaction, bookkeeping
    total_s: float = 0.0
    plain_est_s: float = 0.0  # what plain decoding would have taken for the same tokens (selector's cost model)
    pred_s: float = 0.0  # the step-time model's seconds for this pass as it ran (drafting included)
    pred_tps: float = 0.0  # the chosen arm's predicted tokens / s when it was chosen (speculative/selector.py)
    off_tps: float = 0.0  # plain decoding's predicted tokens / s then
    probe: bool = False  # the step ran the arm not chosen, to keep measuring it (selector probes)
    kv_bytes: int = 0  # KV blocks in use after the step
    preempted: int = 0  # sequences preempted before the step's pass (to be recomputed)
    capture_s: float = 0.0  # CUDA-graph capture in this step (one-time per bucket; not in forward_s or total_s)
    reused: int = 0  # prefill: positions its sequences did not prefill (kept K/V, shared prompt blocks)


@dataclass
class SeqStats:
    """One sequence's timings and decode counts: its Completion's `timing` and `stats`. The engine's passes count
    decode steps and tokens, the speculator's feedback the draft nodes (`add_draft`); the counts travel with the
    sequence when one engine exports it to another (`portable`), the timings start again there."""

    t_submit: float = 0.0
    t_admit: float = 0.0  # prefilled (again, after a preemption or an import)
    t_first: float = 0.0  # first output token
    t_finish: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    drafted: int = 0  # draft nodes verified
    accepted: int = 0  # of them, emitted
    per_drafter: dict = field(default_factory=dict)  # drafter -> [drafted, accepted]

    def add_draft(self, drafter: str, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        per = self.per_drafter.setdefault(drafter, [0, 0])
        per[0] += drafted
        per[1] += accepted

    def portable(self) -> dict:
        """The counts an exported sequence carries (SeqState.stats): `SeqStats(t, **portable)` goes on counting."""
        return {k: getattr(self, k) for k in ("decode_steps", "decode_tokens", "drafted", "accepted", "per_drafter")}

    def timing(self) -> dict:
        t0 = self.t_submit
        return {
            "queue_s": max(self.t_admit - t0, 0.0) if self.t_admit else None,
            "ttft_s": self.t_first - t0 if self.t_first else None,
            "total_s": self.t_finish - t0 if self.t_finish else None,
        }

    def counts(self) -> dict:
        return {
            "decode_steps": self.decode_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "accept_length": self.decode_tokens / self.decode_steps if self.decode_steps else 0.0,
            **{f"drafted/{k}": v[0] for k, v in self.per_drafter.items()},
            **{f"accepted/{k}": v[1] for k, v in self.per_drafter.items()},
        }


@dataclass
class GenerateStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    generated_tokens: int = 0
    peak_kv_bytes: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0  # positions the prefill passes computed
    prefill_reused: int = 0  # positions they did not compute: kept K/V and shared prompt blocks (scheduler.py)
    peak_running: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)  # decode batch size -> steps
    draft_s: float = 0.0  # proposing drafts
    forward_s: float = 0.0  # decode / verification forwards
    verify_s: float = 0.0  # acceptance, KV compaction, bookkeeping
    drafters: dict[str, dict[str, int]] = field(default_factory=dict)  # name -> seq_steps, proposals, drafted, accepted
    choices: dict[int, dict[str, int]] = field(default_factory=dict)  # batch-size bucket -> strategy -> steps
    by_bucket: dict[int, list[float]] = field(default_factory=dict)  # batch-size bucket -> [decode tokens, seconds]
    plain_est_s: float = 0.0
    pred_s: float = 0.0  # the step-time model's seconds for the decode steps as they ran
    off_body_s: float = 0.0  # SD-off estimate of the rollout's decode seconds from its own plain schedule (body,
    off_tail_s: float = 0.0  # tail; 0: not estimated): off_estimate.off_seconds
    probe_steps: int = 0  # decode steps that ran the arm not chosen (selector probes)
    tail_size: int = 0  # decode tokens and seconds while at most this many sequences run (the long tail, tail.py)
    tail_tokens: int = 0
    tail_s: float = 0.0
    stale: dict[str, float] = field(default_factory=dict)  # drafter -> 1.0 if its acceptance collapsed (watchdog)
    gauges: dict[str, float] = field(default_factory=dict)  # drafters' own at the end (the self drafter's memory)
    capture_s: float = 0.0  # CUDA-graph captures (in total_s, the wall time; not in decode_s or the buckets)

    def add(self, r: StepRecord) -> None:
        self.steps += 1
        self.capture_s += r.capture_s
        self.generated_tokens += r.emitted
        self.peak_kv_bytes = max(self.peak_kv_bytes, r.kv_bytes)
        self.preemptions += r.preempted
        if r.kind == "prefill":
            self.prefill_steps += 1
            self.prefill_s += r.total_s
            self.prefill_tokens += r.tokens_in_pass
            self.prefill_reused += r.reused
            return
        if r.kind != "decode":
            return
        B, s = r.batch, r.total_s
        self.peak_running = max(self.peak_running, B)
        self.decode_steps += 1
        self.decode_s += s
        self.draft_s += r.draft_s
        self.forward_s += r.forward_s
        self.verify_s += r.verify_s
        self.plain_est_s += r.plain_est_s
        self.pred_s += r.pred_s
        self.probe_steps += r.probe
        self.batch_sizes[B] = self.batch_sizes.get(B, 0) + 1
        cell = self.by_bucket.setdefault(batch_bucket(B), [0, 0.0])
        cell[0] += r.emitted
        cell[1] += s
        if B <= self.tail_size:  # tail.in_tail, with N folded into tail_size (records may be merged across workers)
            self.tail_tokens += r.emitted
            self.tail_s += s
        counts = self.choices.setdefault(batch_bucket(B), {})
        counts[r.arm] = counts.get(r.arm, 0) + 1
        if r.drafter:
            d = self.drafters.setdefault(r.drafter, {"seq_steps": 0, "proposals": 0, "drafted": 0, "accepted": 0})
            d["seq_steps"] += B
            d["proposals"] += r.proposals
            d["drafted"] += r.drafted
            d["accepted"] += r.accepted

    def merge(self, other: GenerateStats) -> GenerateStats:
        """Adds other's counts into self (in place) and returns self."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in ("peak_kv_bytes", "tail_size", "peak_running"):
                setattr(self, f.name, max(a, b))
            elif f.name in ("stale", "gauges"):
                a.update({k: max(a.get(k, 0.0), v) for k, v in b.items()})
            elif isinstance(a, dict):
                _merge_dict(a, b)
            else:
                setattr(self, f.name, a + b)
        return self

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_s if self.total_s else 0.0

    @property
    def tail_tokens_per_s(self) -> float:
        return self.tail_tokens / self.tail_s if self.tail_s else 0.0

    @property
    def speedup_est(self) -> float:
        off = self.off_body_s + self.off_tail_s or self.plain_est_s
        return off / self.decode_s if off and self.decode_s else 1.0

    @property
    def mean_accept_length(self) -> float:
        """Tokens emitted per sequence per decode step, over all steps (1 = plain decoding)."""
        seq_steps = sum(b * n for b, n in self.batch_sizes.items())
        decode_tokens = sum(cell[0] for cell in self.by_bucket.values())
        return decode_tokens / seq_steps if seq_steps else 0.0

    def accept_length(self, drafter: str) -> float:
        """Mean tokens emitted per sequence per step when the drafter was chosen (1 = no gain)."""
        d = self.drafters.get(drafter)
        return (d["seq_steps"] + d["accepted"]) / d["seq_steps"] if d and d["seq_steps"] else 0.0

    def summary(self) -> dict:
        out = {"tokens": self.generated_tokens, "seconds": round(self.total_s, 3), "tokens_per_s": round(self.tokens_per_s, 2),
               "tail_tokens_per_s": round(self.tail_tokens_per_s, 2), "draft_s": round(self.draft_s, 3),
               "forward_s": round(self.forward_s, 3), "verify_s": round(self.verify_s, 3),
               "accept_length": round(self.mean_accept_length, 3), "speedup_est": round(self.speedup_est, 3),
               "choices": self.choices}
        if self.capture_s:
            out["cuda_graph_capture_s"] = round(self.capture_s, 3)
        out.update(peak_running=self.peak_running, peak_kv_gb=round(self.peak_kv_bytes / 2**30, 4),
                   preemptions=self.preemptions)
        for name, d in self.drafters.items():
            out[f"accept_length/{name}"] = round(self.accept_length(name), 3)
            out[f"drafted/{name}"], out[f"accepted/{name}"] = d["drafted"], d["accepted"]
        out.update({f"stale/{k}": v for k, v in self.stale.items() if v})
        return out

    def metrics(self) -> dict[str, float]:
        """The rollout's speculation metrics for a training log (spec/...)."""
        out = {"spec/accept_length": self.mean_accept_length, "spec/speedup_est": self.speedup_est,
               "spec/tail_tokens_per_s": self.tail_tokens_per_s, "rollout/preemptions": self.preemptions,
               "rollout/prefill_reused_share": self.prefill_reused / max(self.prefill_reused + self.prefill_tokens, 1),
               "rollout/peak_kv_gb": self.peak_kv_bytes / 2**30, "rollout/peak_running": self.peak_running}
        out.update({f"spec/accept_length/{name}": self.accept_length(name) for name in self.drafters})
        out.update(self.selector_metrics())
        out.update({f"spec/stale/{name}": v for name, v in self.stale.items()})
        out.update(self.gauges)
        if self.capture_s:
            out["perf/cuda_graph_capture_s"] = self.capture_s
        return out


    def selector_metrics(self) -> dict[str, float]:
        """What the selector bought and what it thought it would: decode tokens / s measured, as its step-time model
        predicted the steps it ran, and as it estimates plain decoding over the same tokens; the share of decode
        steps each arm ran, and of probes (speculative/selector.py)."""
        if not self.decode_steps or not self.plain_est_s:
            return {}
        tokens = sum(cell[0] for cell in self.by_bucket.values())
        arms: dict[str, int] = {}
        for counts in self.choices.values():
            for arm, n in counts.items():
                arms[arm] = arms.get(arm, 0) + n
        off = self.off_body_s + self.off_tail_s or self.plain_est_s
        out = {"spec/decode_tokens_per_s": tokens / self.decode_s if self.decode_s else 0.0,
               "spec/off_tokens_per_s_est": tokens / off,
               "spec/probe_share": self.probe_steps / self.decode_steps}
        if self.pred_s:
            out["spec/pred_tokens_per_s"] = tokens / self.pred_s
        if self.off_body_s + self.off_tail_s:  # from the rollout's own plain schedule (engine/tail.py's estimate aside)
            body_s = self.decode_s - self.tail_s
            out["spec/tail_speedup_est"] = self.off_tail_s / self.tail_s if self.tail_s else 1.0
            out["spec/body_speedup_est"] = self.off_body_s / body_s if body_s > 0 else 1.0
        out.update({f"spec/arm_share/{arm}": n / self.decode_steps for arm, n in sorted(arms.items())})
        return out


def _merge_dict(a: dict, b: dict) -> None:
    for k, v in b.items():
        if isinstance(v, dict):
            _merge_dict(a.setdefault(k, {}), v)
        elif isinstance(v, list):
            cell = a.setdefault(k, [0] * len(v))
            for i, x in enumerate(v):
                cell[i] += x
        else:
            a[k] = a.get(k, 0) + v


class Completions(list):
    """The completions of one generate call, with that call's engine statistics in `.stats`."""

    stats: GenerateStats


class Collector:
    """Gathers the completions and statistics of a set of requests from the steps that run them (the loop a
    caller driving `Engine.step()` writes is: while has_work: collector.add(engine.step()))."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.stats = GenerateStats(tail_size=tail_size(len(ids)))
        self.done: dict = {}
        self.t0 = time.perf_counter()

    def add(self, out) -> None:
        self.stats.add(out.record)
        self.done.update((c.seq_id, c) for c in out.finished)

    def result(self) -> Completions:
        """One completion per id, in the order of ids; `.stats` with the wall time since the collector began."""
        self.stats.total_s = time.perf_counter() - self.t0
        if self.stats.preemptions > 0.1 * len(self.ids):
            log.warning("%d preemptions for %d sequences: the KV cache is too small for this rollout's lengths; "
                        "each preempted sequence is recomputed (raise kv_cache_gb or lower max_num_seqs)",
                        self.stats.preemptions, len(self.ids))
        result = Completions(self.done[i] for i in self.ids)
        result.stats = self.stats
        return result


class _NoBar:
    def update(self, n: int) -> None:
        pass


@contextlib.contextmanager
def progress_bar(total: int, show: bool):
    """A tqdm bar over finished sequences, or nothing."""
    if not show:
        yield _NoBar()
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc="generate", unit="seq", dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()
