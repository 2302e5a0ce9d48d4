"""The trainer's side of `rollout.workers`: 1 keeps the in-process engine (Ray is never imported); N > 1 starts N
Ray rollout workers (tailrl.cluster) that load the policy by path, then get its weights by name every step.

Invariant: the N-worker rollout returns, for every (prompt, sample), the tokens and logprobs of the in-process
engine (seeds keyed by (run seed, step, prompt, sample)), so the reward curve does not depend on N."""

from __future__ import annotations

import dataclasses
import time

import torch

from ..config import Config
from ..engine import EngineConfig
from ..model.load import resolve_dtype
from .ray_worker import head_state, merge_heads


def make_cluster(cfg: Config, engine: EngineConfig | None = None):
    """None for rollout.workers = 1; else a started `ClusterRollout` (Ray local, or cluster.address) whose
    workers run engines configured like the in-process one (`engine`)."""
    r = cfg.rollout
    if r.workers <= 1:
        return None
    from ..cluster.rollout import ClusterRollout
    from ..cluster.workers import WorkerSpec

    engine = engine or EngineConfig(kv_cache_gb=r.kv_cache_gb, max_num_seqs=r.max_num_seqs, seed=cfg.trainer.seed,
                                    spec=r.spec, batch_invariant=r.batch_invariant, prefix_cache=r.prefix_cache)
    device = cfg.model.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = str(resolve_dtype(cfg.model.dtype, device)).removeprefix("torch.")  # auto: as the driver's hardware
    spec = WorkerSpec(model=cfg.model.path, engine=engine, dtype=dtype, device=cfg.model.device,
                      threads=r.worker_threads)
    if cfg.drafter.enabled or cfg.drafter.path:  # workers draft with the head, and train it when idle (TLT)
        spec.factory = "tailrl.rollout.ray_worker:build"
        spec.options = {"drafter": dataclasses.asdict(cfg.drafter), "seed": cfg.trainer.seed}
    return ClusterRollout(spec, r.workers, cfg.cluster, prior_length=r.max_tokens / 2, seed=cfg.trainer.seed)


def cluster_rollout(cluster, weights: dict, prompts: list, params: list, tasks: list | None = None, head=None):
    """One step's rollout on the workers: this step's weights (the policy's tensors by name) first (one
    object-store put, loaded by name; with the learned drafter, its head too), then the rollout; then the heads
    the idle workers trained are merged into `head`. Returns (completions with merged .stats, metrics incl. timing_s/sync)."""
    t = time.perf_counter()
    sync_s = cluster.sync_weights(weights, head_state(head) if head is not None else None)
    comps = cluster.generate(prompts, params, tasks)
    metrics = {k: v for k, v in cluster.metrics.items() if isinstance(v, (int, float))}
    if head is not None:
        metrics["drafter/idle_train_steps"] = merge_heads(head, cluster.idle_states)
        head.sync_head()
    metrics["timing_s/sync"] = sync_s
    metrics["timing_s/cluster_rollout"] = time.perf_counter() - t
    return comps, metrics
