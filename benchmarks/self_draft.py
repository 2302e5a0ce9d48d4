"""The self-speculative drafter's costs and acceptance (speculative/self_draft.py): a draft level (one quantized pass
for B sequences) against a plain target decode pass and a verify pass of a chain, at B = 1, 4, 16 and a context of
the preset's prompts, then its acceptance on a short rollout (mode self: every step drafts).

    .venv/bin/python benchmarks/self_draft.py [--quant int8,int4] [--vocab 0,8192] [--depth 3] [--max-tokens 128]

Run it on a quiet machine (benchmarks of this repository take a lock: /work/notes/q/bench.sh)."""

from __future__ import annotations

import argparse
import time

import torch

from tailrl.config import load_config
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import load_model
from tailrl.rl.data import load_datasets
from tailrl.speculative.config import SpecConfig
from tailrl.speculative.tree import DraftTree
from tailrl.tasks import chat_prompt


def timed(fn, n: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def pass_costs(model, tok, rows, quant: str, vocab: int, depth: int, reps: int, qrows: int | None) -> None:
    for B in (1, 4, 16):
        spec = SpecConfig(mode="self", self_quant=quant, self_vocab=vocab)
        eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, batch_invariant=True, spec=spec))
        eng.add_requests([rows[i % len(rows)] for i in range(B)], SamplingParams(max_tokens=64, temperature=0.7, seed=1))
        while len(eng.scheduler.running) < B or any(not s.output_ids for s in eng.scheduler.running):
            eng.step()
        run, runner = eng.scheduler.running, eng.runner
        eng.scheduler.make_room(eng.lookahead)
        d = eng.speculator.drafters["self"]
        d.max_rows = qrows
        d.refresh(force=True)
        roots, lens, slots = [s.output_ids[-1] for s in run], [s.cache_len for s in run], [s.slot for s in run]
        plain = timed(lambda: runner.decode(roots, lens, None), reps)
        chain = [DraftTree([roots[0]] * depth, list(range(-1, depth - 1))) for _ in run]
        verify = timed(lambda: runner.decode(roots, lens, chain), reps)
        level = timed(lambda: d.logits(roots, lens, slots), reps)
        prop = timed(lambda: d.propose(run, [depth] * B, [depth] * B), max(reps // depth, 2))
        ctx = sum(lens) / B
        print(f"| {quant} | {vocab or 'all'} | {qrows or 'table'} | {B} | {ctx:.0f} | {plain:.1f} | {verify:.1f} | {level:.1f} | "
              f"{level / plain:.2f} | {prop:.1f} | {d.quantize_s * 1e3:.0f} | {d.nbytes / 2**20:.0f} |", flush=True)
        eng.abort(eng.unfinished_ids())


def acceptance(model, tok, rows, quant: str, vocab: int, max_tokens: int, n: int) -> None:
    for temp in (0.0, 0.7):
        spec = SpecConfig(mode="self", self_quant=quant, self_vocab=vocab)
        eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, batch_invariant=True, spec=spec))
        t = time.perf_counter()
        outs = eng.generate(rows, SamplingParams(max_tokens=max_tokens, temperature=temp, n=n, seed=5))
        wall = time.perf_counter() - t
        met = outs.stats.metrics()
        acc = met.get("spec/accept_length/self", 0.0)
        arms = ", ".join(f"{k.split('/')[-1]} {v:.0%}" for k, v in sorted(met.items(), key=lambda kv: -kv[1])
                         if k.startswith("spec/arm_share/") and v >= 0.05)
        toks = sum(len(o.token_ids) for o in outs)
        print(f"| {quant} | {vocab or 'all'} | T {temp} | {len(rows)} x {n} | {acc:.2f} | {toks / wall:.0f} | {arms} |",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="long")
    ap.add_argument("--quant", default="int8,int4")
    ap.add_argument("--vocab", default="0,8192")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rows", default="0", help="products quantized up to this many rows (0: quant_rows' table)")
    ap.add_argument("--skip-accept", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = load_config(None, [], args.preset)
    train, _ = load_datasets(cfg.data)
    rows = [chat_prompt(e.prompt, cfg.data.system_prompt) for e in train[: max(args.prompts, 16)]]
    model, tok = load_model(cfg.model.path, device="cpu", dtype=torch.bfloat16)
    kinds = [(q, int(v)) for q in args.quant.split(",") for v in args.vocab.split(",")]
    print(f"\nms per pass, {model.dtype}, chain depth {args.depth}")
    print("| quant | draft vocab | quantized rows | B | context | target plain | target verify | draft level | level / plain | "
          "propose (depth) | quantize ms | quantized MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for q, v in kinds:
        for r in args.rows.split(","):
            pass_costs(model, tok, rows, q, v, args.depth, args.reps, int(r) or None)
    if args.skip_accept:
        return
    print("\n| quant | draft vocab | sampling | requests | accept length | tok/s | arms |")
    print("|---|---|---|---|---|---|---|")
    for q, v in kinds:
        acceptance(model, tok, rows[: args.prompts], q, v, args.max_tokens, args.n)


if __name__ == "__main__":
    main()
