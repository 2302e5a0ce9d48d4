"""What `max_tokens` and the KV budget cost a rollout (issue 34): SmolLM2-135M, bf16, CPU, spec off.

Three parts, each printing a table; run it once per engine version (the public API only, so the same script
measures the slot layout of an older checkout: `PYTHONPATH=<old checkout> python benchmarks/long_tail.py`):

- `fixed`: 64 requests whose responses are cut at exactly 64 tokens by the driver (greedy, ignore_eos; each
  sequence is aborted at its 64th token), while `max_tokens` is 128, 1024, 4096 and the most the context allows.
  A cache that reserves prompt + max_tokens per sequence pays for max_tokens; a paged one for what is held.
- `budget`: 16 arithmetic prompts x 8 samples, T=0.7, at a 0.5 GB budget, max_tokens 1024 and 4096: peak running
  sequences, peak KV bytes, wall time, preemptions.
- `issue`: the issue's table (16 x 8, T=0.7; max_tokens 128 and 1024; budgets 8 and 0.5 GB).

    .venv/bin/python benchmarks/long_tail.py --parts fixed budget issue [--label paged]
"""

from __future__ import annotations

import argparse
import time

import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import load_model


def arithmetic_prompts(n: int) -> list:
    from tailrl.config import Config
    from tailrl.tasks import chat_prompt
    from tailrl.tasks import make_rows

    system = Config().data.system_prompt
    return [chat_prompt(r["prompt"], system) for r in make_rows("arithmetic", n, seed=0)]


def engine(model, tok, gb: float) -> Engine:
    return Engine(model, tok, EngineConfig(kv_cache_gb=gb, seed=0))


def run_cut(eng: Engine, prompts: list, params: SamplingParams, cut: int) -> tuple[float, int, int]:
    """Drives the engine, aborting each sequence at `cut` tokens. Returns (wall s, tokens, peak running)."""
    t = time.perf_counter()
    eng.add_requests(prompts, params)
    tokens = peak = 0
    while eng.has_work():
        out = eng.step()
        tokens += out.record.emitted
        running = eng.scheduler.running
        peak = max(peak, len(running))
        done = [s.seq_id for s in running if len(s.output_ids) >= cut]
        if done:
            eng.abort(done)
    return time.perf_counter() - t, tokens, peak


def part_fixed(model, tok, label: str, args) -> None:
    prompts = arithmetic_prompts(args.requests)
    longest = max(len(tok.apply_chat_template(p, add_generation_prompt=True)) for p in prompts)
    ctx = model.config.max_position_embeddings
    print(f"\n### {label}: {args.requests} requests, responses cut at 64 tokens, greedy, {args.dtype}, 8 GB budget\n")
    print("| max_tokens | wall s | decode tok/s | peak running | wall / wall at 128 |")
    print("|---|---|---|---|---|")
    base = None
    for mt in [m if m > 0 else ctx - longest for m in args.max_tokens]:
        eng = engine(model, tok, 8.0)
        wall, tokens, peak = run_cut(eng, prompts, SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True), 64)
        base = base or wall
        print(f"| {mt} | {wall:.1f} | {tokens / wall:.1f} | {peak} | {wall / base:.2f}x |", flush=True)


_RUNS: dict = {}  # (max_tokens, gb) -> a run: the issue part reuses the budget part's row at 1024 tokens, 0.5 GB


def sample_groups(model, tok, max_tokens: int, gb: float):
    """16 arithmetic prompts x 8 samples at T=0.7: (wall s, completions, tokens)."""
    if (max_tokens, gb) not in _RUNS:
        eng = engine(model, tok, gb)
        t = time.perf_counter()
        outs = eng.generate(arithmetic_prompts(16), SamplingParams(n=8, temperature=0.7, max_tokens=max_tokens, seed=0))
        _RUNS[(max_tokens, gb)] = time.perf_counter() - t, outs, sum(len(o.token_ids) for o in outs)
    return _RUNS[(max_tokens, gb)]


def part_budget(model, tok, label: str, args) -> None:
    print(f"\n### {label}: 16 arithmetic prompts x 8 samples, T=0.7, 0.5 GB KV budget\n")
    print("| max_tokens | wall s | tokens | peak running | peak KV MB | preemptions |")
    print("|---|---|---|---|---|---|")
    for mt in args.budget_max_tokens:
        wall, outs, tokens = sample_groups(model, tok, mt, 0.5)
        st = outs.stats
        peak = max(st.batch_sizes) if st.batch_sizes else 0
        pre = getattr(st, "preemptions", "n/a")
        print(f"| {mt} | {wall:.1f} | {tokens} | {peak} | {st.peak_kv_bytes / 2**20:.0f} | {pre} |", flush=True)


def part_issue(model, tok, label: str, args) -> None:
    print(f"\n### {label}: the issue's table (16 x 8, T=0.7, spec off)\n")
    print("| max_tokens | KV budget | wall s | tokens | responses at the cap |")
    print("|---|---|---|---|---|")
    for mt, gb in [tuple(map(float, r.split(":"))) for r in args.issue_rows]:
        mt = int(mt)
        wall, outs, tokens = sample_groups(model, tok, mt, gb)
        capped = sum(o.finish_reason == "length" for o in outs)
        print(f"| {mt} | {gb} GB | {wall:.1f} | {tokens} | {capped} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["fixed", "budget", "issue"], choices=["fixed", "budget", "issue"])
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64, help="fixed: requests")
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[128, 1024, 4096, 0],
                    help="fixed: max_tokens values (0: the most the context allows)")
    ap.add_argument("--issue-rows", nargs="+", default=["128:8", "128:0.5", "1024:8", "1024:0.5"],
                    help="issue: max_tokens:GB rows")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16, or float32 on a CPU without bf16 hardware")
    ap.add_argument("--budget-max-tokens", type=int, nargs="+", default=[1024, 4096], help="budget: max_tokens values")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m", device="cpu", dtype=getattr(torch, args.dtype))
    for part in args.parts:
        {"fixed": part_fixed, "budget": part_budget, "issue": part_issue}[part](model, tok, args.label, args)


if __name__ == "__main__":
    main()
