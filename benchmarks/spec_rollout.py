"""RL-shaped rollout on SmolLM2-135M (fp32, CPU): a fixed prompt set, several epochs of n samples per prompt,
history carried across epochs; tailrl with SD auto vs SD off, side by side (interleaved per epoch) in one run.

Reports tokens/s overall and in the long tail (<= 4 running sequences), per batch-size bucket, the accept
length per drafter, the selector's choices per batch size, and the history drafter's proposal cost.

    .venv/bin/python benchmarks/spec_rollout.py [--epochs 3] [--n 4] [--max-tokens 256] [--temperatures 1.0 0.7]
    .venv/bin/python benchmarks/spec_rollout.py --device cuda   # bf16 on the GPU, CUDA graphs on (issue 11)
"""

from __future__ import annotations

import argparse
import time

import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import load_model
from tailrl.speculative.config import SpecConfig

# RL-like: mostly short verifiable answers, a few open-ended prompts that run long (the long tail)
QUESTIONS = [
    "What is 7 + 5? Give only the number after ####.",
    "What is 9 * 6? Give only the number after ####.",
    "Is 17 a prime number? Answer yes or no after ####.",
    "What is 100 - 37? Give only the number after ####.",
    "Tom has 12 apples and buys 3 bags with 4 apples each. How many apples does he have? Answer after ####.",
    "What is (15 + 9) * 2 - 8? Explain briefly, then answer after ####.",
    "A bus carries 40 people. How many buses are needed for 250 people? Explain, then answer after ####.",
    "List the first 40 square numbers with a one-line note on each, then give their sum after ####.",
]


def prompts(tok):
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def steady(st) -> float:
    """Tokens/s of a generate call without its one-time CUDA-graph captures (a long run amortises them)."""
    return rate(st.generated_tokens, st.total_s - st.capture_s)


def bucket_name(b: int) -> str:
    lo, hi = (1 << (b - 1)) + 1 if b else 1, 1 << b
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def run(args, temperature: float, model, tok) -> dict:
    off = Engine(model, tok, EngineConfig(kv_cache_gb=2.0))
    auto = Engine(model, tok, EngineConfig(kv_cache_gb=2.0, spec=SpecConfig(mode="auto")))
    ps = prompts(tok)
    rows = []
    for epoch in range(args.epochs):
        params = SamplingParams(n=args.n, temperature=temperature, max_tokens=args.max_tokens, seed=100 * epoch)
        res = {}
        for name, eng in (("off", off), ("auto", auto)):
            t = time.perf_counter()
            outs = eng.generate(ps, params)
            res[name] = (eng.last_stats, time.perf_counter() - t, outs)
        rows.append(res)
    return {"rows": rows, "auto": auto}


def report(args, temperature: float, result: dict) -> None:
    rows = result["rows"]
    print(f"\n### temperature {temperature}: {len(QUESTIONS)} prompts x n={args.n}, max {args.max_tokens} tokens\n")
    print("| epoch | off tok/s | auto tok/s | speedup | off tail tok/s | auto tail tok/s | tail speedup | "
          "accept len history | accept len ngram | mean resp len off / auto |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    tot = {"off": [0, 0.0, 0, 0.0, 0.0], "auto": [0, 0.0, 0, 0.0, 0.0]}
    buckets: dict[str, dict[int, list[float]]] = {"off": {}, "auto": {}}
    for e, res in enumerate(rows):
        so, ta = res["off"][0], res["auto"][0]
        for name in ("off", "auto"):
            st = res[name][0]
            tot[name][0] += st.generated_tokens
            tot[name][1] += st.total_s - st.capture_s
            tot[name][4] += st.capture_s
            tot[name][2] += st.tail_tokens
            tot[name][3] += st.tail_s
            for b, (n, s) in st.by_bucket.items():
                cell = buckets[name].setdefault(b, [0, 0.0])
                cell[0] += n
                cell[1] += s
        lens = {k: sum(len(o.token_ids) for o in res[k][2]) / len(res[k][2]) for k in ("off", "auto")}
        print(f"| {e} | {steady(so):.1f} | {steady(ta):.1f} | {ratio(steady(ta), steady(so))} | "
              f"{so.tail_tokens_per_s:.1f} | {ta.tail_tokens_per_s:.1f} | "
              f"{ratio(ta.tail_tokens_per_s, so.tail_tokens_per_s)} | {ta.accept_length('history'):.2f} | "
              f"{ta.accept_length('ngram'):.2f} | {lens['off']:.0f} / {lens['auto']:.0f} |")
    o, a = tot["off"], tot["auto"]
    print(f"| all | {rate(o[0], o[1]):.1f} | {rate(a[0], a[1]):.1f} | {ratio(rate(a[0], a[1]), rate(o[0], o[1]))} | "
          f"{rate(o[2], o[3]):.1f} | {rate(a[2], a[3]):.1f} | {ratio(rate(a[2], a[3]), rate(o[2], o[3]))} | | | |")
    hist = [r["auto"][0] for r in rows[1:]]
    if hist:
        h = [sum(x) for x in zip(*[(st.generated_tokens, st.total_s - st.capture_s, st.tail_tokens, st.tail_s)
                                   for st in hist])]
        ho = [sum(x) for x in zip(*[(st.generated_tokens, st.total_s - st.capture_s, st.tail_tokens, st.tail_s)
                                    for st in (r["off"][0] for r in rows[1:])])]
        print(f"| epochs 1+ (with history) | {rate(ho[0], ho[1]):.1f} | {rate(h[0], h[1]):.1f} | "
              f"{ratio(rate(h[0], h[1]), rate(ho[0], ho[1]))} | {rate(ho[2], ho[3]):.1f} | {rate(h[2], h[3]):.1f} | "
              f"{ratio(rate(h[2], h[3]), rate(ho[2], ho[3]))} | | | |")
    if o[4] or a[4]:
        print(f"\nCUDA-graph captures (one-time, left out of the rates above): off {o[4]:.1f} s, auto {a[4]:.1f} s")
    print("\nDecode tokens/s per running batch size (all epochs):\n")
    print("| batch size | off tok/s | auto tok/s | ratio | selector's choices (auto, last epoch) |")
    print("|---|---|---|---|---|")
    last = rows[-1]["auto"][0].choices
    for b in sorted(set(buckets["off"]) | set(buckets["auto"])):
        bo, ba = buckets["off"].get(b, [0, 1]), buckets["auto"].get(b, [0, 1])
        ro, ra = rate(*bo), rate(*ba)
        ch = ", ".join(f"{k} {v}" for k, v in sorted(last.get(b, {}).items(), key=lambda kv: -kv[1]))
        print(f"| {bucket_name(b)} | {ro:.1f} | {ra:.1f} | {ratio(ra, ro)} | {ch} |")
    auto_stats = [r["auto"][0] for r in rows]
    props = sum(st.drafters.get(d, {}).get("seq_steps", 0) for st in auto_stats for d in ("history", "ngram"))
    draft_s = sum(st.draft_s for st in auto_stats)
    print(f"\ndraft proposal cost: {1e6 * draft_s / max(props, 1):.0f} us per sequence-step with a drafter "
          f"(includes shadow drafts of the drafters not chosen)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA and on CPUs with AVX-512 BF16/AMX, as the engine")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m", device=args.device, dtype=args.dtype)
    where = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    print(f"SmolLM2-135M {str(model.dtype).removeprefix('torch.')}, {where}; SD auto vs off on the same prompts "
          "and settings, interleaved per epoch")
    for temp in args.temperatures:
        report(args, temp, run(args, temp, model, tok))


if __name__ == "__main__":
    main()
