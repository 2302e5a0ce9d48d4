"""Token streams indexed by their n-grams, and draft trees built from what followed a matched suffix.

This is SuffixDecoding's idea computed at query time: find the longest suffix of the current context that
occurs in the streams (an n-gram hash lookup, then extended backwards per occurrence), gather what followed
each occurrence, count the continuations in a trie and expand it best-first by estimated probability
(count(child) / count(parent), multiplied along the path) until the budget or the probability floor."""

from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass

from .tree import DraftTree


POS_BITS = 32  # an occurrence is one int: stream << POS_BITS | position after the n-gram
TOKEN_BITS = 32  # an n-gram key packs its tokens (+1) in this many bits each (gram_key)


class TokenIndex:
    """Streams and, per n-gram (n <= max_n), where it ended: the most recent 2 * max_occurrences at most.

    Indexing is lazy: `extend` only appends tokens, and the first `match` after it indexes what was appended
    since. Every running sequence's tokens reach two indexes each step (its own prompt lookup, its prompt's
    history), yet most are never queried: at large batches the selector decodes plainly, and a sequence that
    finishes before the long tail may never be drafted for. On a GPU, indexing every token eagerly cost more
    host time than the forward (benchmarks/host_overhead.py). What is indexed allocates nothing the garbage
    collector tracks: keys are ints packing the n-gram, occurrences are ints in `array`s."""

    def __init__(self, max_n: int = 3, max_occurrences: int = 256):
        self.max_n = max_n
        self.max_occurrences = max_occurrences
        self.streams: list[list[int]] = []
        self.grams: dict[int, array] = {}  # gram_key(n-gram) -> occurrences
        self.indexed: list[int] = []  # per stream, how many of its tokens are in `grams`
        self.dirty: dict[int, None] = {}  # streams with tokens not indexed yet, in the order they grew

    def add_stream(self, tokens: list[int]) -> int:
        self.streams.append([])
        self.indexed.append(0)
        sid = len(self.streams) - 1
        self.extend(sid, tokens)
        return sid

    def extend(self, sid: int, tokens: list[int]) -> None:
        if tokens:
            self.streams[sid].extend(tokens)
            self.dirty[sid] = None

    def catch_up(self) -> None:
        """Indexes every token appended since the last call."""
        for sid in self.dirty:
            self._index(sid)
        self.dirty.clear()

    def _index(self, sid: int) -> None:
        s = self.streams[sid]
        grams, max_n, cap = self.grams, self.max_n, 2 * self.max_occurrences
        base = sid << POS_BITS
        for end in range(self.indexed[sid] + 1, len(s) + 1):
            key = 0
            for n in range(1, min(max_n, end) + 1):
                key = (key << TOKEN_BITS) | (s[end - n] + 1)  # +1: a token 0 still shifts the key
                occ = grams.get(key)
                if occ is None:
                    grams[key] = array("q", (base | end,))
                else:
                    occ.append(base | end)
                    if len(occ) > cap:  # keep the most recent; bounded work per query
                        del occ[: self.max_occurrences]
        self.indexed[sid] = len(s)

    def match(self, context: list[int], max_match: int = 32) -> tuple[int, list[tuple[int, int]]]:
        """Longest match length m of a suffix of context and the occurrences (stream, position after) that have it
        and a continuation."""
        if self.dirty:
            self.catch_up()
        mask = (1 << POS_BITS) - 1
        for n in range(min(self.max_n, len(context)), 0, -1):
            occ = self.grams.get(gram_key(context[len(context) - n :]))
            if not occ:
                continue
            best, found = 0, []
            for o in occ[-self.max_occurrences :]:
                sid, pos = o >> POS_BITS, o & mask
                s = self.streams[sid]
                if pos >= len(s):
                    continue  # the context itself, or a stream with nothing after the match yet
                m = n
                while m < max_match and m < pos and m < len(context) and s[pos - m - 1] == context[-m - 1]:
                    m += 1
                if m > best:
                    best, found = m, [(sid, pos)]
                elif m == best:
                    found.append((sid, pos))
            if found:
                return best, found
        return 0, []


def gram_key(gram: list[int]) -> int:
    """The int key of an n-gram: its tokens (+1) from the last backwards, TOKEN_BITS each, so grams of different
    lengths or tokens never share a key (for token ids below 2**32 - 1)."""
    key = 0
    for t in reversed(gram):
        key = (key << TOKEN_BITS) | (t + 1)
    return key


@dataclass
class TreeShape:
    budget: int  # most nodes
    max_depth: int
    min_prob: float = 0.1  # stop expanding below this estimated probability
    chain: bool = False  # follow only the most frequent child


def build_tree(streams: list[list[int]], occurrences: list[tuple[int, int]], shape: TreeShape, drafter: str) -> DraftTree | None:
    """Best-first tree over the continuations that follow the occurrences."""
    if shape.budget < 1 or shape.max_depth < 1 or not occurrences:
        return None
    # trie of continuations: node -> {token: [count, child]}
    root: dict = {}
    for sid, pos in occurrences:
        node = root
        for t in streams[sid][pos : pos + shape.max_depth]:
            entry = node.get(t)
            if entry is None:
                entry = node[t] = [0, {}]
            entry[0] += 1
            node = entry[1]
    tokens, parents, cond, support = [], [], [], []
    total = len(occurrences)
    heap = [(-c / total, k, t, -1, child, c, total) for k, (t, (c, child)) in enumerate(_ranked(root))]
    if shape.chain:
        heap = heap[:1]
    heapq.heapify(heap)
    counter = len(heap)
    while heap and len(tokens) < shape.budget:
        neg_p, _, tok, parent, children, count, of = heapq.heappop(heap)
        if -neg_p < shape.min_prob:
            break
        tokens.append(tok)
        parents.append(parent)
        cond.append(count / of)
        support.append(of)
        me = len(tokens) - 1
        parent_count = sum(c for c, _ in children.values())
        for t, (c, child) in _ranked(children)[: 1 if shape.chain else None]:
            heapq.heappush(heap, (neg_p * c / parent_count, counter, t, me, child, c, parent_count))
            counter += 1
    return DraftTree(tokens, parents, drafter=drafter, cond=cond, support=support) if tokens else None


def _ranked(children: dict) -> list:
    return sorted(children.items(), key=lambda kv: -kv[1][0])
