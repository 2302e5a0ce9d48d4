"""Appending emitted tokens to a sequence and deciding when it is finished (stop token, stop string, length)."""

from __future__ import annotations

import logging
import time

from .sequence import Sequence

log = logging.getLogger(__name__)


def append_tokens(s: Sequence, tokens: list[int], lps: list[float], tokenizer) -> int:
    """Appends emitted tokens up to the first that finishes the sequence; returns how many were appended."""
    n = 0
    for tok, lp in zip(tokens, lps):
        if not s.output_ids:
            s.stats.t_first = time.perf_counter()
        s.output_ids.append(tok)
        s.logprobs.append(lp)
        n += 1
        try:
            check_finish(s, tok, tokenizer)
        except Exception as e:  # one request's failure (say, detokenizing) must not stop the batch
            log.warning("request %d sample %d failed: %s", s.prompt_index, s.sample_index, e)
            s.finish("error", f"{type(e).__name__}: {e}")
        if s.finished:
            break
    return n


def check_finish(s: Sequence, tok: int, tokenizer) -> None:
    if tok in s.stop_ids:
        s.finish("stop")
    elif s.params.stop and _hit_stop_string(s, tokenizer):
        s.finish("stop")
    elif len(s.output_ids) >= s.max_tokens:
        s.finish("length")
    if s.finished and tokenizer is not None and not s.text:
        s.text = tokenizer.decode(s.output_ids, skip_special_tokens=True)
        for stop in s.params.stop:
            cut = s.text.find(stop)
            if cut >= 0:
                s.text = s.text[:cut]


def _hit_stop_string(s: Sequence, tokenizer) -> bool:
    window = max(len(x) for x in s.params.stop) + 4  # a stop string spans at most this many tokens
    tail = tokenizer.decode(s.output_ids[-window:], skip_special_tokens=True)
    return any(x in tail for x in s.params.stop)
