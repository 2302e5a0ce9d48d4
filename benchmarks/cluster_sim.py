"""Event simulation of a rollout on 8..1024 workers: static split vs HistoPipe placement vs placement plus tail
migration, each without and with speculation in the tail. Prints makespan, idle fraction and speedup.

The per-step cost model (tailrl.cluster.cost.StepCost) is measured here on SmolLM2-135M (`--measure`, which also
runs a single-worker rollout and prints the simulator's prediction for it) or passed as `--cost base,tok,attn`.

    .venv/bin/python benchmarks/cluster_sim.py --measure    # calibrate, check 1 worker, print the table
    .venv/bin/python benchmarks/cluster_sim.py              # the table with the cost model measured last time
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tailrl.cluster.cost import StepCost  # noqa: E402
from tailrl.cluster.migrate import Candidate, plan_moves  # noqa: E402
from tailrl.cluster.placement import Unit, place, static_split  # noqa: E402


# SmolLM2-135M fp32, 1 thread, fitted by `benchmarks/cluster_calib.py` (the table in benchmarks/RESULTS.md)
MEASURED = "0.05157,0.007852,0.0000045966,0.0269,0.004325"


@dataclass
class Seq:
    length: int  # actual response length (unknown to the scheduler)
    prompt_len: int
    past: list  # the prompt's lengths in the previous epoch (the history the scheduler predicts from)
    predicted: float
    done: float = 0.0

    def remaining_pred(self, cap: int) -> float:
        longer = [n - self.done for n in self.past if n > self.done]
        est = sum(longer) / len(longer) if longer else max(self.predicted - self.done, 0.5 * self.done, 1.0)
        return min(est, cap - self.done)


@dataclass
class Spec:
    """Chain drafts of d tokens, each accepted with probability alpha given its prefix was: a verification step
    emits tau(d) = 1 + alpha + ... + alpha^d tokens per sequence for a pass of 1 + d tokens per sequence."""

    alpha: float
    drafts: tuple = (1, 2, 4, 8)

    def arms(self) -> list[tuple[float, float]]:
        return [(sum(self.alpha**k for k in range(d + 1)), 1.0 + d) for d in self.drafts]


@dataclass
class SimWorker:
    wid: int
    waiting: deque = field(default_factory=deque)  # (seqs, prefill tokens): a unit shares one prefill
    running: list = field(default_factory=list)
    clock: float = 0.0
    busy: float = 0.0
    pred_left: float = 0.0
    version: int = 0
    n: int = 0  # sequences held (running + waiting)
    backoff: int = 16  # decode steps an idle worker waits before it looks for tail work again (doubles)

    def held(self) -> int:
        return self.n

    def recount(self) -> None:
        self.n = len(self.running) + sum(len(s) for s, _ in self.waiting)


def run_chunk(w: SimWorker, cost: StepCost, max_seqs: int, spec: Spec | None, cap: int, max_steps: int = 64) -> None:
    """Admit what fits (one prefill forward), else decode until the first running sequence finishes."""
    if w.waiting and len(w.running) < max_seqs:
        tokens = 0
        while w.waiting and len(w.running) < max_seqs:
            seqs, pre = w.waiting[0]
            room = max_seqs - len(w.running)
            if len(seqs) > room:  # the engine admits a group in chunks that fit
                w.waiting[0] = (seqs[room:], pre)
                seqs = seqs[:room]
            else:
                w.waiting.popleft()
            w.running += seqs
            tokens += pre
        dt = cost.prefill(tokens)
    else:
        B = len(w.running)
        ctx = sum(s.prompt_len + s.done for s in w.running)
        e, q = 1.0, 1.0
        if spec is not None:  # the selector's rule: the arm with the most tokens per second at this batch size
            e, q = max([(1.0, 1.0)] + spec.arms(), key=lambda a: a[0] / cost.decode(B, ctx, a[1]))
        k = min(min(math.ceil((s.length - s.done) / e) for s in w.running), max_steps)
        dt = k * cost.decode(B, ctx + B * e * k / 2, q)
        for s in w.running:
            s.done = min(s.done + e * k, s.length)
        w.running = [s for s in w.running if s.done < s.length]
    w.clock += dt
    w.busy += dt
    w.recount()
    rem = [s.remaining_pred(cap) for s in w.running] + [s.remaining_pred(cap) for seqs, _ in w.waiting for s in seqs]
    w.pred_left = cost.base_s * max(rem, default=0.0) + cost.per_token_s * sum(rem)  # predicted time to finish


def simulate(plan: list[list[list[Seq]]], cost: StepCost, max_seqs: int, cap: int, spec: Spec | None = None,
             migrate: bool = False, min_donor: int = 2) -> dict:
    """plan[w] = the units of worker w in run order; a unit = the samples sharing one prefill."""
    W = len(plan)
    workers = [SimWorker(w) for w in range(W)]
    for w, units in zip(workers, plan):
        for seqs in units:
            w.waiting.append((seqs, seqs[0].prompt_len))
        w.recount()
    heap = [(0.0, w.wid, 0) for w in workers]
    finish = [0.0] * W
    moved = reprefill = 0
    while heap:
        t, wid, version = heapq.heappop(heap)
        w = workers[wid]
        if version != w.version:
            continue
        if w.running or w.waiting:
            run_chunk(w, cost, max_seqs, spec, cap)
            finish[wid] = w.clock
            heapq.heappush(heap, (w.clock, wid, w.version))
            continue
        if not migrate:
            continue
        donors = [d for d in workers if d.held() >= min_donor]
        idle = sum(1 for d in workers if not d.held())
        if not donors:
            continue  # nothing left worth taking: this worker is done
        take, donor = set(), None
        for donor in heapq.nlargest(8, donors, key=lambda d: d.pred_left):  # the most loaded donor where a move pays
            cands = [Candidate(s, s.prompt_len, int(s.done), s.remaining_pred(cap)) for s in donor.running]
            cands += [Candidate(s, s.prompt_len, 0, s.remaining_pred(cap)) for seqs, _ in donor.waiting for s in seqs]
            take = {id(c.key) for c in plan_moves(cands, 0, cost, min_donor, max_moves=max(len(cands) // idle, 1))}
            if take:
                break
        if not take:  # look again later (backing off: 16, 32, 64, ... of the donor's decode steps)
            w.clock = max(w.clock, donor.clock) + w.backoff * cost.decode(len(donor.running))
            w.backoff *= 2
            w.version += 1
            heapq.heappush(heap, (w.clock, wid, w.version))
            continue
        for s in donor.running:
            if id(s) in take:
                w.waiting.append(([s], s.prompt_len + int(s.done)))
                reprefill += s.prompt_len + int(s.done)
        donor.running = [s for s in donor.running if id(s) not in take]
        kept = deque()
        for seqs, pre in donor.waiting:
            mine = [s for s in seqs if id(s) in take]
            if mine:
                w.waiting.append((mine, pre))
            rest = [s for s in seqs if id(s) not in take]
            if rest:
                kept.append((rest, pre))
        donor.waiting = kept
        donor.recount()
        w.recount()
        w.backoff = 16
        moved += len(take)
        w.clock = max(w.clock, donor.clock)  # the donor's state is as of its clock: no time travel
        w.version += 1
        heapq.heappush(heap, (w.clock, wid, w.version))
    makespan = max(finish)
    busy = sum(w.busy for w in workers)
    return {"makespan": makespan, "idle": 1 - busy / (W * makespan) if makespan else 0.0, "migrated": moved,
            "reprefill": reprefill}


def heavy_tailed(groups: int, n: int, cap: int, rng: random.Random, median: float = 1000.0, between: float = 0.8,
                 within: float = 0.5) -> list[tuple[float, list[int], list[int]]]:
    """Per group: (prompt mean, this epoch's lengths, last epoch's lengths). Most responses short, a few near
    the cap (lognormal group means, lognormal spread within a group, clipped to [8, cap])."""
    out = []
    for _ in range(groups):
        mu = math.log(median) + rng.gauss(0, between)
        draw = lambda: [int(min(max(math.exp(mu + rng.gauss(0, within)), 8), cap)) for _ in range(n)]  # noqa: E731
        out.append((mu, draw(), draw()))
    return out


def from_runs(path: str, groups: int, n: int, rng: random.Random) -> list[tuple[float, list[int], list[int]]]:
    """Lengths from a run's metrics.jsonl (`response_lengths` per step, n per group): groups resampled."""
    pool = []
    with open(path) as f:
        for line in f:
            lens = json.loads(line).get("response_lengths")
            if lens:
                pool += [lens[i : i + n] for i in range(0, len(lens) - n + 1, n)]
    out = []
    for _ in range(groups):
        g = rng.choice(pool)
        out.append((0.0, list(g), list(rng.choice(pool))))
    return out


