"""Continuous batching: which sample groups join the running batch this step, and slot bookkeeping.

Groups (the n samples of one prompt, or one imported sequence) are admitted FIFO while the cache layout has a
free slot for each and the group's longest possible sequence fits a slot; a finished sequence leaves at once
and the last running one moves into its slot. When nothing runs, the cache is laid out for the longest
waiting request, so a rollout of similar requests allocates its cache once."""

from __future__ import annotations

from collections import deque

from .runner import ModelRunner
from .sequence import Sequence


def prefill_len(s: Sequence) -> int:
    """Tokens a group's leader prefills: its prompt, or prompt and tokens so far for an imported sequence."""
    return s.cache_len if s.output_ids else len(s.prompt_ids)


class Scheduler:
    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_prefill_tokens: int):
        self.runner = runner
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[list[Sequence]] = deque()
        self.running: list[Sequence] = []  # running[i] lives in KV slot i

    def add(self, group: list[Sequence]) -> None:
        self.waiting.append(group)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return sum(len(g) for g in self.waiting)

    def admit(self) -> list[list[Sequence]]:
        if not self.running and self.waiting:
            self.runner.reserve(max(g[0].reserved_len for g in self.waiting))
        admitted: list[list[Sequence]] = []
        slots = min(self.max_num_seqs, self.runner.num_slots)
        prefill_tokens = 0
        while self.waiting:
            group = self.waiting[0]
            free, plen = slots - len(self.running), prefill_len(group[0])
            if group[0].reserved_len > self.runner.capacity or free < 1:
                break  # waits for the running batch to drain (then the cache is laid out for it)
            if admitted and prefill_tokens + plen > self.max_prefill_tokens:
                break
            if len(group) > free:  # a group larger than the free slots is split; each part prefills
                self.waiting[0] = group[free:]
                group = group[:free]
            else:
                self.waiting.popleft()
            for seq in group:
                seq.slot = len(self.running)
                self.running.append(seq)
            admitted.append(group)
            prefill_tokens += plen
            if len(self.running) == slots:
                break
        return admitted

    def release_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        self.remove_running(done)
        return done

    def remove_running(self, seqs: list[Sequence]) -> None:
        for seq in sorted(seqs, key=lambda s: -s.slot):  # fill holes from the end, highest hole first
            last = self.running[-1]
            if last is not seq:
                self.runner.copy_slot(last.slot, seq.slot, last.cache_len)
                last.slot = seq.slot
                self.running[seq.slot] = last
            self.running.pop()
            seq.slot = -1

    def remove(self, ids: set[int]) -> list[Sequence]:
        """Takes the sequences with these ids out of the waiting queue and the running batch."""
        out = [s for s in self.running if s.seq_id in ids]
        self.remove_running(out)
        kept: deque[list[Sequence]] = deque()
        for g in self.waiting:
            rest = [s for s in g if s.seq_id not in ids]
            out.extend(s for s in g if s.seq_id in ids)
            if rest:
                kept.append(rest)
        self.waiting = kept
        return out
