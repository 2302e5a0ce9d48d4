"""Helpers shared by the tests (plain functions and constants; fixtures live in conftest.py)."""

import itertools

import torch

from tailrl.drafter.buffer import DraftBuffer
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.engine.sampler import warp_tensors, warped_logprobs
from tailrl.speculative.noise import gumbel, row_keys

CHATS = [
    [{"role": "user", "content": "List the first ten prime numbers."}],
    [{"role": "user", "content": "Count from 1 to 20 separated by commas."}],
    [{"role": "user", "content": "What is the capital of Japan? Answer in one sentence."}],
    [{"role": "user", "content": "Spell the word 'banana' letter by letter."}],
]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_or_tie(model, ref, out, params: SamplingParams, tol: float) -> None:
    """out equals ref, or first differs where the two best (noise-perturbed, if sampling) scores tie within tol."""
    i = first_difference(ref.token_ids, out.token_ids)
    if i is None:
        return
    ids = torch.tensor(ref.prompt_token_ids + ref.token_ids[:i])
    with torch.no_grad():
        logits = model.forward_full(ids[None])[0][0, -1:]
    scores = logits[0].double()
    if not params.greedy:
        lp = warped_logprobs(logits, *warp_tensors([params], "cpu"))[0]
        scores = lp.double() + gumbel(row_keys([params.seed + ref.sample_index], [i]), lp.shape[-1])[0].double()
    top2 = torch.topk(scores, 2).values
    assert float(top2[0] - top2[1]) < tol, f"token {i} differs without a tie"


def exact_joint(model, prompt: list[int], params: SamplingParams, D: int, V: int = 4) -> dict:
    """The exact probability of every D-token continuation of prompt under the warped policy."""
    seqs = list(itertools.product(range(V), repeat=D))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        logits = model.forward_full(ids)[0][:, len(prompt) - 1 : -1]
    lp = warped_logprobs(logits.reshape(-1, V), *warp_tensors([params] * (len(seqs) * D), "cpu")).view(len(seqs), D, V)
    picked = lp.gather(-1, ids[:, len(prompt) :, None]).squeeze(-1).sum(-1)
    return {s: float(p) for s, p in zip(seqs, picked.exp())}


def tiny_draft_buffer(model, steps=(0, 1)) -> DraftBuffer:
    """A drafter buffer of 8 sampled answers of 12 tokens (2 prompts x 4) per RL step, with hidden states."""
    buffer = DraftBuffer(max_tokens=100_000, steps=2)
    for step in steps:
        eng = Engine(model, None, EngineConfig(kv_cache_gb=0.2, capture_hidden=True, seed=step))
        params = SamplingParams(n=4, max_tokens=12, seed=step, ignore_eos=True)
        buffer.add_completions(eng.generate([[1, 2, 3], [4, 5, 6, 7]], params), step)
    return buffer
