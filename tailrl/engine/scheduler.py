"""Continuous batching on a paged KV cache: which sample groups join the running batch, the blocks each running
sequence holds, and preemption when the pool runs short.

Admission is optimistic (vLLM's, SGLang's): a group (the n samples of one prompt, or one imported or preempted
sequence) joins while a row is free and the blocks its prefill takes (its prompt once, plus one block per further
sample: the fork's copy of the partial last block) leave at least `watermark` blocks free. Nothing is reserved
for `max_tokens`. Before each decode pass every running sequence gets a block for its next token; when the pool
is short the most recently admitted sequences are preempted: their blocks go back and they wait at the front of
the queue, to be recomputed by a prefill of prompt and tokens so far. Noise is keyed by (seed, position) and a
batch-invariant prefill gives a token the bits decoding gave it, so a preempted sequence emits the very tokens it
would have emitted (tests/engine/test_paged.py). A sequence that outgrows the whole pool alone finishes ("length", with
an error naming the numbers) and the rest goes on.

Kept KV across requests (an agent's turns): a sample whose params ask `keep_kv` and that finishes on a stop parks
its blocks (prompt and tokens but the stop token) under its seq_id; a later request that names it as `resume` and
whose prompt starts with those tokens takes them over at admission and prefills only the rest. Parked blocks are
the first thing memory takes: admission and make_room free the oldest parked entries before they wait or preempt,
so a slow tool never starves running sequences and the pool never deadlocks on parked KV; a request whose entry
was freed prefills everything, as a preempted sequence does. On the batch-invariant passes both give the same bits
(a continuation's prefill rows meet the calls a whole prefill's rows meet: engine/invariant.py), so the tokens do
not depend on which happened; on the plain passes they agree to rounding only. Not with captured hidden states
(the learned drafter needs every row's): nothing is parked then.

Shared prompt prefixes (prefix_cache): at admission a group's leader takes the longest run of live full blocks whose
chained keys match its first blocks (other prompts with the same system prompt or few-shot turns; its own prompt
when it comes back after preemption), whole blocks before its last position only, and prefills the rest; its own full
prompt blocks are then indexed for later requests. A group whose prefix this very admission round computes waits
for the next (its blocks would be read before they are written). Not with captured hidden states.

Running sequences occupy rows 0..B-1 of the block tables: a finished sequence's row is taken over by the last
running one (its table moves, no K/V is copied)."""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

from .blocks import BLOCK, blocks_for, chain_keys
from .runner import ModelRunner
from .sequence import Sequence

log = logging.getLogger(__name__)


def prefill_len(s: Sequence) -> int:
    """Tokens a group's leader prefills: its prompt, or prompt and tokens so far for an imported sequence."""
    return s.cache_len if s.output_ids else len(s.prompt_ids)


