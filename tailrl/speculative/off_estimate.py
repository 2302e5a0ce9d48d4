"""What plain decoding would have taken for a rollout's responses: the SD-off estimate behind spec/speedup_est."""

from __future__ import annotations


def off_seconds(plain_step_s, prompt_lens: list[int], lengths: list[int], tail: int) -> tuple[float, float] | None:
    """(body, tail) decode seconds plain decoding would have taken for sequences of these prompt and response
    lengths, from the step-time model (plain_step_s: Selector.plain_step_s, contexts -> seconds): with SD off every sequence emits a token a step, so step t runs the
    sequences longer than t, at their contexts then, and is in the tail where at most `tail` run (engine/tail.py).
    The same tokens (lossless, batch-invariant) make this the SD-off run's own schedule; pricing each
    speculative step as emitted / B plain steps of its own batch instead counted the tail speculation makes
    (sequences whose drafts fail fall behind and finish alone) as if plain decoding had it too
    (benchmarks/RESULTS.md section 25). None before a plain step was priced."""
    alive = list(range(len(lengths)))
    body = tail_s = 0.0
    for t in range(1, max(lengths, default=0)):
        alive = [i for i in alive if lengths[i] > t]
        if not alive:
            break
        step = plain_step_s([prompt_lens[i] + t - 1 for i in alive])
        if step is None:
            return None
        if len(alive) <= tail:
            tail_s += step
        else:
            body += step
    return body, tail_s
