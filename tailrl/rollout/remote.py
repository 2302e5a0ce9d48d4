"""The agent's turn loop on vLLM's Ray actors (rollout.backend=vllm, rollout.workers > 1): each actor runs the
trajectories of the prompts dealt to it to their end, tools and all, so a trajectory stays on its actor across
turns (VllmActor.run hands the loop the actor's LLM behind the engine calls, rollout/vllm/turns.py; its prefix
cache). The driver splits the prompts, gathers the completions in (prompt, sample) order and merges the metrics
(`merge_parts`, also the rounds driver's: remote_partial.py, which our engine's Ray workers run instead, so that
idle workers take trajectories mid-rollout).

On the batch-invariant engine a trajectory's tokens depend on its seeds only, so a rollout split across workers
gives the very trajectories one engine gives (tests/agent/test_agent_cluster.py runs this loop on our engine's
workers)."""

from __future__ import annotations

from ..config.agent import AgentConfig
from .base import Request

def worker_rollout(engine, cfg: AgentConfig, requests: list[Request]) -> tuple[list, dict, object]:
    """On a worker: (completions, agent metrics, GenerateStats) of these requests' trajectories."""
    from .turns import TurnLoop

    loop = TurnLoop(cfg, engine.tokenizer)
    try:
        comps, _, metrics, _ = loop.run(engine, requests)
    finally:
        loop.close()
    engine.end_rollout(comps.stats)
    return list(comps), metrics, comps.stats


def split(n: int, workers: int) -> list[list[int]]:
    """Prompt indices per worker: round robin (a step's prompts are alike in expected length here)."""
    return [list(range(w, n, workers)) for w in range(workers)]


def cluster_agent_rollout(cluster, cfg: AgentConfig, requests: list[Request]):
    """(completions in (prompt, sample) order with merged stats, merged agent metrics) over the cluster's workers:
    each worker is handed its share of the requests as they were built (base.make_requests)."""
    from ..engine.stats import Completions

    parts = [p for p in split(len(requests), cluster.num_workers) if p]
    args = {w: (cfg, [requests[i] for i in idx]) for w, idx in enumerate(parts)}
    done = cluster.run_each(worker_rollout, args)  # the function itself travels (by reference), not its name
    by_prompt = {}
    for w, idx in enumerate(parts):
        for c in done[w][0]:
            c.prompt_index = idx[c.prompt_index]
            by_prompt.setdefault(c.prompt_index, []).append(c)
    out = Completions(c for i in range(len(requests)) for c in sorted(by_prompt.get(i, []), key=lambda c: c.sample_index))
    metrics, out.stats = merge_parts([done[w] for w in range(len(parts))])
    return out, metrics


def merge_parts(parts: list[tuple[list, dict, object]]) -> tuple[dict, object]:
    """(agent metrics, GenerateStats) merged over the workers' (completions, agent metrics, stats): per-trajectory
    means weigh by each worker's trajectories (the completions its metrics are over), counts and seconds add."""
    from ..engine.stats import GenerateStats

    metrics, total = {}, 0
    for comps, m, _ in parts:
        n = len(comps)
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + (v * n if _is_mean(k) else v)
        total += n
    metrics = {k: (v / max(total, 1) if _is_mean(k) else v) for k, v in metrics.items()}
    masks = [c.response_mask for comps, _, _ in parts for c in comps if c.response_mask is not None]
    if masks:  # a share of tokens, not of trajectories: counted over every worker's tokens at once
        metrics["agent/masked_share"] = sum(len(m) - sum(m) for m in masks) / max(sum(len(m) for m in masks), 1)
    merged = GenerateStats()
    for _, _, st in parts:
        merged.merge(st)
    merged.total_s = max((st.total_s for _, _, st in parts), default=0.0)  # the workers ran at once
    return metrics, merged


def _is_mean(key: str) -> bool:
    return key not in ("agent/tool_errors", "agent/tool_timeouts", "agent/tool_s")
