"""The rollout engine: `add_requests` / `step` / `generate`, with continuous batching and speculation.

One `step()` either prefills newly admitted groups or runs one decode pass over every running sequence (with
the speculator's draft trees verified in the same forward). It returns the sequences that finished and a
`StepRecord`; callers that need to act between steps (the RL loop, rollout workers) drive `step()` themselves,
and `generate()` is the short loop over it. The caller composes the speculator (tailrl.drafter adds the
learned drafter), so the engine never imports a drafter."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..model.llama import CausalLM
from ..spec.selector import OFF
from ..spec.speculator import Speculator
from .config import EngineConfig
from .output import append_tokens
from .requests import SeqState, check_prompt, encode, export_state, import_state, make_group
from .runner import ModelRunner
from .sampler import decide, sample, warp_tensors, warped_logprobs
from .sampling import SamplingParams
from .scheduler import Scheduler, prefill_len
from .sequence import Completion, Sequence
from .stats import Completions, GenerateStats, StepRecord

log = logging.getLogger(__name__)


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
        self.runner = ModelRunner(model, budget, cfg.max_num_seqs, self.max_model_len, capture)
        if self.speculator is not None:
            self.speculator.attach(self.runner.kv)
        self.scheduler = Scheduler(self.runner, cfg.max_num_seqs, cfg.max_prefill_tokens)
        self.eos_ids = frozenset(mc.eos_token_id) | frozenset(
            [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else [])
        self.rng = torch.Generator().manual_seed(cfg.seed)
        self.last_stats = GenerateStats()
        self._next_id = 0
        self._done: list[Sequence] = []  # finished outside a step (rejected requests): returned by the next step

    def encode(self, prompt) -> list[int]:
        return encode(self.tokenizer, prompt)

    # ---- requests -------------------------------------------------------------------------------------------

    def add_requests(self, prompts: list, sampling: SamplingParams | list[SamplingParams] | None = None,
                     prompt_indices: list[int] | None = None) -> list[int]:
        """Queues each prompt's n samples; returns their sequence ids in (prompt, sample) order. A bad prompt
        fails alone: its samples come back from the next step with finish_reason "error" naming the problem."""
        sampling = sampling or SamplingParams()
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        indices = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
        if not len(params) == len(indices) == len(prompts):
            raise ValueError(f"got {len(params)} sampling params and {len(indices)} indices for {len(prompts)} prompts")
        ids = []
        for prompt, p, index in zip(prompts, params, indices):
            try:
                toks = self.encode(prompt)
                check_prompt(toks, self.model.config.vocab_size, self.max_model_len)
                stop = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids)
                group = make_group(self._next_id, index, toks, p, self.max_model_len, stop, self.rng)
                self._check_fits(group[0])
                chunk = min(self.config.max_num_seqs, self.runner.slots_for(group[0].reserved_len))
                for k in range(0, len(group), chunk):  # the samples of a chunk share one prefill
                    self.scheduler.add(group[k : k + chunk])
            except ValueError as e:
                log.warning("request %d rejected: %s", index, e)
                group = [Sequence(self._next_id + j, index, j, [], p, 0, 0, frozenset(), time.perf_counter())
                         for j in range(p.n)]
                for s in group:
                    s.finish("error", str(e))
                self._done.extend(group)
            self._next_id += p.n
            ids.extend(s.seq_id for s in group)
        return ids

    def _check_fits(self, s: Sequence) -> None:
        if not self.runner.fits(s.reserved_len):
            raise ValueError(f"the prompt needs {s.reserved_len} tokens of KV cache per sample but the budget holds "
                             f"{self.runner.kv.budget_tokens}; raise kv_cache_gb or lower max_tokens")

    def has_work(self) -> bool:
        return bool(self._done) or self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def abort(self, ids: list[int]) -> list[Completion]:
        seqs = self.scheduler.remove(set(ids))
        for s in seqs:
            s.finish("abort")
        return [s.to_completion() for s in seqs]

    def export(self, ids: list[int]) -> list[SeqState]:
        """Takes running or waiting sequences out of this engine, as states another engine can import_."""
        return [export_state(s) for s in self.scheduler.remove(set(ids))]

    def import_(self, states: list[SeqState]) -> list[int]:
        """Queues exported sequences; each re-prefills its prompt and tokens so far, then goes on exactly as it
        would have where it was. Returns their ids here."""
        ids = []
        for st in states:
            s = import_state(self._next_id, st)
            self._next_id += 1
            try:
                self._check_fits(s)
                self.scheduler.add([s])
            except ValueError as e:
                s.finish("error", str(e))
                self._done.append(s)
            ids.append(s.seq_id)
        return ids

    def end_rollout(self) -> None:
        """One rollout (an RL step) ended: the history drafter keeps this epoch's responses."""
        if self.speculator is not None:
            self.speculator.end_rollout()

    # ---- the loop -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> StepOutput:
        finished, self._done = self._done, []
        groups = self.scheduler.admit()
        if groups:
            record = self._prefill(groups)
        elif self.scheduler.running:
            record = self._decode(self.scheduler.running)
        else:
            record = StepRecord("idle")
        finished += self.scheduler.release_finished()
        record.kv_bytes = self.runner.kv.allocated_bytes()
        return StepOutput([s.to_completion() for s in finished], record)

    def _prefill(self, groups: list[list[Sequence]]) -> StepRecord:
        t = time.perf_counter()
        leaders = [g[0] for g in groups]
        lists = [s.prompt_ids + s.output_ids[:-1] for s in leaders]
        logits, hidden = self.runner.prefill(lists, [s.slot for s in leaders])
        fwd = time.perf_counter() - t
        if self.speculator is not None:
            self.speculator.record_forward(sum(map(len, lists)), fwd)
        chunks = hidden.split([len(x) for x in lists]) if hidden is not None else [None] * len(groups)
        fresh, rows = [], []
        for i, (g, chunk) in enumerate(zip(groups, chunks)):
            for s in g[1:]:  # the samples of a prompt share its prefill
                self.runner.copy_slot(g[0].slot, s.slot, prefill_len(g[0]))
            for s in g:
                s.t_admit, s.hidden = t, [chunk] if chunk is not None else []
            if not g[0].output_ids:
                fresh += g
                rows += [i] * len(g)
        emitted = 0
        if fresh:
            logp = warped_logprobs(logits[rows], *warp_tensors([s.params for s in fresh], logits.device))
            tokens, lps = sample(logp, [s.params.greedy for s in fresh], [s.seed for s in fresh], [0] * len(fresh))
            emitted = sum(append_tokens(s, [x], [lp], self.tokenizer) for s, x, lp in zip(fresh, tokens, lps))
        if self.speculator is not None:
            self.speculator.start([s for g in groups for s in g])
        return StepRecord("prefill", batch=len(leaders), tokens_in_pass=sum(map(len, lists)), emitted=emitted,
                          forward_s=fwd, total_s=time.perf_counter() - t)

    def _decode(self, running: list[Sequence]) -> StepRecord:
        """One decode pass for every running sequence; with speculation, each verifies its draft tree in the same
        forward and emits 1 + accepted tokens."""
        t0 = time.perf_counter()
        arm, trees = self.speculator.plan(running) if self.speculator is not None else (OFF, None)
        t1 = time.perf_counter()
        cache_lens = [s.cache_len for s in running]
        logits, hidden, q_lens, depths = self.runner.decode([s.output_ids[-1] for s in running], cache_lens, trees)
        t2 = time.perf_counter()
        verdicts = decide(logits, running, trees, q_lens, depths)
        if trees:
            self.runner.keep_accepted(cache_lens, [v.accepted_nodes for v in verdicts])
        if hidden is not None:  # the verified path's hidden states: the root, then the accepted nodes
            rows = [[off] + [off + 1 + a for a in v.accepted_nodes] for off, v in zip(_offsets(q_lens), verdicts)]
            kept = hidden[torch.tensor([r for rs in rows for r in rs], device=hidden.device)]
            for s, chunk in zip(running, kept.split([len(r) for r in rows])):
                s.hidden.append(chunk)
        emitted = 0
        for s, v in zip(running, verdicts):
            n = append_tokens(s, v.tokens, v.logprobs, self.tokenizer)
            v.tokens, v.logprobs = v.tokens[:n], v.logprobs[:n]
            s.decode_steps += 1
            s.decode_tokens += n
            emitted += n
        t3 = time.perf_counter()
        B = len(running)
        record = StepRecord("decode", B, sum(q_lens), str(arm), arm.drafter, sum(1 for t in trees or () if t),
                            sum(len(t) for t in trees or () if t), emitted, emitted - B if arm != OFF else 0,
                            t1 - t0, t2 - t1, t3 - t2, t3 - t0)
        if self.speculator is not None:
            self.speculator.observe(record, running, verdicts)
        return record

    def generate(self, prompts: list, sampling: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> Completions:
        """Returns one Completion per sample, ordered by (prompt, sample); `.stats` holds this call's stats."""
        t0 = time.perf_counter()
        ids = self.add_requests(prompts, sampling)
        stats = self.last_stats = GenerateStats(tail_batch=max(self.config.tail_batch, int(self.config.tail_frac * len(ids))))
        done: dict[int, Completion] = {}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="seq", dynamic_ncols=True)
        while self.has_work():
            out = self.step()
            stats.add(out.record)
            done.update((c.seq_id, c) for c in out.finished)
            if bar is not None and out.finished:
                bar.update(len(out.finished))
                bar.set_postfix(tok_s=f"{stats.generated_tokens / (time.perf_counter() - t0):.1f}", running=self.num_running)
        if bar is not None:
            bar.close()
        self.end_rollout()
        stats.total_s = time.perf_counter() - t0
        result = Completions(done[i] for i in ids)
        result.stats = stats
        return result


def _offsets(q_lens: list[int]) -> list[int]:
    out, off = [], 0
    for q in q_lens:
        out.append(off)
        off += q
    return out
