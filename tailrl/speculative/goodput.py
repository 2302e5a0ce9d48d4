"""Which draft tokens a step verifies, chosen for the step's goodput (expected tokens emitted per second), for an
engine whose steps we can only time from outside (vLLM: our proposer sees one call per step).

A verify step's seconds are modelled as a line in what it carries,

    step_s = a + b * sequences + r * draft tokens + c * [any draft],

fitted by least squares over recent steps (`StepLine`, forgetting old ones): a is the step's fixed cost (scheduling,
the forward's weight reads on a CPU), b a sequence's, r a draft token's (a row of the verify forward plus the
rejection sampler's share), c what a step pays for taking the speculative path at all. A draft token's chance to be
accepted is its drafter's estimate (the share of history continuations that agree, cumulative along the chain),
calibrated online per bin of that estimate (`Calibration`): drafts are judged by what they did.

Given the candidates (each row's chain, acceptance non-increasing along it), the tokens worth verifying are the
best m by acceptance, where m maximises (B + sum of their acceptance) / step_s(B, m) (`choose`): a token is verified
only where its expected gain beats the time its row costs at the step's current goodput, so large batches draft
little or nothing (a row costs about as much as an emitted token) and the tail drafts deep. Before the line is
known (`ready`), a step verifies a few of its likeliest tokens: drafted steps of every size get timed."""

from __future__ import annotations

import numpy as np


class StepLine:
    """step_s = w . (1, sequences, draft tokens, [drafts > 0]) by recursive least squares with forgetting."""

    def __init__(self, decay: float = 0.995, prior: float = 1e-3):
        self.decay = decay
        self.xx = np.eye(4) * prior  # a weak ridge keeps the solve defined before the features vary
        self.xy = np.zeros(4)
        self.n = 0
        self.seen_rows: set[int] = set()
        self.seen_drafts: set[int] = set()  # log2 buckets of draft tokens a timed step carried
        self._w: np.ndarray | None = None
        # per bucket of 16 sequences, measured over predicted seconds of the drafts' share of a step (EMA): one
        # line through the tail's small steps under-prices the many draft rows of a large batch
        self.correction: dict[int, float] = {}

    @staticmethod
    def features(seqs: int, drafts: int) -> np.ndarray:
        return np.array([1.0, seqs, drafts, 1.0 if drafts else 0.0])

    def record(self, seqs: int, drafts: int, seconds: float) -> None:
        if drafts and self.ready:
            base = float(self.seconds(seqs, 0))
            extra = float(self.seconds(seqs, drafts, corrected=False)) - base
            if extra > 0:
                ratio = min(max((seconds - base) / extra, 0.5), 4.0)
                c = self.correction.get(seqs // 16, 1.0)
                self.correction[seqs // 16] = c + 0.2 * (ratio - c)
        x = self.features(seqs, drafts)
        self.xx = self.decay * self.xx + np.outer(x, x)
        self.xy = self.decay * self.xy + seconds * x
        self.n += 1
        self.seen_rows.add(seqs // 8)
        if drafts:
            self.seen_drafts.add(int(drafts).bit_length())
        self._w = None

    @property
    def ready(self) -> bool:
        """Enough steps of different sizes, with draft counts of different magnitudes, to tell the four terms apart
        (steps of ~128 sequences with 16 drafts each cannot say what a draft token costs)."""
        return self.n >= 24 and len(self.seen_rows) >= 3 and len(self.seen_drafts) >= 3

    def weights(self) -> np.ndarray:
        if self._w is None:
            w = np.linalg.solve(self.xx, self.xy)
            w[1] = max(w[1], 1e-6)  # a sequence never costs nothing (noise can fit it negative)
            # a draft token is a row of the verify forward: priced at no less than half a sequence, whatever a
            # noisy fit says (a fit that priced it at nothing drafted every candidate at 128 sequences)
            w[2] = max(w[2], 0.5 * w[1])
            w[3] = max(w[3], 0.0)
            self._w = w
        return self._w

    def seconds(self, seqs: int, drafts, corrected: bool = True) -> np.ndarray:
        a, b, r, c = self.weights()
        drafts = np.asarray(drafts, dtype=float)
        k = self.correction.get(seqs // 16, 1.0) if corrected else 1.0
        return max(a, 1e-4) + b * seqs + k * (r * drafts + c * (drafts > 0))


class Calibration:
    """Measured acceptance per (chain depth, bin of estimated cumulative acceptance): a drafter's estimate from a few
    history continuations says 1.0 at every depth of a chain seen once, and a depth-8 token of such a chain is
    accepted far less often than a depth-0 one. A Beta prior at the estimate, `prior` draws strong."""

    def __init__(self, depth: int = 16, bins: int = 5, prior: float = 4.0):
        self.depth, self.bins, self.prior = depth, bins, prior
        self.tried = np.zeros((depth, bins))
        self.accepted = np.zeros((depth, bins))

    def _cells(self, p) -> tuple[np.ndarray, np.ndarray]:
        p = np.asarray(p, dtype=float)
        return (np.minimum(np.arange(len(p)), self.depth - 1),
                np.minimum((p * self.bins).astype(int), self.bins - 1))

    def __call__(self, p) -> np.ndarray:
        """A chain's calibrated cumulative acceptance (kept non-increasing along it)."""
        p = np.asarray(p, dtype=float)
        if not len(p):
            return p
        d, b = self._cells(p)
        q = (self.accepted[d, b] + self.prior * p) / (self.tried[d, b] + self.prior)
        return np.minimum.accumulate(q)

    def record(self, p: list[float], accepted: int) -> None:
        """A verified chain: its tokens' estimates, and how many of them were accepted (a prefix)."""
        if not len(p):
            return
        d, b = self._cells(p)
        np.add.at(self.tried, (d, b), 1.0)
        np.add.at(self.accepted, (d[:accepted], b[:accepted]), 1.0)


def choose(line: StepLine, seqs: int, cands: list[list[float]], explore: bool = False, explore_p: float = 0.5,
           explore_tokens: int = 16) -> list[int]:
    """Per row, how many of its chain's tokens to verify. cands[i]: row i's calibrated acceptance per chain token
    (non-increasing). Before the line is known, a step verifies at most `explore_tokens` of its likeliest tokens
    (those estimated at least `explore_p`): enough to time drafted steps at every batch size, little to lose; so
    does a step asked to `explore` (the caller's every Nth: the line keeps seeing drafted steps where it stopped
    drafting, and can change its mind)."""
    flat = [(p, i) for i, c in enumerate(cands) for p in c]
    flat.sort(key=lambda x: -x[0])
    out = [0] * len(cands)
    if explore or not line.ready:
        for p, i in flat[:explore_tokens]:
            if p >= explore_p:
                out[i] += 1
        return out
    if not flat:
        return out
    gain = np.cumsum([0.0] + [p for p, _ in flat])
    m = np.arange(len(flat) + 1)
    rate = (seqs + gain) / line.seconds(seqs, m)
    best = int(np.argmax(rate))
    for _, i in flat[:best]:
        out[i] += 1
    return out


def worth_drafting(line: StepLine, seqs: int, k: int) -> bool:
    """Could drafting pay at this batch size at best (every row a chain of k tokens, each certain)? False where the
    line is known and says not: then no chain is computed (drafting costs host time on every step)."""
    if not line.ready:
        return True
    m = seqs * k
    return (seqs + m) / float(line.seconds(seqs, m)) > seqs / float(line.seconds(seqs, 0))
