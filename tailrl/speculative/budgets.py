"""Per-request draft budgets from predicted remaining length (DAS: speculate where the remaining work is).

The selector picks one arm (drafter, budget b) for the batch from measured cost and acceptance. Requests
differ in how much they have left: a request predicted to end within b tokens gains nothing from drafting past
its end, and a request predicted to run far longer than the others is the one that decides when the rollout
ends (the long tail), so it gets a deeper tree. Predictions come from the lengths of earlier responses to the
same prompt (earlier epochs, and siblings that already finished in this one)."""

from __future__ import annotations

from collections import OrderedDict


class LengthTracker:
    """Response lengths per prompt, the last `keep` of them (bounded number of prompts)."""

    def __init__(self, keep: int = 32, max_prompts: int = 100_000):
        self.keep, self.max_prompts = keep, max_prompts
        self.lengths: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()

    def add(self, prompt_ids: list[int], length: int) -> None:
        key = tuple(prompt_ids)
        seen = self.lengths.setdefault(key, [])
        seen.append(length)
        del seen[: -self.keep]
        self.lengths.move_to_end(key)
        while len(self.lengths) > self.max_prompts:
            self.lengths.popitem(last=False)

    def remaining(self, prompt_ids: list[int], generated: int) -> int | None:
        seen = self.lengths.get(tuple(prompt_ids))
        return None if not seen else round(expected_remaining(seen, generated))


def expected_remaining(lengths: list[int], done: int) -> float:
    """E[L - done | L > done] over a prompt's past response lengths. A sample past all of them is in the long tail,
    not about to end: half of what it has done (response lengths are heavy-tailed, and one that ran long tends to
    run on). The unconditional mean minus done would call exactly the samples that decide when a rollout ends
    finished, and stop drafting for them."""
    longer = [n - done for n in lengths if n > done]
    return sum(longer) / len(longer) if longer else max(0.5 * done, 1.0)


def das_budgets(base: int, remaining: list[int | None], cap: int, share: bool = True) -> list[int]:
    """base: the arm's budget; remaining: predicted tokens left per request (None: no prediction).

    share: the long requests' deeper trees come out of the rows the batch was going to verify anyway (the rows
    saved on requests about to end), unless they are a quarter of the batch or fewer (or one request). Where every
    request is long (a full batch at the start of a rollout), doubling them all is a bigger budget the selector did
    not choose, paid at the batch sizes where a verify row costs most (a step of 64 sequences with 8 draft rows each
    costs 3.2 plain steps on a CPU). share=False: every long request gets 2 * base (the first version)."""
    out, long = [], []
    for i, r in enumerate(remaining):
        if r is None:
            out.append(base)
        elif r < base:
            out.append(max(r, 1))  # drafting past the predicted end is mostly wasted verification
        elif r > 4 * base:
            out.append(base)
            long.append(i)  # the long tail: a deeper tree
        else:
            out.append(base)
    deep = min(2 * base, max(cap, base))
    if not share or len(long) <= max(len(remaining) // 4, 1):
        for i in long:
            out[i] = deep
        return out
    pool = base * len(out) - sum(out)  # rows the short requests leave unused
    for i in sorted(long, key=lambda i: -remaining[i]):  # the longest first
        extra = min(deep - base, pool)
        out[i] += extra
        pool -= extra
    return out


def block_budget(n: int, block: int) -> int:
    """The most draft nodes of a chain, at most n, that leave no query block part-empty: a sequence's 1 + n rows fill
    whole blocks of `block` rows (n = block * j - 1), or n itself below one block. A batch-invariant verifier
    (model/chunked.py) attends over a sequence's keys once per block of QUERY_BLOCK rows, whether the block holds 1
    row or all of them, and at long contexts that is most of a pass: a chain of 4 (5 rows, 2 blocks) cost 1.7-2.2x a
    plain step and a chain of 3 (1 block) 1.05-1.25x, at 4-32 sequences over 900 tokens (benchmarks/verify_cost.py,
    in git at 103a651)."""
    if block <= 1 or n < block:
        return n
    return (n + 1) // block * block - 1



def block_end(n: int, block: int) -> int:
    """The most draft nodes a chain of n can grow to without a new query block: its 1 + n rows, rounded up to whole
    blocks of `block` rows, less the root's row (n = 1 -> 3 at blocks of 4; n = 3 -> 3; n = 4 -> 7)."""
    return -(-(1 + n) // block) * block - 1
