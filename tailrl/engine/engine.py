"""The rollout engine: `add_requests` / `step` / `generate`, with continuous batching and speculation.

One `step()` either prefills newly admitted groups or runs one decode pass over every running sequence (with
the speculator's draft trees verified in the same forward). It returns the sequences that finished and a
`StepRecord`; callers that need to act between steps (the RL loop, rollout workers) drive `step()` themselves,
and `generate()` is the short loop over it. The caller composes the speculator (tailrl.drafter adds the
learned drafter), so the engine never imports a drafter."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from ..model.chunked import CHUNK, QUERY_BLOCK, ROW_TILE
from ..model.llama import CausalLM
from ..model.packed import invalidate_packs
from ..model.paged_attention import ITEM_TOKENS
from ..model.step import invariant_in_place
from ..speculative.backoff import token_classes
from ..speculative.off_estimate import off_seconds, turn_starts
from ..speculative.speculator import Speculator
from .config import EngineConfig
from .passes import decode_pass, prefill_pass
from .probe import resolve_invariant
from .requests import SeqState, check_prompt, encode, export_state, failed_group, import_state, make_group
from .blocks import BLOCK
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Completion, Sequence
from .stats import Collector, Completions, GenerateStats, StepRecord, progress_bar

log = logging.getLogger(__name__)


def weight_calls(model: CausalLM, in_calls: bool) -> list[tuple[int, float]]:
    """(rows per call, share of the weights' elements) per product shape of the model's passes: the calls the probe
    sized (model/chunked.py in_calls) where the passes run products in calls, else one call of any rows."""
    sizes: dict[int, float] = {}
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            rows = getattr(mod, "call_rows", 0) if in_calls else 0
            sizes[rows] = sizes.get(rows, 0.0) + mod.weight.numel()
    total = sum(sizes.values()) or 1.0
    return [(rows, n / total) for rows, n in sorted(sizes.items())] or [(0, 1.0)]


@dataclass
class StepOutput:
    finished: list[Completion]
    record: StepRecord


class Engine:
    def __init__(self, model: CausalLM, tokenizer=None, config: EngineConfig | None = None,
                 speculator: Speculator | None = None):
        """speculator: None builds the model-free drafters of config.spec.mode (none when it is off)."""
        self.model, self.tokenizer = model, tokenizer
        self.config = cfg = config or EngineConfig()
        mc = model.config
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        if speculator is None and cfg.spec.mode == "learned":
            raise ValueError("spec mode 'learned' needs a learned drafter (drafter.enabled or drafter.path)")
        self.speculator = speculator if speculator is not None or cfg.spec.mode == "off" else Speculator(cfg.spec)
        capture = cfg.capture_hidden or (self.speculator is not None and self.speculator.needs_hidden)
        budget = int(cfg.kv_cache_gb * 2**30) if cfg.kv_cache_gb else None
        invariant, self.invariance = resolve_invariant(cfg.batch_invariant, model)  # the probe's verdict, or None
        self.runner = ModelRunner(model, budget, cfg.max_num_seqs, self.max_model_len, capture, cfg.cuda_graphs,
                                  int(cfg.cuda_graph_mem_gb * 2**30), cfg.pad_to_buckets, invariant)
        if self.speculator is not None:
            classes, digits = token_classes(tokenizer)
            # an invariant verifier reads a sequence's keys once per block of its query rows: our kernel's items in
            # place, QUERY_BLOCK rows on the chunked route (model/chunked.py)
            block = ITEM_TOKENS if invariant_in_place(self.runner.device) else QUERY_BLOCK
            self.speculator.attach(self.runner.kv, chains=self.runner.invariant,
                                  row_block=block if self.runner.invariant else 0, key_chunk=CHUNK,
                                  classes=classes, digits=digits, row_tile=ROW_TILE if self.runner.invariant else 0,
                                  weight_calls=weight_calls(model, self.runner.invariant and self.runner.device.type == "cpu"),
                                  model=model)
        self.scheduler = Scheduler(self.runner, cfg.max_num_seqs, cfg.max_prefill_tokens, cfg.kv_watermark,
                                   cfg.prefix_cache if cfg.prefix_cache != "auto" else self.runner.invariant)
        self.eos_ids = frozenset(mc.eos_token_id) | frozenset(
            [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else [])
        self.rng = torch.Generator().manual_seed(cfg.seed)
        self.last_stats = GenerateStats()
        self._next_id = 0
        self._gc_frozen = False
        self._done: list[Sequence] = []  # finished outside a step (rejected requests): returned by the next step
        self._warned_fit = False
        self._collector: Collector | None = None  # the rollout running now (its SD-off estimate at its end)
        self.lookahead = max(self.speculator.cfg.budgets) if self.speculator is not None else 0

    def encode(self, prompt) -> list[int]:
        return encode(self.tokenizer, prompt)

    # ---- requests -------------------------------------------------------------------------------------------

    def add_requests(self, prompts: list, sampling: SamplingParams | list[SamplingParams] | None = None,
                     prompt_indices: list[int] | None = None) -> list[int]:
        """Queues each prompt's n samples; returns their sequence ids in (prompt, sample) order. A bad prompt
        fails alone: its samples come back from the next step with finish_reason "error" naming the problem."""
        self._new_batch()
        sampling = sampling or SamplingParams()
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        indices = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
        if not len(params) == len(indices) == len(prompts):
            raise ValueError(f"got {len(params)} sampling params and {len(indices)} indices for {len(prompts)} prompts")
        ids = []
        for prompt, p, index in zip(prompts, params, indices):
            try:
                group = self._make_group(prompt, p, index)
                self.scheduler.add(group)  # admitted whole, or in parts as rows and blocks allow
            except ValueError as e:
                log.warning("request %d rejected: %s", index, e)
                group = failed_group(self._next_id, index, p, str(e))
                self._done.extend(group)
            self._next_id += p.n
            ids.extend(s.seq_id for s in group)
        return ids

    def _make_group(self, prompt, p: SamplingParams, index: int) -> list[Sequence]:
        toks = self.encode(prompt)
        check_prompt(toks, self.model.config.vocab_size, self.max_model_len)
        stop = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids)
        group = make_group(self._next_id, index, toks, p, self.max_model_len, stop, self.rng)
        self._check_fits(group[0])
        return group

    def _check_fits(self, s: Sequence) -> None:
        """A prompt (and tokens so far) the whole KV cache cannot hold is rejected; one whose prompt + max_tokens
        it cannot hold runs, and is cut ("length") only if it really grows that long."""
        kv = self.runner.kv
        if not self.runner.fits(s.cache_len + 1):
            raise ValueError(f"the prompt needs {s.cache_len + 1} positions of KV cache but the cache holds "
                             f"{(kv.num_blocks - 1) * BLOCK}; raise kv_cache_gb")
        if not self.runner.fits(s.reserved_len) and not self._warned_fit:
            self._warned_fit = True
            log.warning("prompt + max_tokens = %d positions, more than the whole KV cache holds (%d): a response "
                        "that grows that long is cut there (raise kv_cache_gb)", s.reserved_len,
                        (kv.num_blocks - 1) * BLOCK)

    def has_work(self) -> bool:
        return bool(self._done) or self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def unfinished_ids(self) -> list[int]:
        """Ids of the running sequences, then the waiting ones."""
        return [s.seq_id for s in self.scheduler.running] + [s.seq_id for g in self.scheduler.waiting for s in g]

    @torch.inference_mode()
    def abort(self, ids: list[int]) -> list[Completion]:
        seqs = self.scheduler.remove(set(ids))
        for s in seqs:
            s.finish("abort")
        return self._complete(seqs)

    @torch.inference_mode()
    def export(self, ids: list[int]) -> list[SeqState]:
        """Takes running or waiting sequences out of this engine, as states another engine can import_, in the
        order of `ids` (callers pair them with what they know of each id). An id that is neither running nor
        waiting raises before anything is taken out."""
        missing = set(ids) - set(self.unfinished_ids())
        if missing or len(set(ids)) != len(ids):
            raise ValueError(f"cannot export sequence ids {sorted(missing) or ids}: not running or waiting here, "
                             "or repeated")
        by_id = {s.seq_id: s for s in self.scheduler.remove(set(ids))}
        sp = self.speculator
        states = [export_state(by_id[i], sp.depth(i) if sp is not None else 0) for i in ids]
        if sp is not None:
            sp.release(ids)
        return states

    def import_(self, states: list[SeqState]) -> list[int]:
        """Queues exported sequences; each re-prefills its prompt and tokens so far, then goes on exactly as it
        would have where it was. Returns their ids here."""
        self._new_batch()
        ids = []
        for st in states:
            s = import_state(self._next_id, st)
            self._next_id += 1
            if self.speculator is not None:
                self.speculator.resume(s.seq_id, st.spec_depth)
            try:
                self._check_fits(s)
                self.scheduler.add([s])
            except ValueError as e:
                s.finish("error", str(e))
                self._done.append(s)
            ids.append(s.seq_id)
        return ids

    @property
    def kept_tokens(self) -> int:
        """Positions that resumed requests did not prefill because their K/V was kept (since the engine began)."""
        return self.scheduler.resumed_tokens

    @property
    def shared_tokens(self) -> int:
        """Prompt positions that requests took from other requests' live blocks (EngineConfig.prefix_cache)."""
        return self.scheduler.shared_tokens

    def drop_kept(self, ids: list[int]) -> None:
        """Frees the K/V that finished sequences with keep_kv parked (no request will resume them); unknown ids
        and ids whose K/V memory took already are ignored."""
        self.scheduler.drop_parked(ids)

    def sleep(self) -> None:
        """Frees the KV pools and the CUDA-graph pool between rollouts (verl's hybrid engine): colocated on a GPU,
        the policy update gets that memory. `wake` takes it back; nothing may be running or waiting."""
        if self.has_work():
            raise RuntimeError("the engine cannot sleep with requests running or waiting")
        self.drop_kept(list(self.scheduler.parked))
        if self.runner.graphs is not None:
            self.runner.graphs.clear()
        self.runner.kv.sleep()
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        self.runner.kv.wake()

    def end_rollout(self, stats: GenerateStats | None = None) -> None:
        """One rollout (an RL step) ended: the history drafter keeps this epoch's responses; stats.stale gets
        the acceptance watchdog's verdict per drafter."""
        self._estimate_off(stats)
        self.drop_kept(list(self.scheduler.parked))  # kept K/V does not outlive its rollout (weights move)
        self.runner.kv.tables.forget()  # nor does the prefix index
        if self.speculator is not None:
            # the ledger (speculative/ledger.py) weighs the rollout by its own schedule's estimate only
            est = stats.speedup_est if stats is not None and stats.off_body_s + stats.off_tail_s else None
            rest = self.speculator.selector.ledger.metrics()  # of the rollout that ended, before it moves on
            stale = self.speculator.end_rollout(est)
            if stats is not None:
                stats.stale = stale
                stats.gauges = {k: v for d in self.speculator.drafters.values() if hasattr(d, "gauges")
                                for k, v in d.gauges().items()}
                if self.speculator.cfg.mode == "auto":
                    stats.gauges.update(rest)
        if self._gc_frozen:
            gc.unfreeze()
            self._gc_frozen = False

    def _estimate_off(self, stats: GenerateStats | None) -> None:
        """The SD-off estimate of a rollout that ran to its end here: its sequences' own plain schedule, a tool
        trajectory's turns one after another, priced by the selector's step-time model (speculative/off_estimate.py),
        in stats.off_body_s / off_tail_s."""
        col = self._collector
        if (self.speculator is None or stats is None or col is None or col.stats is not stats
                or any(i not in col.done for i in col.ids)):  # (a partial rollout with tools: later turns are in done)
            return
        first = set(col.ids)
        ids = list(col.ids) + [i for i in col.done if i not in first]  # then later turns (tools)
        comps = [col.done[i] for i in ids]
        lengths = [len(c.token_ids) for c in comps]
        est = off_seconds(self.speculator.selector.plain_step_s, [len(c.prompt_token_ids) for c in comps], lengths,
                          stats.tail_size, turn_starts(ids, lengths, [c.continues for c in comps]))
        if est is not None:
            stats.off_body_s, stats.off_tail_s = est

    def _new_batch(self) -> None:
        """Requests or imported sequences arrive at an idle engine: a new batch, whose weights may have moved since
        the last (model/packed.py), whichever of add_requests and import_ comes first (a partial rollout imports
        its carried responses first: under packs of the last rollout's weights, they decoded from the old policy)."""
        if not self.has_work():
            invalidate_packs()
            self._pause_old_gc()
            self.runner.kv.tables.forget()  # K/V of earlier weights is not shared with new requests

    def _pause_old_gc(self) -> None:
        """A rollout starts: the objects that exist now (the model, the drafters' indexes of earlier epochs, the
        libraries) leave the collector's view until it ends. Python's full collections otherwise rescan all of
        them every few hundred decode steps' allocations; on a GPU, where a step's forward takes a few ms, that
        made the history drafter's index updates cost 56 us per sequence-step instead of 4 (CPU profile,
        benchmarks/RESULTS.md). O(1) both ways; `end_rollout` hands them back, so cyclic garbage made before
        the rollout is collected after it, not lost."""
        if not self._gc_frozen and gc.isenabled():
            gc.freeze()
            self._gc_frozen = True

    # ---- the loop -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> StepOutput:
        finished, self._done = self._done, []
        sched = self.scheduler
        groups = sched.admit()
        if not groups and sched.running:
            sched.make_room(self.lookahead)  # may preempt (those wait) or cut a sequence the pool cannot hold
        finished += sched.take_dropped()
        if groups:
            record = prefill_pass(self.runner, self.speculator, self.tokenizer, groups)
        elif sched.running:
            if self.speculator is not None:  # finished sequences make room for waiting ones (Selector.worth)
                self.speculator.queued = bool(sched.waiting)
            record = decode_pass(self.runner, self.speculator, self.tokenizer, sched.running)
        else:
            record = StepRecord("idle")
        finished += sched.release_finished()
        record.kv_bytes = self.runner.kv.used_bytes()
        record.preempted, sched.preempted = sched.preempted, 0
        return StepOutput(self._complete(finished), record)

    def _complete(self, seqs: list[Sequence]) -> list[Completion]:
        """Finished sequences leave: the speculator drops its state for them."""
        if self.speculator is not None:
            self.speculator.release([s.seq_id for s in seqs])
        return [s.to_completion() for s in seqs]

    def collector(self, ids: list[int]) -> Collector:
        """Gathers these requests' completions and stats from the steps a caller drives; `last_stats` follows its
        stats from now on (the rollout running now: what a progress line reads)."""
        col = Collector(ids)
        self.last_stats = col.stats
        self._collector = col
        return col

    def generate(self, prompts: list, sampling: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> Completions:
        """Returns one Completion per sample, ordered by (prompt, sample); `.stats` holds this call's stats."""
        col = self.collector(self.add_requests(prompts, sampling))
        with progress_bar(len(col.ids), progress) as bar:
            while self.has_work():
                out = self.step()
                col.add(out)
                bar.update(len(out.finished))
        self.end_rollout(col.stats)
        return col.result()
