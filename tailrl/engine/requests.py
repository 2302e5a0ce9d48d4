"""Prompts into seeded sample groups, and running sequences into portable states and back.

A request is one prompt with n samples; sample j draws from seed + j (or from the engine's generator when the
request gives no seed). The noise of every token is keyed by (seed, position), so a `SeqState` carries all a
sequence needs to continue elsewhere with exactly the tokens it would have produced where it was."""

from __future__ import annotations

import dataclasses

import time
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams
from .sequence import Sequence
from .stats import SeqStats


def encode(tokenizer, prompt) -> list[int]:
    """str -> tokens as is; list of chat messages -> the tokenizer's chat template; list[int] -> as given."""
    if isinstance(prompt, str):
        _need_tokenizer(tokenizer, "a text prompt")
        return tokenizer.encode(prompt, add_special_tokens=False)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        _need_tokenizer(tokenizer, "a chat prompt")
        if all(not m.get("content") for m in prompt):
            return []
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise ValueError(f"a prompt must be text, chat messages or token ids, got {type(prompt).__name__}")


def _need_tokenizer(tokenizer, what: str) -> None:
    if tokenizer is None:
        raise ValueError(f"{what} needs a tokenizer and this model has none; pass token ids")


def check_prompt(ids: list[int], vocab_size: int, max_model_len: int) -> None:
    if not ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"the prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(ids)} tokens, longer than the context: max_model_len is "
                         f"{max_model_len}, which leaves no room to generate")


def make_group(first_id: int, index: int, ids: list[int], params: SamplingParams, max_model_len: int,
               stop_ids: frozenset[int], rng: torch.Generator) -> list[Sequence]:
    max_tokens = min(params.max_tokens, max_model_len - len(ids))
    t = time.perf_counter()
    group = []
    for j in range(params.n):
        seed = params.seed + j if params.seed is not None else int(torch.randint(2**62, (1,), generator=rng))
        group.append(Sequence(first_id + j, index, j, ids, params, seed, max_tokens, stop_ids, SeqStats(t)))
    return group


def failed_group(first_id: int, index: int, params: SamplingParams, error: str) -> list[Sequence]:
    """A rejected request's samples, finished with the error that names the problem."""
    group = [Sequence(first_id + j, index, j, [], params, 0, 0, frozenset(), SeqStats(time.perf_counter()))
             for j in range(params.n)]
    for s in group:
        s.finish("error", error)
    return group


@dataclass
class SeqState:
    """A running or waiting sequence, portable between engines (picklable: lists, ints, floats, params)."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    params: SamplingParams
    seed: int
    max_tokens: int
    stop_ids: list[int]
    spec_depth: int = 0  # the speculator's adaptive draft depth for it (0: none yet)
    stats: dict = field(default_factory=dict)  # SeqStats.portable(): decode_steps, decode_tokens, drafted, ...


def export_state(s: Sequence, spec_depth: int) -> SeqState:
    return SeqState(s.prompt_index, s.sample_index, list(s.prompt_ids), list(s.output_ids), list(s.logprobs),
                    s.params, s.seed, s.max_tokens, sorted(s.stop_ids), spec_depth, s.stats.portable())


def import_state(seq_id: int, st: SeqState) -> Sequence:
    """The sequence, counting on from the exported counts; the caller hands st.spec_depth to its speculator. Its
    `resume` (a sequence id of the engine it came from, whose kept K/V stays there) is cleared: ids here are others."""
    params = dataclasses.replace(st.params, resume=None) if st.params.resume is not None else st.params
    return Sequence(seq_id, st.prompt_index, st.sample_index, list(st.prompt_ids), params, st.seed, st.max_tokens,
                    frozenset(st.stop_ids), SeqStats(time.perf_counter(), **st.stats), output_ids=list(st.output_ids),
                    logprobs=list(st.logprobs))
