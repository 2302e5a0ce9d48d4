"""Calibration for benchmarks/cluster_sim.py: measures the step-cost model on SmolLM2-135M (forward time against
batch size and context, from timed `generate` calls at two lengths). `cluster_sim.py --measure` calls it and then
checks the simulator against one measured single-worker rollout; this module does not import the simulator.

    .venv/bin/python benchmarks/cluster_calib.py [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tailrl.cluster.cost import StepCost  # noqa: E402
from tailrl.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from tailrl.model import load_model  # noqa: E402

CHATS = ["List the first ten prime numbers.", "Count from 1 to 30 separated by commas.",
         "What is the capital of Japan? Answer in one sentence.", "Spell the word 'banana' letter by letter.",
         "Write a short poem about the sea.", "Explain what a prime number is.", "What is 17 times 23? Show your steps.",
         "Name three colours."]


def timed(engine: Engine, prompt_ids: list[int], n: int, max_tokens: int, repeats: int = 2) -> float:
    """Best of `repeats` (the machine is shared: the minimum is the least disturbed run)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        engine.generate([prompt_ids], SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, seed=0))
        best = min(best, time.perf_counter() - t)
    return best


def measure_cost(engine: Engine, tok, short: int = 8, long: int = 40) -> tuple[StepCost, list]:
    """Decode steps from the difference of two generate calls (same prefill, long - short more steps);
    prefill from 1-token calls."""
    decode, prefill, rows = [], [], []
    for plen in (40, 400):
        ids = tok.encode(" ".join(["word"] * plen), add_special_tokens=False)[:plen]
        for B in (1, 2, 4, 8, 16, 32) if plen == 40 else (1, 8, 32):
            a, b = timed(engine, ids, B, short), timed(engine, ids, B, long)
            step = (b - a) / (long - short)
            decode.append((B, B * (plen + (short + long) / 2), step))
            rows.append(("decode", B, plen, step))
    for plen in (40, 200, 400):
        ids = tok.encode(" ".join(["word"] * plen), add_special_tokens=False)[:plen]
        pre = timed(engine, ids, 1, 1)
        prefill.append((plen, pre))
        rows.append(("prefill", 1, plen, pre))
    return StepCost.fit(decode, prefill), rows


def calibrate(threads: int = 1) -> tuple[StepCost, Engine, object]:
    """The fitted cost model, and the engine and tokenizer it was measured on."""
    torch.set_num_threads(threads)
    model, tok = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    engine = Engine(model, tok, EngineConfig(kv_cache_gb=1.0))
    timed(engine, tok.encode("warm up", add_special_tokens=False), 2, 4)
    cost, rows = measure_cost(engine, tok)
    print(f"SmolLM2-135M fp32, {threads} thread(s); measured forwards (the cost model's inputs):\n")
    print("| kind | batch | prompt tokens | seconds per step | model |\n|---|---|---|---|---|")
    for kind, B, plen, s in rows:
        model_s = cost.decode(B, B * (plen + 24)) if kind == "decode" else cost.prefill(plen)
        print(f"| {kind} | {B} | {plen} | {s * 1000:.1f} ms | {model_s * 1000:.1f} ms |")
    print(f"\nfitted decode: {cost.base_s * 1000:.2f} ms + {cost.per_token_s * 1000:.3f} ms per token "
          f"+ {cost.per_attn_s * 1e6:.4f} us per attended (query, key) pair; prefill: {cost.prefill_base_s * 1000:.1f} ms "
          f"+ {cost.prefill_token_s * 1000:.3f} ms per token\n")
    return cost, engine, tok


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    calibrate(ap.parse_args().threads)
