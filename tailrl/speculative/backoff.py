"""What follows in a sequence's own text, as a distribution, and chains drafted from it with the verifier's noise.

A most-frequent-continuation draft is accepted with probability p(draft): where the policy's next token is
uncertain (a list of numbers, a choice between phrasings) that is low however good the guess. The verifier draws
the token at output position i as argmax over the vocabulary of log p(x) + G(seed, i, x) (speculative/noise.py); a
draft drawn as argmax of log q(x) + G(seed, i, x) with the same noise agrees with it with probability
P(argmax(log q + G) = argmax(log p + G)), which is 1 where q = p however flat p is. The draft stays a function
of the text and the seed, so the verifier's walk is unchanged and the emitted tokens are plain decoding's, bit
for bit.

q is a Witten-Bell backoff over the text's n-gram counts: exact contexts of 1..max_n tokens, and contexts of up
to max_class_n tokens in which every number token stands for its class ("a number", "a number after a space").
Reasoning text repeats templates with other numbers in them ("So, each friend gets 63491*4 = 21598." line after
line; "#### 105", "#### 106", ...): the class contexts see the template where exact ones see a number never seen
before. A class predicted next is spread over that class's tokens by the estimate below it. On recorded long-preset
rollouts (benchmarks/RESULTS.md) the slowest capped response needed 566 decode steps with exact contexts and 424
with number classes, at 7-token chains.

On top sits a template level for text that counts ("#### 105", "#### 106", ...; "#### 2606 55", "#### 2707 66"):
where the class context of at least MIN_TEMPLATE tokens occurred twice before, the token after its last occurrence
a and the one before b predict what comes now: the digit a + (a - b) mod 10 where both are single digits (a column
that counts), else a where a == b (a column that repeats). No context of the text predicts the last digit of a
number never written before; the column's step does. Its weight in q is how often that kind of prediction held in
the stream so far (an average over the last ~10). On the slowest response of one recorded rollout it cut the
decode steps from 578 to 336.

And a copy level for numbers being written: where the text is inside a number, the most recent of the last
RECENT_NUMBERS numbers that starts with the same tokens and runs on predicts the next one ("add 1 to 84466" after
"= 84466."; a result carried into the next line). Weighed the same way, by its own hit rate; where both levels
guess, the one whose guesses held more often speaks."""

from __future__ import annotations

import math
import re

from .noise import gumbel_py, hash3
from .tree import DraftTree

NUMBER, SPACED_NUMBER = -1, -2  # class ids (token ids are >= 0)
MIN_TEMPLATE = 4  # tokens of class context that place a template's column (a shorter one matches anywhere)
RECENT_NUMBERS = 8  # numbers the copy level looks back at
TRUST_DECAY = 0.9  # the template and copy levels' weight: a running average of its hits, this much memory per prediction
KEY_BITS = 32  # a context is one int: its tokens (+1) from the last backwards, KEY_BITS each
_DIGITS = [str(d) for d in range(10)]  # ASCII only: (class, digit) names one token
_NUMBER = re.compile(r"[ \u0120\u2581]?\d+")  # byte-level BPE writes a leading space as U+0120, SentencePiece as U+2581


def _pieces(tokenizer) -> list:
    """Every token's piece, or [] for no tokenizer or one without convert_ids_to_tokens (then no classes: exact
    contexts only)."""
    if tokenizer is None:
        return []
    try:
        return tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    except Exception:
        return []


def number_classes(tokenizer, pieces: list | None = None) -> dict[int, int]:
    """{token id: NUMBER or SPACED_NUMBER} for every token that is digits, with or without one leading space.
    pieces: the tokenizer's pieces when the caller has them (_pieces)."""
    pieces = _pieces(tokenizer) if pieces is None else pieces
    return {i: (NUMBER if p[0].isdigit() else SPACED_NUMBER)
            for i, p in enumerate(pieces) if isinstance(p, str) and _NUMBER.fullmatch(p)}


def digit_values(tokenizer, pieces: list | None = None) -> dict[int, int]:
    """{token id: its digit} for every token that is one digit, with or without one leading space."""
    pieces = _pieces(tokenizer) if pieces is None else pieces
    return {i: int(p[-1]) for i, p in enumerate(pieces)
            if isinstance(p, str) and p.lstrip(" \u0120\u2581") in _DIGITS and len(p) <= 2}


