"""Continuous batching: which sample groups join the running batch this step, and slot bookkeeping.

Groups (the n samples of one prompt) are admitted FIFO while the KV budget holds every running sequence at
its maximum length; a finished sequence leaves at once and the last running one moves into its slot."""

from __future__ import annotations

from collections import deque

from .kv_cache import KVCache
from .sequence import Sequence


class Scheduler:
    def __init__(self, kv: KVCache, max_num_seqs: int, max_prefill_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[list[Sequence]] = deque()
        self.running: list[Sequence] = []  # running[i] lives in KV slot i

    def add(self, group: list[Sequence]) -> None:
        self.waiting.append(group)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[list[Sequence]]:
        admitted: list[list[Sequence]] = []
        reserved = max((s.reserved_len for s in self.running), default=0)
        prefill_tokens = 0
        while self.waiting:
            group = self.waiting[0]
            n, plen = len(group), len(group[0].prompt_ids)
            need = max(reserved, group[0].reserved_len)
            if len(self.running) + n > self.max_num_seqs or not self.kv.fits(len(self.running) + n, need):
                break
            if admitted and prefill_tokens + plen > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            for seq in group:
                seq.slot = len(self.running)
                self.running.append(seq)
            admitted.append(group)
            reserved, prefill_tokens = need, prefill_tokens + plen
        return admitted

    def release_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        if not done:
            return done
        for seq in sorted(done, key=lambda s: -s.slot):  # fill holes from the end, highest hole first
            last = self.running[-1]
            if last is not seq:
                self.kv.copy(last.slot, seq.slot, last.cache_len)
                last.slot = seq.slot
                self.running[seq.slot] = last
            self.running.pop()
            seq.slot = -1
        return done
