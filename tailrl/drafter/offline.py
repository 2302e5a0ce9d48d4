"""Offline warm start: the target generates answers to a prompt set (capturing its hidden states on the way,
at no extra forward), and the head is trained on them for a few epochs, with a held-out split by prompt."""

from __future__ import annotations

import logging
import random
import time

from ..engine import Engine, EngineConfig, SamplingParams
from .buffer import DraftBuffer, DraftSample
from .config import DrafterConfig
from .eagle import EagleDrafter, choose_vocab
from .train import DrafterTrainer

log = logging.getLogger(__name__)


def collect(model, tokenizer, prompts: list, n: int, max_tokens: int, temperature: float, seed: int,
            progress: bool = False, max_num_seqs: int = 64) -> DraftBuffer:
    """Generates n samples per prompt with hidden-state capture; returns them as a buffer (step 0)."""
    engine = Engine(model, tokenizer, EngineConfig(capture_hidden=True, seed=seed, max_num_seqs=max_num_seqs))
    comps = engine.generate(prompts, SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=seed),
                            progress=progress)
    buffer = DraftBuffer(max_tokens=10**9, steps=1)
    buffer.add_completions(comps, 0)
    return buffer


def split(samples: list[DraftSample], eval_frac: float, seed: int) -> tuple[list[DraftSample], list[DraftSample]]:
    """Held-out by prompt, so evaluation sees prompts the head never trained on."""
    prompts = sorted({tuple(s.tokens[: s.prompt_len]) for s in samples})
    random.Random(seed).shuffle(prompts)
    held = set(prompts[: max(1, int(len(prompts) * eval_frac))]) if eval_frac > 0 and len(prompts) > 1 else set()
    train = [s for s in samples if tuple(s.tokens[: s.prompt_len]) not in held]
    return train, [s for s in samples if tuple(s.tokens[: s.prompt_len]) in held]


def train_epochs(trainer: DrafterTrainer, samples: list[DraftSample], epochs: int, seed: int,
                 log_every: int = 0) -> list[dict]:
    rng = random.Random(seed)
    history = []
    for epoch in range(epochs):
        order = samples[:]
        rng.shuffle(order)
        batch, tokens = [], 0
        for s in order:
            batch.append(s)
            tokens += s.train_positions
            if tokens >= trainer.cfg.batch_tokens:
                history.append(trainer.train_step(batch))
                batch, tokens = [], 0
                if log_every and trainer.steps % log_every == 0:
                    log.info("drafter step %d: %s", trainer.steps, history[-1])
        if batch:
            history.append(trainer.train_step(batch))
    return history


def train_offline(model, tokenizer, prompts: list, cfg: DrafterConfig, n: int = 4, max_tokens: int = 96,
                  temperature: float = 1.0, epochs: int = 4, eval_frac: float = 0.1, seed: int = 0,
                  progress: bool = False, head: EagleDrafter | None = None) -> tuple[EagleDrafter, dict]:
    """Returns the trained head (bound to model) and metrics before and after on the held-out prompts."""
    t0 = time.perf_counter()
    buffer = collect(model, tokenizer, prompts, n, max_tokens, temperature, seed, progress)
    t_gen = time.perf_counter() - t0
    if not buffer.items:
        raise ValueError("no usable generations to train the drafter on (every sample was shorter than 2 tokens)")
    if head is None:
        vocab = choose_vocab(buffer.token_counts(model.config.vocab_size), cfg.draft_vocab, model.config.eos_token_id)
        head = EagleDrafter(model.config, vocab).to(device=model.device, dtype=model.dtype).bind(model)
    train, held = split(list(buffer.items), eval_frac, seed)
    trainer = DrafterTrainer(head, cfg, seed=seed)
    before = trainer.evaluate(held) if held else {}
    history = train_epochs(trainer, train, epochs, seed)
    after = trainer.evaluate(held) if held else {}
    trainer.publish(head)
    metrics = {"samples": len(buffer.items), "train_samples": len(train), "eval_samples": len(held),
               "tokens": buffer.tokens, "steps": trainer.steps, "generate_s": round(t_gen, 1),
               "train_s": round(time.perf_counter() - t0 - t_gen, 1),
               "final_train": history[-1] if history else {},
               "eval_before": before, "eval_after": after}
    return head, metrics