class Scheduler:
    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_prefill_tokens: int, watermark: float = 0.01,
                 prefix_cache: bool = False):
        self.runner = runner
        self.kv = runner.kv
        self.max_num_seqs = min(max_num_seqs, runner.num_slots)
        self.max_prefill_tokens = max_prefill_tokens
        self.watermark = max(int(watermark * (self.kv.num_blocks - 1)), 1)
        self.waiting: deque[list[Sequence]] = deque()
        self.running: list[Sequence] = []  # running[i] lives in row i of the block tables
        self.dropped: list[Sequence] = []  # finished outside a pass (cannot fit the pool): the engine returns them
        self.preempted = 0  # preemptions since the last take_counts
        self.order: dict[int, int] = {}  # seq_id -> admission number (preemption takes the newest)
        self._admitted = 0
        self.parked: OrderedDict[int, tuple[list[int], list[int]]] = OrderedDict()  # seq_id -> (tokens, blocks)
        self.resumed_tokens = 0  # positions resumed requests did not prefill (kept K/V), since the engine began
        self.evicted = 0  # parked entries freed for memory, since the engine began
        self.prefix_cache = prefix_cache and not runner.capture  # captured hidden states need every row's pass
        self.shared_tokens = 0  # prompt positions taken from another request's live blocks, since the engine began

    def add(self, group: list[Sequence]) -> None:
        self.waiting.append(group)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return sum(len(g) for g in self.waiting)

    def admit(self) -> list[list[Sequence]]:
        admitted: list[list[Sequence]] = []
        prefill_tokens = forks = 0  # forks: blocks the admitted groups' further samples take after the prefill
        pending: set[int] = set()  # prefix keys of blocks this call's prefill has yet to compute
        while self.waiting:
            group = self.waiting[0]
            free_rows, plen = self.max_num_seqs - len(self.running), prefill_len(group[0])
            if free_rows < 1:
                break
            lead_seq = group[0]
            keys = chain_keys(lead_seq.prompt_ids + lead_seq.output_ids[:-1], plen // BLOCK) if self.prefix_cache else []
            reuse, blocks = self._claim(group)  # positions and blocks of parked K/V this request continues
            owned = bool(blocks)
            if not owned and keys:  # else live blocks of the same prefix, whole blocks before its last position
                blocks = self.kv.tables.lookup(keys[: (plen - 1) // BLOCK])
                if pending.intersection(keys[: len(blocks)]):  # its prefix is in this very pass: shared from the next
                    break
                reuse = len(blocks) * BLOCK
            if admitted and prefill_tokens + plen - reuse > self.max_prefill_tokens:
                break
            lead = blocks_for(plen + 1) - len(blocks)  # the prompt and the first sampled token's position
            idle = not self.running and not admitted
            spare = self.kv.tables.num_free - forks - (0 if idle else self.watermark)
            k = min(len(group), free_rows, spare - lead + 1)  # samples that fit: lead + (k - 1) blocks
            if k < 1 and self.parked:  # parked K/V gives way first, then the group waits
                self._evict_oldest()
                continue
            if k < 1:
                if idle:  # the empty pool cannot hold its prompt
                    self.waiting.popleft()
                    self._drop(group, f"its {plen} tokens need {lead} KV blocks of {BLOCK} tokens; the cache "
                                      f"holds {self.kv.num_blocks - 1}: raise kv_cache_gb")
                    continue
                break
            if owned:
                del self.parked[lead_seq.params.resume]
            if k < len(group):  # the rest of the group waits; each part prefills
                self.waiting[0] = group[k:]
                group = group[:k]
            else:
                self.waiting.popleft()
            for seq in group:
                seq.slot = len(self.running)
                self.running.append(seq)
                self._admitted += 1
                self.order[seq.seq_id] = self._admitted
            lead_seq.kept = 0  # a preempted resumed request held its K/V once: it prefills everything now
            if owned:
                self.kv.tables.attach(lead_seq.slot, blocks)
                lead_seq.kept = min(reuse, plen - 1)  # at least one token prefills: its logits
                self.resumed_tokens += lead_seq.kept
            elif blocks:  # whole blocks before its last position: nothing it writes lands in a shared block
                self.kv.tables.share(lead_seq.slot, blocks)
                lead_seq.kept = reuse
                self.shared_tokens += reuse
            self.kv.ensure([lead_seq.slot], plen + 1)  # siblings fork it after the prefill (engine/passes.py)
            if keys:  # its full prompt blocks serve later requests with the same prefix
                self.kv.tables.remember(lead_seq.slot, keys)
                pending.update(keys)
            admitted.append(group)
            prefill_tokens += plen - lead_seq.kept
            forks += len(group) - 1
        return admitted

    def _claim(self, group: list[Sequence]) -> tuple[int, list[int]]:
        """(positions, blocks) parked for this group's `resume` when it is one fresh sample whose prompt continues
        them; (0, []) otherwise (it prefills everything, and an entry it does not continue is freed: only the
        request that names it could use it)."""
        s = group[0]
        entry = self.parked.get(s.params.resume) if s.params.resume is not None else None
        if entry is None:
            return 0, []
        if len(group) > 1 or s.output_ids or s.prompt_ids[: len(entry[0])] != entry[0]:
            self.drop_parked([s.params.resume])
            return 0, []
        return len(entry[0]), entry[1]

    def park(self, seqs: list[Sequence]) -> None:
        """Finished sequences that asked keep_kv and stopped on a stop keep their blocks (not past their tokens)."""
        if self.runner.capture:
            return
        t = self.kv.tables
        for s in seqs:
            if s.params.keep_kv and s.finish_reason == "stop" and s.slot >= 0:
                toks = s.prompt_ids + s.output_ids[:-1]
                blocks = t.detach(s.slot)
                n = blocks_for(len(toks))
                t.drop(blocks[n:])
                self.parked[s.seq_id] = (toks, blocks[:n])

    def drop_parked(self, ids) -> None:
        for i in ids:
            entry = self.parked.pop(i, None)
            if entry is not None:
                self.kv.tables.drop(entry[1])

    def _evict_oldest(self) -> None:
        self.drop_parked([next(iter(self.parked))])
        self.evicted += 1

    def make_room(self, lookahead: int = 0) -> None:
        """Before a decode pass: each running sequence gets a block for its next root, oldest first, preempting
        the newest while the pool is short; then, while more than the watermark stays free, room for `lookahead`
        draft rows past it."""
        for s in sorted(self.running, key=lambda s: self.order[s.seq_id]):
            while s.slot >= 0 and not self.kv.grow(s.slot, s.cache_len + 1):
                if self.parked:  # parked K/V goes before any running sequence is preempted
                    self._evict_oldest()
                    continue
                victim = max(self.running, key=lambda r: self.order[r.seq_id])
                if victim is s and len(self.running) == 1:
                    held = self.kv.tables.held(s.slot)
                    self.remove_running([s])
                    self._drop([s], f"the sequence outgrew the whole KV cache: {s.cache_len + 1} positions need "
                                    f"{blocks_for(s.cache_len + 1)} blocks of {BLOCK}, the cache holds "
                                    f"{self.kv.num_blocks - 1} ({held} positions held); raise kv_cache_gb",
                               reason="length")
                    break
                self.preempt(victim)
        if lookahead:
            for s in self.running:
                if self.kv.tables.num_free > self.watermark + 2:
                    want = min(s.cache_len + 1 + lookahead, s.reserved_len)
                    self.kv.grow(s.slot, want)

    def preempt(self, s: Sequence) -> None:
        """Gives s's blocks back; it waits at the front of the queue and is recomputed (prompt and tokens so far)."""
        self.remove_running([s])
        self.order.pop(s.seq_id, None)
        self.waiting.appendleft([s])
        self.preempted += 1

    def _drop(self, seqs: list[Sequence], why: str, reason: str = "error") -> None:
        log.warning("request %d: %s", seqs[0].prompt_index, why)
        for s in seqs:
            s.finish(reason, why)
        self.dropped.extend(seqs)

    def take_dropped(self) -> list[Sequence]:
        out, self.dropped = self.dropped, []
        return out

    def release_finished(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        self.park(done)
        self.remove_running(done)
        return done

    def remove_running(self, seqs: list[Sequence]) -> None:
        for seq in sorted(seqs, key=lambda s: -s.slot):  # fill holes from the end, highest hole first
            self.kv.release(seq.slot)
            last = self.running[-1]
            if last is not seq:
                self.kv.move_row(last.slot, seq.slot)
                last.slot = seq.slot
                self.running[seq.slot] = last
            self.running.pop()
            self.order.pop(seq.seq_id, None)
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