def token_classes(tokenizer) -> tuple[dict[int, int], dict[int, int]]:
    """(number_classes, digit_values) of a tokenizer, its pieces read once."""
    pieces = _pieces(tokenizer)
    return number_classes(None, pieces), digit_values(None, pieces)


class BackoffModel:
    """Counts of what followed each context in one stream. Lazy: `extend` appends, the next query counts."""

    def __init__(self, tokens: list[int], classes: dict[int, int], max_n: int = 3, max_class_n: int = 10,
                 digits: dict[int, int] | None = None):
        """digits: {token id: digit} of single-digit tokens (digit_values), for the template level's counting
        columns; without them it only repeats."""
        self.classes, self.max_n = classes, max_n
        self.max_class_n = max_class_n if classes else 0
        self.digits = digits or {}
        self.digit_token = {(classes.get(t, t), d): t for t, d in self.digits.items()}  # (class, digit) -> token
        self.last_two: dict[int, tuple[int, int]] = {}  # class context key -> its last two next positions (or -1)
        self.trust = [0.5, 0.5, 0.5]  # hit rates: counting columns, repeating columns, copied numbers
        self.numbers: list[tuple[int, int]] = []  # [start, end) of the last RECENT_NUMBERS numbers counted
        self.number_start = -1  # where the number being counted began (-1: none)
        self.tokens: list[int] = []
        self.token_classes: list[int] = []  # each token's class (its own id where it has none)
        self.counted = 0
        self.exact: dict[int, dict[int, int]] = {}  # context key -> {next token: count}
        self.by_class: dict[int, dict[int, int]] = {}  # class context key -> {next token or class: count}
        self.members: dict[int, list[int]] = {}  # class -> its tokens seen in the stream
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        if self.max_class_n:
            self.token_classes.extend(self.classes.get(t, t) for t in tokens)

    def _cls(self, t: int) -> int:
        return self.classes.get(t, t)

    def _count(self) -> None:
        s, cs, exact, by_class = self.tokens, self.token_classes, self.exact, self.by_class
        for i in range(self.counted, len(s)):
            t = s[i]
            key = 0
            for n in range(1, min(self.max_n, i) + 1):
                key = (key << KEY_BITS) | (s[i - n] + 1)
                d = exact.get(key)
                if d is None:
                    d = exact[key] = {}
                d[t] = d.get(t, 0) + 1
            if self.max_class_n:
                c = cs[i]
                if c < 0 and t not in self.members.setdefault(c, []):
                    self.members[c].append(t)
                keys = self._class_keys(cs, i)
                guess = self._template(keys)
                if guess is not None:  # what the template level would have said here, against what came
                    kind = guess[1]
                    self.trust[kind] = TRUST_DECAY * self.trust[kind] + (1 - TRUST_DECAY) * (guess[0] == t)
                if self.number_start >= 0:
                    copied = self._copy(s[self.number_start : i])
                    if copied is not None:
                        self.trust[2] = TRUST_DECAY * self.trust[2] + (1 - TRUST_DECAY) * (copied == t)
                if c < 0 and self.number_start < 0:
                    self.number_start = i
                elif c >= 0 and self.number_start >= 0:
                    self.numbers = self.numbers[-RECENT_NUMBERS + 1 :] + [(self.number_start, i)]
                    self.number_start = -1
                for n, key in enumerate(keys):
                    if n >= 1:
                        d = by_class.get(key)
                        if d is None:
                            d = by_class[key] = {}
                        d[c] = d.get(c, 0) + 1
                    if n + 1 >= MIN_TEMPLATE:
                        last = self.last_two.get(key)
                        self.last_two[key] = (i, last[0] if last else -1)
        self.counted = len(s)

    def _class_keys(self, cs: list[int], end: int) -> list[int]:
        """Keys of the class contexts of 1 .. max_class_n tokens before position end of cs (a list of classes)."""
        keys, key = [], 0
        for n in range(1, min(self.max_class_n, end) + 1):
            key = (key << KEY_BITS) | _slot(cs[end - n])
            keys.append(key)
        return keys

    def _copy(self, partial: list[int]) -> int | None:
        """The token after `partial` (the number being written so far) in the most recent number that starts with it
        and runs on, or None."""
        n = len(partial)
        for start, end in reversed(self.numbers):
            if end - start > n and self.tokens[start : start + n] == partial:
                return self.tokens[start + n]
        return None

    def _template(self, keys: list[int]) -> tuple[int, int] | None:
        """(token, kind) the template level predicts after the class contexts `keys` (kind 0: a counting column, 1:
        a repeating one), or None: the longest context seen twice decides."""
        for n in range(len(keys), MIN_TEMPLATE - 1, -1):
            last = self.last_two.get(keys[n - 1])
            if last is None or last[1] < 0:
                continue
            a, b = self.tokens[last[0]], self.tokens[last[1]]
            if a in self.digits and b in self.digits:
                step = self.digit_token.get((self.classes.get(a, a), (2 * self.digits[a] - self.digits[b]) % 10))
                return (step, 0) if step is not None else None
            return (a, 1) if a == b else None
        return None

    def distribution(self, context: list[int]) -> dict[int, float]:
        """q over the tokens the stream holds, given context (the stream's end, plus any drafted tokens)."""
        if self.counted < len(self.tokens):
            self._count()
        levels = []  # (order, counts, by class): exact n sits below the class context of n + 1 tokens
        key = 0
        for n in range(1, min(self.max_n, len(context)) + 1):
            key = (key << KEY_BITS) | (context[-n] + 1)
            counts = self.exact.get(key)
            if counts:
                levels.append((n, counts, False))
        keys = self._class_keys([self._cls(t) for t in context[-self.max_class_n:]],
                                min(self.max_class_n, len(context))) if self.max_class_n else []
        for n, key in enumerate(keys, 1):
            counts = self.by_class.get(key) if n >= 2 else None
            if counts:
                levels.append((n + 0.5, counts, True))
        levels.sort(key=lambda x: x[0])
        q: dict[int, float] = {}
        for _, counts, by_class in levels:
            N, T = sum(counts.values()), len(counts)
            lam = N / (N + T) if q else 1.0
            below = q
            q = {t: (1 - lam) * p for t, p in below.items()}
            for t, c in counts.items():
                w = lam * c / N
                if t >= 0:
                    q[t] = q.get(t, 0.0) + w
                    continue
                members = [(u, below.get(u, 0.0)) for u in self.members.get(t, ())]
                z = sum(p for _, p in members)
                for u, p in members:  # the class's mass, as the estimate below spreads it (none: dropped)
                    if p > 0:
                        q[u] = q.get(u, 0.0) + w * p / z
        guesses = [self._template(keys)] if keys else []
        if keys and context[-1] in self.classes:  # inside a number: the copy level
            n = 1
            while n < len(context) and context[-n - 1] in self.classes:
                n += 1
            copied = self._copy(context[-n:])
            guesses.append((copied, 2) if copied is not None else None)
        guesses = [g for g in guesses if g is not None]
        if guesses:  # where both levels guess, the one whose guesses held more often
            token, kind = max(guesses, key=lambda g: self.trust[g[1]])
            lam = self.trust[kind]
            q = {t: (1 - lam) * p for t, p in q.items()}
            q[token] = q.get(token, 0.0) + lam
        return q


def _slot(t: int) -> int:
    """A token or class id as a non-zero KEY_BITS field (classes above every token id)."""
    return t + 1 if t >= 0 else (1 << KEY_BITS) + t


def coupled_chain(model: BackoffModel, depth: int, seed: int, position: int, drafter: str,
                  context_len: int = 16) -> DraftTree | None:
    """A chain of at most `depth` tokens after the model's stream: the token at output position position + k is
    argmax over q's support of log q(x) + G(seed, position + k, x)."""
    ctx = model.tokens[-context_len:]
    tokens: list[int] = []
    for k in range(depth):
        q = model.distribution(ctx)
        if not q:
            break
        key = hash3(seed, position + k, 0) & 0xFFFFFFFF
        tok = max(q, key=lambda t: math.log(q[t]) + gumbel_py(key, t))  # q holds no zeros
        tokens.append(tok)
        ctx.append(tok)
    return DraftTree(tokens, list(range(-1, len(tokens) - 1)), drafter=drafter) if tokens else None
