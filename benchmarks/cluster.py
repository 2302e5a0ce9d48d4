"""Rollout on 2 Ray workers x 1 thread: static split vs HistoPipe placement vs placement + tail migration, side by
side, and against 1 in-process engine on the same 2 threads (Ray's overhead). SmolLM2-135M, a long-tailed prompt
set (groups differ in length), one warm-up epoch so the length predictor has history; every arm must return the
very same tokens.

    .venv/bin/python benchmarks/cluster.py [--epochs 2] [--n 4] [--max-tokens 256]
    .venv/bin/python benchmarks/cluster.py --siblings      # acceptance added by group drafting across workers

The arms share one pair of workers (this machine has 2 cores), each with its own length predictor (history of
the epochs before). "Ray overhead" is the share of the wall time the busier worker spent outside engine steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tailrl.cluster.config import ClusterConfig  # noqa: E402
from tailrl.cluster.cost import StepCost  # noqa: E402
from tailrl.cluster.placement import LengthPredictor  # noqa: E402
from tailrl.cluster.rollout import ClusterRollout  # noqa: E402
from tailrl.cluster.workers import WorkerSpec  # noqa: E402
from tailrl.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from tailrl.model import load_model  # noqa: E402

# long and short groups: counting and listing run long, one-word answers stop early
CHATS = ["Count from 1 to 60 separated by commas.", "Name three colours.", "Write a long story about a dragon.",
         "What is 2 + 2?", "List the first twenty prime numbers, one per line.", "Say hello.",
         "Explain in detail how a car engine works.", "Is the sky blue? Answer yes or no."]
# SmolLM2-135M fp32, 1 thread, fitted by benchmarks/cluster_calib.py (see benchmarks/RESULTS.md)
COST = StepCost(0.05157, 0.007852, 4.5966e-6, 0.0269, 0.004325)


def arm_configs() -> dict[str, ClusterConfig]:
    return {"static": ClusterConfig(placement="static", migrate=False),
            "HistoPipe": ClusterConfig(placement="histopipe", migrate=False),
            "HistoPipe+migration": ClusterConfig(placement="histopipe", migrate=True)}


def sibling_table(spec: WorkerSpec, prompts: list, n: int, max_tokens: int) -> None:
    """Seer's group drafting across workers: each group alone on 2 workers is divided 4+4 between them; with
    sibling_drafting on, each worker's history drafter also sees the other half's tokens as they are emitted."""
    print("\n| sibling drafting across workers | history accept length | history drafted / accepted | "
          "remote tokens forwarded | wall s |\n|---|---|---|---|---|")
    ref = None
    for on in (False, True):
        cr = ClusterRollout(spec, 2, ClusterConfig(sibling_drafting=on, migrate=False), COST)
        try:
            t, seq_steps, acc, drafted, remote, toks = time.perf_counter(), 0, 0, 0, 0, []
            for i, p in enumerate(prompts):  # one group per rollout (epoch 0: no history, siblings only)
                out = cr.generate([p], [SamplingParams(n=n, max_tokens=max_tokens, temperature=0.7, seed=7 + i)])
                d = out.stats.drafters.get("history", {})
                seq_steps += d.get("seq_steps", 0)
                acc += d.get("accepted", 0)
                drafted += d.get("drafted", 0)
                remote += cr.metrics["cluster/remote_tokens"]
                toks.append([c.token_ids for c in out])
            wall = time.perf_counter() - t
        finally:
            cr.shutdown()
        ref = ref or toks
        assert toks == ref, "sibling drafting changed the tokens"
        accept = (seq_steps + acc) / max(seq_steps, 1)
        print(f"| {'on' if on else 'off'} | {accept:.3f} | {drafted} / {acc} | {remote} | {wall:.1f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2, help="epoch 0 is the warm-up that gives history")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--spec", default="off")
    ap.add_argument("--siblings", action="store_true", help="only the sibling-drafting table (spec history)")
    ap.add_argument("--groups", type=int, default=8, help="--siblings: how many of the prompts")
    args = ap.parse_args()
    from tailrl.speculative.config import SpecConfig

    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for c in CHATS]
    def params(epoch: int) -> list[SamplingParams]:  # new seeds every epoch, as RL steps have
        return [SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, seed=1000 * epoch + 100 * i)
                for i in range(len(prompts))]

    ecfg = EngineConfig(kv_cache_gb=1.0, spec=SpecConfig(mode=args.spec))
    spec = WorkerSpec(model="smollm2-135m", engine=ecfg, threads=1)
    if args.siblings:
        hist = WorkerSpec(model="smollm2-135m", threads=1,
                          engine=EngineConfig(kv_cache_gb=1.0, spec=SpecConfig(mode="history")))
        sibling_table(hist, prompts[: args.groups], 8, args.max_tokens)
        return
    engine = Engine(model, tok, ecfg)
    cr = ClusterRollout(spec, 2, ClusterConfig(), COST)  # one pair of workers (2 CPUs); the arms switch its settings
    predictors = {name: LengthPredictor(args.max_tokens / 2) for name in arm_configs()}  # each arm's own history
    rows, ref, same = [], None, {}
    try:
        for epoch in range(args.epochs):
            t = time.perf_counter()
            base = engine.generate(prompts, params(epoch))
            rows.append((epoch, "1 engine x 2 threads (in process)", time.perf_counter() - t, None, base))
            ref = [c.token_ids for c in base]
            for name, cfg in arm_configs().items():  # interleaved with the baseline, one epoch at a time
                cr.cfg, cr.predictor = cfg, predictors[name]
                t = time.perf_counter()
                out = cr.generate(prompts, params(epoch))
                rows.append((epoch, f"2 Ray workers x 1 thread, {name}", time.perf_counter() - t, cr.metrics, out))
                same[name] = same.get(name, 0) + sum(c.token_ids == r for c, r in zip(out, ref))
                print(f"epoch {epoch} {name}: {rows[-1][2]:.1f} s", flush=True)
    finally:
        cr.shutdown()
    lens = sorted(len(c) for c in ref)
    total = len(ref) * args.epochs
    print(f"\n{len(prompts)} prompts x n={args.n}, T=1.0, max {args.max_tokens} tokens, spec {args.spec}; response "
          f"lengths min {lens[0]} / median {lens[len(lens) // 2]} / max {lens[-1]}; samples identical to the in-process "
          f"engine's: " + ", ".join(f"{k} {v}/{total}" for k, v in same.items()) + " (1 vs 2 threads and other batches "
          "differ in float rounding: a draw may flip where two tokens tie within that noise)\n")
    print("| epoch | arm | wall s | speedup vs static | busy s w0 / w1 | idle frac | Ray overhead | migrated | "
          "re-prefilled tokens | pred-len corr | pred-len MAE |")
    print("|" + "---|" * 11)
    for epoch in range(args.epochs):
        ep = [r for r in rows if r[0] == epoch]
        static = next(r[2] for r in ep if r[1].endswith("static"))
        for _, name, wall, m, _out in ep:
            if m is None:
                print(f"| {epoch} | {name} | {wall:.1f} | {static / wall:.2f}x | | | | | | | |")
                continue
            busy = [m[f"cluster/busy_s/{w}"] for w in range(2)]
            overhead = (wall - max(busy)) / wall  # time the critical worker was not in an engine step
            print(f"| {epoch} | {name} | {wall:.1f} | {static / wall:.2f}x | {busy[0]:.1f} / {busy[1]:.1f} | "
                  f"{m['cluster/idle_frac']:.2f} | {overhead * 100:.1f}% | {m['cluster/migrated']} | "
                  f"{m['cluster/reprefill_tokens']} | {m.get('cluster/len_pred_corr', 0):.2f} | "
                  f"{m.get('cluster/len_pred_mae', 0):.1f} |")


if __name__ == "__main__":
    main()
