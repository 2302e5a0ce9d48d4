"""Helpers shared by the tests (plain functions and constants; fixtures live in conftest.py)."""

import itertools
import logging
import re

import pytest
import torch

from tailrl.drafter.buffer import DraftBuffer
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.engine.blocks import BLOCK
from tailrl.engine.sampler import warp_tensors, warped_logprobs
from tailrl.model.tiny import load_tiny
from tailrl.speculative.audit import AuditConfig, audit
from tailrl.speculative.noise import gumbel, row_keys


def tiny_model(tmp_path_factory, kind: str = "llama", seed: int = 0, dtype=None):
    """The tiny model family every engine, speculation and update test runs: a random tiny HF checkpoint
    (tailrl/model/tiny.py's `make_tiny_checkpoint`: 3 layers, 64 wide, 96 words) of `kind`, loaded by tailrl on the
    CPU."""
    return load_tiny(tmp_path_factory.mktemp(f"tiny_{kind}_{seed}"), kind, seed=seed, dtype=dtype)


def peaked_tiny_model(folder, vocab: int, scale: float, dtype=None):
    """A tiny random Qwen2 (token ids, no tokenizer) whose LM head is scaled by `scale`: peaked,
    context-dependent next-token distributions, so a chi-square sees a wrong one with few draws."""
    return load_tiny(folder, "qwen2", seed=4, dtype=dtype, vocab=vocab, head_scale=scale)


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


def assert_falls_back(model, tok, verdict) -> None:
    """Where the start-up probe found the invariant passes broken on this machine's kernels (engine/probe.py):
    `batch_invariant=true` refuses to start with an error naming the property, and `auto` warns once, naming it,
    and runs the plain passes (the trainer then logs rollout/batch_invariant = 0)."""
    name = verdict.failed[0]
    with pytest.raises(RuntimeError, match=re.escape(name)):
        Engine(model, tok, EngineConfig(kv_cache_gb=0.2, batch_invariant=True))
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    log = logging.getLogger("tailrl.engine.probe")
    log.addHandler(handler)
    try:
        eng = Engine(model, tok, EngineConfig(kv_cache_gb=0.2))
    finally:
        log.removeHandler(handler)
    assert [r.levelno for r in records if name in r.getMessage()] == [logging.WARNING]
    assert not eng.runner.invariant and eng.invariance is verdict


class StubSpot:
    """A spot trainer as its lender sees it: it runs once resumed and stops when paused (or by itself)."""

    running = False

    def begin_step(self, rl_step: int, last_step_s: float) -> None:
        pass

    def resume(self) -> bool:
        self.running = True
        return True

    def pause(self, wait: bool = True, timeout: float | None = None) -> bool:
        self.running = False
        return True


def cache_gb(blocks: int, model) -> float:
    """kv_cache_gb for a cache of `blocks` blocks of the model's fp32 K/V (and half a block to spare)."""
    c = model.config
    return (blocks + 1.5) * BLOCK * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4 / 2**30


def lossy_decide(real):
    """An SD bug: where the target's draw rejects the draft, the first draft token is emitted anyway."""
    from tailrl.speculative.verify import Verdict

    def decide(logits, seqs, trees, q_lens, depths):
        out = real(logits, seqs, trees, q_lens, depths)
        return [Verdict([], [trees[b].tokens[0]], v.logprobs[:1]) if trees and trees[b] is not None
                and not v.accepted_nodes else v for b, v in enumerate(out)]
    return decide


AUDIT_PROMPTS = [[1, 3, 3 + i, 0, 3] for i in range(4)]  # tests/speculative/test_audit.py's (and the vLLM gate's) audit
AUDIT_CFG = AuditConfig(temperatures=(1.0,), max_tokens=16)


def engine_audit(model):
    """Our engine without and with prompt-lookup drafts (uncoupled: drafts are the prompt's continuations, not
    the target's draws, so a lossy acceptance shows), 4 prompts x 64 responses per arm at T = 1, every token of
    the SD arm scored by the model."""
    from tailrl.cli_audit import tailrl_arms
    from tailrl.engine.score import model_scorer

    off, on, _ = tailrl_arms(model, None, "ngram", seed=0, coupled=False)
    return audit(off, on, AUDIT_PROMPTS, AUDIT_CFG, label="tailrl ngram", scorer=model_scorer(model))
