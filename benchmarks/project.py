"""A PROJECTION, not a measurement: a real rollout's decode steps replayed against GPU forward-cost tables, to plan
past the machines we have (issue 29). Prints the projected decode time with SD and without, per batch bucket, and
the long tail's share.

Step records: per decode step of an SD-auto rollout, the running batch, the longest draft (tokens per sequence),
drafted and accepted tokens; per rollout, the response lengths. Either `--records FILE` (written before by
`--save FILE`) or, by default, a short rollout made now: SmolLM2-135M on this CPU, 2 epochs of the same prompts
with the history carried over, SD auto (4 prompts x 4 samples of up to 64 tokens by default: a minute or two).

The replay:
- SD: every recorded step costs one forward of its pass, padded as CUDA graphs pad it (sequences to the next of
  engine/buckets.py's BATCH_SIZES, tokens per sequence to the next of TOKENS_PER_SEQ).
- off: the same responses, one token per sequence per step: at plain step t the batch is the responses with more
  than t + 1 tokens (the first token comes from the prefill). Lossless SD draws from the same distribution, so the
  responses are those SD off would draw (on a CPU with batch-invariant decoding, the very tokens).
- `--replicate R`: R copies of the rollout run side by side (batch x R, the same acceptance), for batches at the
  seeds' scale.
- Prefill is left out (the same in both arms), and so is attention past the tables' context (200 tokens).

Forward-cost tables (benchmarks/RESULTS.md, "The GPU path on an H100", measured 2026-11-23 with CUDA graphs):
a pass's cost is taken as a function of the tokens in it, N = sequences x tokens per sequence, interpolated
linearly between measured points and extended with the last segment's slope. In the measured SmolLM2 grid, passes
of equal N cost within ~10% of each other whatever their shape (printed: the model's error on each point).
- smollm2-135m: `benchmarks/gpu/cost.py all` (batch 1, 4, 32 x k = 1-32) and `host_overhead.py`'s forward (batch 1-256).
- qwen3-8b (random weights): batch 1 k=1 10.4 ms; k=32 at batch 1 1.17x; at batch 32 k=8 1.37x, k=16 1.85x, k=32
  3.09x of batch 32 k=1, which was not printed: taken as batch 1 k=32's (the same 32 tokens; an assumption).
- `--host today` adds the host work a step paid outside the forward on that H100 (host_overhead.py, round 3:
  off = step - forward; SD = the auto arm's step - forward, at ~0 acceptance), measured with SmolLM2's 49k
  vocabulary; `--host none` (default) is the forward alone, the aim of issue 29's sampler in the graph.

    .venv/bin/python benchmarks/project.py [--replicate 1 8] [--host none today] [--save /tmp/records.jsonl]
    .venv/bin/python benchmarks/project.py --records /tmp/records.jsonl --replicate 32
"""

from __future__ import annotations

import argparse
import json
import time
from bisect import bisect_left

from spec_rollout import QUESTIONS  # RL-like prompts: short answers, and a few that run long

from tailrl.engine.buckets import BATCH_SIZES, TOKENS_PER_SEQ
from tailrl.speculative.step_cost import batch_bucket

# the measured points, (batch, k) -> ms of one pass
SMOLLM2_POINTS = {(1, 1): 3.15, (1, 2): 3.15 * 1.11, (1, 4): 3.15 * 1.12, (1, 8): 3.15 * 1.14, (1, 16): 3.15 * 1.16,
                  (1, 32): 3.15 * 1.20, (4, 1): 3.41, (4, 2): 3.41 * 1.03, (4, 4): 3.41 * 1.07, (4, 8): 3.41 * 1.08,
                  (4, 16): 3.41 * 1.11, (4, 32): 3.41 * 1.15, (32, 1): 3.65, (32, 2): 3.65 * 1.14,
                  (32, 4): 3.65 * 1.15, (32, 8): 3.65 * 1.22, (32, 16): 3.65 * 1.31, (32, 32): 3.65 * 1.54,
                  (8, 1): 3.33, (128, 1): 4.12, (256, 1): 4.72}
QWEN3_8B_POINTS = {(1, 1): 10.4, (1, 32): 10.4 * 1.17, (32, 8): 10.4 * 1.17 * 1.37, (32, 16): 10.4 * 1.17 * 1.85,
                   (32, 32): 10.4 * 1.17 * 3.09}
TABLES = {"smollm2-135m": SMOLLM2_POINTS, "qwen3-8b": QWEN3_8B_POINTS}
# host work outside the forward per step, ms, by batch (round 3 of host_overhead.py on the H100)
HOST_OFF = {1: 5.42 - 3.10, 8: 5.60 - 3.33, 32: 5.63 - 3.55, 128: 7.85 - 4.12, 256: 8.61 - 4.72}
HOST_SD = {1: 5.82 - 3.10, 8: 6.10 - 3.33, 32: 6.81 - 3.55, 128: 12.15 - 4.12, 256: 14.97 - 4.72}