def make_plans(data, workers: int, prompt_len: int, cost: StepCost | None = None, max_seqs: int = 256):
    """Static (contiguous groups) and HistoPipe (LPT on last epoch's mean, longest first) plans of Seq units."""
    n = len(data[0][1])
    units = [Unit(g, 0, n, sum(past) / len(past)) for g, (_, _, past) in enumerate(data)]

    def build(p):
        plan = []
        for wu in p:
            plan.append([[Seq(data[u.prompt_index][1][u.first + j], prompt_len, data[u.prompt_index][2], u.predicted)
                          for j in range(u.count)] for u in wu])
        return plan

    return build(static_split(units, workers)), build(place(units, workers, cost=cost, max_seqs=max_seqs))


def table(cost: StepCost, workers_list, groups_per_worker: int, n: int, cap: int, spec: Spec, max_seqs: int,
          prompt_len: int, seed: int, runs: str | None = None) -> list[str]:
    rows = ["| workers | seqs | static s | HistoPipe s | +migration s | static+SD s | HistoPipe+SD s | +migration+SD s "
            "| idle static / +mig+SD | migrated | speedup HistoPipe | speedup +migration | speedup +migration+SD |",
            "|" + "---|" * 13]
    print(rows[0], rows[1], sep="\n", flush=True)
    for W in workers_list:
        rng = random.Random(seed + W)
        data = from_runs(runs, W * groups_per_worker, n, rng) if runs else heavy_tailed(W * groups_per_worker, n, cap, rng)
        res = {}
        for sd in (None, spec):
            for name, mig in (("static", False), ("histo", False), ("mig", True)):
                static, histo = make_plans(data, W, prompt_len, cost, max_seqs)
                res[(name, sd is not None)] = simulate(static if name == "static" else histo, cost, max_seqs, cap, sd, mig)
        s0 = res[("static", False)]["makespan"]
        m = {k: v["makespan"] for k, v in res.items()}
        idle = f"{res[('static', False)]['idle']:.2f} / {res[('mig', True)]['idle']:.2f}"
        cells = [W, W * groups_per_worker * n] + [f"{m[(a, sd)]:.1f}" for sd in (False, True) for a in ("static", "histo", "mig")]
        cells += [idle, res[("mig", False)]["migrated"]]
        cells += [f"{s0 / m[(a, sd)]:.2f}x" for a, sd in (("histo", False), ("mig", False), ("mig", True))]
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
        print(rows[-1], flush=True)
    return rows


