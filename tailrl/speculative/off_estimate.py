"""What plain decoding would have taken for a rollout's responses: the SD-off estimate behind spec/speedup_est."""

from __future__ import annotations


def off_seconds(plain_step_s, prompt_lens: list[int], lengths: list[int], tail: int,
                starts: list[int] | None = None) -> tuple[float, float] | None:
    """(body, tail) decode seconds plain decoding would have taken for sequences of these prompt and response
    lengths, from the step-time model (plain_step_s: Selector.plain_step_s, contexts -> seconds): with SD off every sequence emits a token a step, so step t runs the
    sequences longer than t, at their contexts then, and is in the tail where at most `tail` run (engine/tail.py).
    The same tokens (lossless, batch-invariant) make this the SD-off run's own schedule; pricing each
    speculative step as emitted / B plain steps of its own batch instead counted the tail speculation makes
    (sequences whose drafts fail fall behind and finish alone) as if plain decoding had it too
    (benchmarks/RESULTS.md section 25). None before a plain step was priced.

    starts: per sequence, the plain step after which it begins (0: with the rollout). A multi-turn trajectory's
    turns are sequences one after another: a turn's first token comes from its prefill, so the next begins
    `length - 1` steps after it (`turn_starts`). (The estimate once counted a tool rollout's first turns only: on
    `--preset tools` it read 0.94x where SD auto measured 1.21x of SD off, benchmarks/RESULTS.md section 25.)"""
    starts = starts or [0] * len(lengths)
    order = sorted(range(len(lengths)), key=starts.__getitem__)  # sequences join the schedule as they begin
    alive: list[int] = []
    body = tail_s = 0.0
    nxt = 0
    for t in range(1, max((s + n for s, n in zip(starts, lengths)), default=0)):
        while nxt < len(order) and starts[order[nxt]] < t:
            alive.append(order[nxt])
            nxt += 1
        alive = [i for i in alive if t < starts[i] + lengths[i]]
        if not alive:
            continue
        step = plain_step_s([prompt_lens[i] + t - starts[i] - 1 for i in alive])
        if step is None:
            return None
        if len(alive) <= tail:
            tail_s += step
        else:
            body += step
    return body, tail_s


def turn_starts(seq_ids: list[int], lengths: list[int], continues: list[int | None]) -> list[int]:
    """Per sequence, the plain step after which it begins: where the turn it continues (`continues`: that turn's
    seq_id, Completion.continues) ends in the plain schedule, or 0 where that turn is not among these sequences."""
    at = {i: k for k, i in enumerate(seq_ids)}
    starts: dict[int, int] = {}

    def start(k: int, seen: tuple = ()) -> int:
        if k not in starts:
            prev = at.get(continues[k])
            starts[k] = 0 if prev is None or prev in seen or prev == k else \
                start(prev, seen + (k,)) + max(lengths[prev] - 1, 0)
        return starts[k]

    return [start(k) for k in range(len(seq_ids))]