def curve(points: dict) -> list[tuple[int, float]]:
    """(N, ms) sorted by N; points with equal N averaged."""
    by: dict[int, list[float]] = {}
    for (b, k), ms in points.items():
        by.setdefault(b * k, []).append(ms)
    return sorted((n, sum(v) / len(v)) for n, v in by.items())


def interp(xy: list[tuple[int, float]], x: float) -> float:
    """Piecewise linear through xy, flat below the first point, the last segment's slope past the last."""
    xs = [p[0] for p in xy]
    if x <= xs[0] or len(xy) == 1:
        return xy[0][1]
    i = min(max(bisect_left(xs, x), 1), len(xy) - 1)
    (x0, y0), (x1, y1) = xy[i - 1], xy[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def padded(n: int, sizes: tuple[int, ...]) -> int:
    return next((s for s in sizes if s >= n), n)


def collect(args) -> list[dict]:
    """A short SD-auto rollout on this CPU: its decode steps and response lengths, as records."""
    from tailrl.engine import Engine, EngineConfig, SamplingParams
    from tailrl.model import load_model
    from tailrl.speculative.config import SpecConfig

    model, tok = load_model("smollm2-135m", device="cpu")
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, spec=SpecConfig(mode="auto")))
    widest = [1]
    decode = eng.runner.decode

    def recording_decode(roots, cache_lens, trees):  # the pass's longest tree: what a graph pads it to
        out = decode(roots, cache_lens, trees)
        widest[0] = max(out[2])
        return out

    eng.runner.decode = recording_decode
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[-args.prompts :]]  # the longer ones first
    records = []
    for epoch in range(args.epochs):
        params = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=100 * epoch)
        t = time.perf_counter()
        col = eng.collector(eng.add_requests(chats, params))
        while eng.has_work():
            out = eng.step()
            col.add(out)
            r = out.record
            if r.kind == "decode":
                records.append(dict(epoch=epoch, batch=r.batch, max_q=widest[0], tokens_in_pass=r.tokens_in_pass,
                                    drafted=r.drafted, accepted=r.accepted, emitted=r.emitted))
        eng.end_rollout(col.stats)  # the history drafter keeps this epoch's responses for the next
        lengths = [len(c.token_ids) for c in col.result()]
        records.append(dict(epoch=epoch, lengths=lengths))
        print(f"  rollout {epoch}: {len(lengths)} responses, {sum(lengths)} tokens, {time.perf_counter() - t:.0f} s "
              "on this CPU", flush=True)
    return records


def host_ms(table: dict, B: int) -> float:
    return interp(sorted(table.items()), B)


def project(records: list[dict], points: dict, replicate: int, host: str, tail: int) -> dict:
    """Seconds per arm. "buckets": SD-step batch bucket -> [SD steps, tokens, plain s for those tokens, SD s, SD s
    with plain steps where they are cheaper]; "off" and "sd": [whole rollouts' s, s with <= tail sequences of a
    copy running]; "ideal": the whole SD time with plain steps where they are cheaper."""
    xy = curve(points)

    def cost(B: int, q: int, sd: bool) -> float:
        ms = interp(xy, padded(B, BATCH_SIZES) * padded(q, TOKENS_PER_SEQ))
        return (ms + (host_ms(HOST_SD if sd else HOST_OFF, B) if host == "today" else 0.0)) / 1e3

    buckets: dict[int, list] = {}
    off, sd, ideal = [0.0, 0.0], [0.0, 0.0], 0.0
    for r in records:
        if "lengths" in r:  # SD off: the same responses, one token per sequence a step
            for t in range(max(r["lengths"], default=1) - 1):
                B = sum(1 for n in r["lengths"] if n - 1 > t)
                s = cost(B * replicate, 1, False)
                off[0] += s
                off[1] += s if B <= tail else 0.0
            continue
        B = r["batch"] * replicate
        s = cost(B, r["max_q"], r["max_q"] > 1)
        plain = r["emitted"] / r["batch"] * cost(B, 1, False)  # plain steps that emit as many tokens at this batch
        c = buckets.setdefault(batch_bucket(B), [0, 0, 0.0, 0.0, 0.0])
        c[0] += 1
        c[1] += r["emitted"] * replicate
        c[2] += plain
        c[3] += s
        c[4] += min(s, plain)
        sd[0] += s
        sd[1] += s if r["batch"] <= tail else 0.0
        ideal += min(s, plain)
    return {"buckets": buckets, "off": off, "sd": sd, "ideal": ideal}


