"""The policy update's throughput: the old path (one padded full-logits forward per micro-batch, [B, T, V] fp32
log-softmax), the path `separate` (one row per sequence in length-grouped micro-batches, chunked LM head over
response tokens only) and the path `new` (`separate`, but a prompt's samples share one copy of the prompt:
rl/actor/packing.py), and the path `tokens` (`new` with micro-batches by `--micro-tokens` packed tokens,
`algo.micro_batch_tokens`, instead of `--micro` sequences), on SmolLM2-135M with a GRPO-shaped batch, side by side in one run. Precisions: fp32; bf16 autocast over the
fp32 weights; a bf16 compute copy with fp32 master weights and fp32 Adam (rl/actor/precision.py; new path only).

The batch: `--prompts` prompts of `--prompt-len` tokens x `--n` samples, responses of `--resp` tokens (uniform, fixed
seed). The default run's batches: `--prompt-len 53-60 --resp 20-96` (a 53-token chat prompt, responses of 35-80
tokens on average, cut at 96).
Each variant runs the whole update (forward, backward, one AdamW step over the batch) from the same weights
and optimizer state; variants are interleaved per repeat so that load from other processes hits all alike.
Prints tokens/s (prompt + response tokens through forward and backward) and the ratio to the old fp32 path.

    .venv/bin/python benchmarks/update.py [--prompts 4 --n 8 --micro 8 --repeats 2] [--variants separate-autocast,new-autocast]
    .venv/bin/python benchmarks/update.py --variants new-bfloat16,tokens-bfloat16 --micro-tokens 4096
    .venv/bin/python benchmarks/update.py --device cuda --peak-tflops 989 --prompts 16 --n 16 --variants new-bfloat16,tokens-bfloat16
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from types import SimpleNamespace

import torch

from tailrl.config import AlgoCfg
from tailrl.model import load_model
from tailrl.rl.algos import policy_loss, token_logprobs
from tailrl.rl.actor.forward import autocast_ctx, make_batch, micro_batches
from tailrl.rl.actor.packing import packed_tokens
from tailrl.rl.actor.precision import Precision
from tailrl.rl.actor.update import policy_update


def fake_completions(vocab: int, prompts: int, n: int, seed: int = 0, plen=(50, 70), rlen=(30, 200)):
    rng = random.Random(seed)
    comps = []
    for _ in range(prompts):
        prompt = [rng.randrange(1000, vocab) for _ in range(rng.randint(*plen))]
        for _ in range(n):
            resp = [rng.randrange(1000, vocab) for _ in range(rng.randint(*rlen))]
            comps.append(SimpleNamespace(prompt_token_ids=prompt, token_ids=resp, logprobs=[-1.0] * len(resp),
                                         finish_reason="stop"))
    return comps


def old_update(policy, optimizer, batch, adv, algo, temperature: float, mode: str) -> None:
    """Today's path before issue 13: micro-batches in order, padded to the batch's longest sequence, the LM head
    over every position from the shortest prompt on, log-softmax over [b, T, V] in fp32."""
    L = max(len(s) for s in batch.seqs)
    tokens = torch.tensor([s + [batch.pad] * (L - len(s)) for s in batch.seqs], device=policy.device)
    targets = tokens[:, batch.start + 1 :]
    optimizer.zero_grad(set_to_none=True)
    B, mask, adv = len(batch), batch.mask.to(policy.device), adv.to(policy.device)
    for u0 in range(0, B, algo.micro_batch_size):
        idx = list(range(u0, min(u0 + algo.micro_batch_size, B)))
        with autocast_ctx(policy, mode == "autocast"):
            logits, _ = policy.forward_full(tokens[idx, :-1], logits_start=batch.start)
        logp, _ = token_logprobs(logits, targets[idx], temperature)
        loss, _ = policy_loss(logp, logp.detach(), adv[idx], mask[idx], algo.clip_low, algo.clip_high, algo.loss_agg)
        (loss * float(mask[idx].sum() / mask.sum())).backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), algo.grad_clip)
    optimizer.step()


def new_update(policy, optimizer, batch, adv, algo, temperature: float, mode: str) -> None:
    prec = Precision(policy, mode)  # bfloat16: builds the compute copy (a real run keeps it between steps)
    policy_update(prec, optimizer, None, batch, adv, algo, temperature, random.Random(0), {})


def separate_update(policy, optimizer, batch, adv, algo, temperature: float, mode: str) -> None:
    """The path before shared prompts: every sequence its own group, so its own row."""
    alone = copy.copy(batch)
    alone.groups = list(range(len(batch)))
    new_update(policy, optimizer, alone, adv, algo, temperature, mode)


def span(text: str) -> tuple[int, int]:
    lo, hi = text.split("-")
    return int(lo), int(hi)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--micro-tokens", type=int, default=4096, help="the `tokens` path's micro-batch budget")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="the device's bf16 peak (H100 SXM dense: 989): adds model FLOPs utilisation, 6 N tokens / s")
    ap.add_argument("--prompt-len", type=span, default=(50, 70))
    ap.add_argument("--resp", type=span, default=(30, 200))
    ap.add_argument("--variants", default="old-float32,old-autocast,new-float32,new-autocast,new-bfloat16")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, _ = load_model("smollm2-135m", device=args.device, dtype=torch.float32)
    model.requires_grad_(True)
    batch = make_batch(fake_completions(model.config.vocab_size, args.prompts, args.n, plen=args.prompt_len,
                                    rlen=args.resp), pad=0)
    B = len(batch)
    # algo: one optimizer step over the whole batch (mini_batch_size = B), micro-batches of --micro sequences
    adv = torch.randn(max(B, 4), generator=torch.Generator().manual_seed(1))  # the warm-up batch has 4
    resp = int(batch.mask.sum())
    shared = packed_tokens(batch.seqs, batch.prompt_lens, batch.groups, list(range(B)))
    print(f"batch: {B} sequences, {batch.tokens} tokens ({resp} response; {shared} with shared prompts), longest "
          f"{max(map(len, batch.seqs))}, "
          f"micro-batch {args.micro} sequences (path tokens: {args.micro_tokens} tokens); "
          f"threads {torch.get_num_threads()}")
    every = list(range(B))
    print(f"micro-batches: {len(micro_batches(batch, every, args.micro))} of up to {args.micro} sequences, or "
          f"{len(micro_batches(batch, every, args.micro, args.micro_tokens))} of up to {args.micro_tokens} tokens")
    fns = {"old": old_update, "separate": separate_update, "new": new_update, "tokens": new_update}
    print("variants are interleaved; each starts from the same weights and a fresh AdamW")
    variants = args.variants.split(",")
    times = {v: [] for v in variants}
    state = copy.deepcopy(model.state_dict())
    warm = make_batch(fake_completions(model.config.vocab_size, 1, 4, seed=1), pad=0)
    for rep in range(args.repeats + 1):  # repeat 0 warms up (allocator, oneDNN kernels) on 4 sequences, not counted
        for v in variants:
            path, dt = v.split("-")
            model.load_state_dict(state)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99))
            b = batch if rep else warm
            t = time.perf_counter()
            algo = AlgoCfg(mini_batch_size=len(b), micro_batch_size=args.micro,
                           micro_batch_tokens=args.micro_tokens if path == "tokens" else 0)
            fns[path](model, opt, b, adv[: len(b)], algo, 1.0, dt)
            if rep:
                times[v].append(time.perf_counter() - t)
            print(f"  repeat {rep} {v}: {time.perf_counter() - t:.1f}s", flush=True)
    base = min(times[variants[0]])
    params = sum(p.numel() for p in model.parameters())
    mfu = args.peak_tflops > 0
    print(f"\n| path | dtype | update s (best of {args.repeats}) | batch tokens/s | vs {variants[0]} |"
          + (" MFU (6 N x computed tokens) |" if mfu else ""))
    print("|---|---|---|---|---|" + ("---|" if mfu else ""))
    for v in variants:
        best = min(times[v])
        path, dt = v.split("-")
        name = {"float32": "fp32", "autocast": "bf16 autocast", "bfloat16": "bf16 copy, fp32 master"}[dt]
        computed = batch.tokens if path == "old" else shared
        print(f"| {path} | {name} | {best:.2f} | {batch.tokens / best:.0f} | {base / best:.2f}x |"
              + (f" {6 * params * computed / best / (args.peak_tflops * 1e12):.1%} |" if mfu else ""))


if __name__ == "__main__":
    main()