def single_worker_check(engine, tok, cost: StepCost, n: int = 4, max_tokens: int = 256) -> dict:
    """One rollout (8 chat prompts x n at T=1) on this engine, and the simulator's prediction from its lengths."""
    from cluster_calib import CHATS  # benchmarks/cluster_calib.py
    from tailrl.engine import SamplingParams

    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
               for c in CHATS]
    prompts = [tok.encode(p, add_special_tokens=False) for p in prompts]
    params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=1000 + i) for i in range(len(prompts))]
    t = time.perf_counter()
    comps = engine.generate(prompts, params)
    measured = time.perf_counter() - t
    units = []
    for i, p in enumerate(prompts):
        units.append([Seq(len(c.token_ids), len(p), [], 0.0) for c in comps if c.prompt_index == i])
    sim = simulate([units], cost, engine.config.max_num_seqs, max_tokens)
    lens = sorted(len(c.token_ids) for c in comps)
    return {"measured_s": measured, "simulated_s": sim["makespan"], "error": sim["makespan"] / measured - 1,
            "lengths": f"min {lens[0]}, median {lens[len(lens) // 2]}, max {lens[-1]}, {len(lens)} samples"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", action="store_true", help="measure the cost model and a 1-worker rollout on SmolLM2")
    ap.add_argument("--cost", default=MEASURED, help="base_s,per_token_s,per_attn_s,prefill_base_s,prefill_token_s")
    ap.add_argument("--workers", default="8,16,64,256,1024")
    ap.add_argument("--groups-per-worker", type=int, default=8)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--cap", type=int, default=8192)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-seqs", type=int, default=32, help="sequences a worker runs at once (KV-bound)")
    ap.add_argument("--alpha", type=float, default=0.7, help="per-token acceptance of history drafts")
    ap.add_argument("--runs", default="", help="a metrics.jsonl whose response_lengths give the distribution")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.measure:
        from cluster_calib import calibrate  # benchmarks/cluster_calib.py

        cost, engine, tok = calibrate()
        check = single_worker_check(engine, tok, cost)
        print("| single-worker rollout | measured s | simulated s | error |\n|---|---|---|---|")
        print(f"| 8 prompts x 4 at T=1, max 256 ({check['lengths']}) | {check['measured_s']:.1f} | "
              f"{check['simulated_s']:.1f} | {check['error'] * 100:+.1f}% |\n")
    else:
        cost = StepCost(*(float(x) for x in args.cost.split(",")))
    print(f"cost model: {cost.to_dict()}")
    spec = Spec(args.alpha)
    print(f"\nheavy-tailed lengths (lognormal, median 1000, cap {args.cap}), {args.groups_per_worker} groups x "
          f"{args.n} samples per worker, prompt {args.prompt_len} tokens, max {args.max_seqs} running per worker; "
          f"SD: chain drafts of 1/2/4/8 tokens at per-token acceptance {args.alpha}, the arm the cost model says is "
          "fastest at each batch size (plain decoding where none pays)\n")
    t = time.perf_counter()
    table(cost, [int(x) for x in args.workers.split(",")], args.groups_per_worker, args.n, args.cap, spec,
          args.max_seqs, args.prompt_len, args.seed, args.runs or None)
    print(f"\n(simulated in {time.perf_counter() - t:.0f} s)")


if __name__ == "__main__":
    main()