def bucket_name(b: int) -> str:
    lo, hi = (1 << (b - 1)) + 1 if b else 1, 1 << b
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def report(name: str, records: list[dict], replicate: int, host: str, tail: int) -> dict:
    p = project(records, TABLES[name], replicate, host, tail)
    print(f"\n#### projection: {name} on an H100, {replicate} cop{'y' if replicate == 1 else 'ies'} of the rollout "
          f"side by side, host work: {host}\n")
    print("| batch bucket (SD steps) | SD steps | tokens | projected plain s for these tokens | projected SD s | "
          "projected SD speedup | projected SD s, plain steps where cheaper | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    rows = sorted(p["buckets"].items())
    total = [sum(c[i] for _, c in rows) for i in range(5)]
    for b, c in rows + [("all", total)]:
        print(f"| {b if b == 'all' else bucket_name(b)} | {c[0]} | {c[1]} | {c[2]:.3f} | {c[3]:.3f} | "
              f"{c[2] / c[3]:.2f}x | {c[4]:.3f} | {c[2] / c[4]:.2f}x |")
    (off, off_tail), (sd, sd_tail) = p["off"], p["sd"]
    print(f"\nprojected whole rollouts (SD off decodes the same responses one token a step): off {off:.3f} s, "
          f"SD {sd:.3f} s ({off / sd:.2f}x), SD with plain steps where cheaper {p['ideal']:.3f} s "
          f"({off / p['ideal']:.2f}x)")
    print(f"projected tail share (<= {tail} sequences of a copy running): off {off_tail:.3f} s = {off_tail / off:.0%}"
          f" of its time, SD {sd_tail:.3f} s = {sd_tail / sd:.0%}")
    return p


def summary(results: list[tuple[str, str, int, dict]], tail: int) -> None:
    print("\n#### projection summary (decode time of the recorded rollouts, forward-cost tables of an H100)\n")
    print(f"| model | host work | copies | projected off s | projected SD s | SD speedup | SD, plain steps where "
          f"cheaper | SD speedup over its tokens, batch <= {tail} / all | tail share off / SD |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, host, rep, p in results:
        (off, off_tail), (sd, sd_tail) = p["off"], p["sd"]
        small = [c for b, c in p["buckets"].items() if b <= batch_bucket(tail * rep)]
        every = list(p["buckets"].values())

        def gain(cells):
            return sum(c[2] for c in cells) / max(sum(c[3] for c in cells), 1e-12)

        print(f"| {name} | {host} | {rep} | {off:.2f} | {sd:.2f} | {off / sd:.2f}x | {off / p['ideal']:.2f}x | "
              f"{gain(small):.2f}x / {gain(every):.2f}x | {off_tail / off:.0%} / {sd_tail / sd:.0%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", help="step records written by --save (default: make a short rollout now)")
    ap.add_argument("--save", help="write the step records here (JSON lines)")
    ap.add_argument("--models", nargs="+", default=list(TABLES), choices=list(TABLES))
    ap.add_argument("--replicate", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--host", nargs="+", default=["none"], choices=["none", "today"])
    ap.add_argument("--tail", type=int, default=4, help="the long tail: at most this many sequences of a copy run")
    ap.add_argument("--prompts", type=int, default=4, choices=range(1, len(QUESTIONS) + 1), metavar="1-8")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()
    if any(r < 1 for r in args.replicate) or args.tail < 1:
        ap.error("--replicate and --tail must be >= 1")
    if args.records:
        try:
            with open(args.records) as f:
                records = [json.loads(line) for line in f if line.strip()]
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"cannot read step records from {args.records}: {e}") from None
        if not any("lengths" in r for r in records) or not any("batch" in r for r in records):
            raise SystemExit(f"{args.records} holds no decode steps or no response lengths (write it with --save)")
    else:
        print(f"step records: SmolLM2-135M on this CPU, SD auto, {args.prompts} prompts x {args.n}, "
              f"{args.epochs} epochs, max {args.max_tokens} tokens, T={args.temperature}")
        records = collect(args)
    if args.save:
        with open(args.save, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    steps = [r for r in records if "batch" in r]
    drafted, accepted = sum(r["drafted"] for r in steps), sum(r["accepted"] for r in steps)
    print(f"\nrecorded: {len(steps)} SD decode steps, {sum(r['emitted'] for r in steps)} tokens emitted, "
          f"{drafted} drafted, {accepted} accepted ({accepted / max(drafted, 1):.0%}), "
          f"{sum(r['emitted'] for r in steps) / max(sum(r['batch'] for r in steps), 1):.2f} tokens per sequence-step")
    for name in args.models:
        xy = curve(TABLES[name])
        errs = [abs(ms / interp(xy, b * k) - 1) for (b, k), ms in TABLES[name].items()]
        print(f"\nforward-cost model {name}: " + ", ".join(f"N={n} {ms:.2f} ms" for n, ms in xy)
              + f" (largest error on a measured point {max(errs):.0%})")
    print("\nEverything below is a PROJECTION from those tables, not a measurement.")
    results = [(name, host, rep, report(name, records, rep, host, args.tail))
               for name in args.models for host in args.host for rep in args.replicate]
    summary(results, args.tail)


if __name__ == "__main__":
    main()
