"""rollout.backend=vllm with rollout.workers > 1: one vllm.LLM per Ray actor, driven from the trainer's process.

Placement is our length-aware balancing (cluster/placement.py, HistoPipe): each prompt's response length predicted
from its earlier epochs (LengthPredictor), one unit per prompt holding all its samples (never split: they share a
prefill, and our proposer drafts each from its siblings, which it sees only on its own actor), LPT under the
step-cost model, then each bin to the actor that ran most of its prompts before (its proposer holds their history,
placement.affine). cluster.placement=static splits the prompts in order instead. Results come back in (prompt,
sample) order, as from one LLM, and make the same `Completion`s (rollout.py).

Weights: after each optimizer step, one object-store put of the (name, tensor) pairs in the rollout's dtype, and
every actor streams them into its LLM through vLLM's checkpoint loader (io.stream_weights).

Threads: an actor holds rollout.worker_threads CPUs in Ray and runs torch, which vLLM's in-process CPU worker
computes with, on that many threads, so N actors on N x worker_threads cores do not oversubscribe them. A
VLLM_CPU_OMP_THREADS_BIND of one core list per actor ("0-7|8-15") pins actor i to list i; otherwise no actor is
pinned (vLLM's "auto" binding would put every actor on the same cores).

Seeds: actor i's LLM is seeded trainer.seed + i (vLLM's seed is engine-wide: llm.make_llm), so sampled
responses differ from workers=1's at T > 0 while greedy ones equal them token for token.
The losslessness audit runs once, in the trainer's process before the actors start (spec.py), and every actor
gets the same speculative_config. An actor that fails stops the rollout with an error naming its index: there is
no re-run on another actor (an LLM takes a minute to start; the run resumes from its last checkpoint)."""

from __future__ import annotations

import os
import time

import torch

from ...cluster.cost import StepCost
from ...cluster.placement import LengthPredictor, Unit, affine, length_metrics, place, prompt_key, static_split


def pinned_cpus(bind: str, index: int) -> set[int] | None:
    """Actor `index`'s cores from a VLLM_CPU_OMP_THREADS_BIND of per-actor lists ("0-3|4-7"), else None."""
    if "|" not in bind:
        return None
    lists = bind.split("|")
    if index >= len(lists):
        raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={bind!r} has {len(lists)} core lists, one per vLLM actor: "
                         f"actor {index} has none (give one per rollout.workers)")
    cpus = set()
    for part in lists[index].split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


class VllmActor:
    """One vllm.LLM in a Ray actor: samples the prompts it is given, takes new weights by name."""

    def __init__(self, index: int, folder: str, dtype: str, seed: int, max_len: int, spec: dict | None,
                 max_num_seqs: int, threads: int, env: dict):
        os.environ.update(env)  # the trainer's VLLM_* and TAILRL_VLLM_* settings, whatever Ray's workers inherited
        cpus = pinned_cpus(env.get("VLLM_CPU_OMP_THREADS_BIND", ""), index)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # an in-process LLM binds nothing itself
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)  # before the LLM: vLLM's CPU worker freezes the count once it starts
        from .llm import make_llm

        self.index = index
        self.llm = make_llm(folder, dtype, seed + index, max_len, spec, max_num_seqs)
        self.proposer = spec is not None and spec["method"] == "custom_class"

    def ping(self) -> tuple[int, int]:
        """(index, torch threads it computes with)."""
        return self.index, torch.get_num_threads()

    def load_weights(self, weights: dict, dtype: torch.dtype, tied: bool) -> int:
        from .io import stream_weights

        return stream_weights(self.llm, weights.items(), dtype, tied)

    def draw(self, prompts: list[list[int]], params: dict) -> tuple[list, dict | None, float]:
        """(per prompt its samples, our proposer's counters or None, seconds spent)."""
        from .io import draw

        t = time.perf_counter()
        drawn, spec = draw(self.llm, prompts, params, self.proposer)
        return drawn, spec, time.perf_counter() - t

    def run(self, fn, *args):
        """fn(engine, *args), fn a function the caller hands over (rollout/remote.py's turn loop, pickled by
        reference): the engine is this actor's LLM behind the loop's engine calls (turns.py), so a trajectory stays
        on its actor across turns and vLLM's prefix cache holds its earlier turns."""
        from .turns import VllmTurns

        return fn(VllmTurns(self.llm, self.proposer), *args)

    def prompt_logprobs(self, seq: list[int]) -> list[float]:
        """log p(seq[t] | seq[:t]), t >= 1, under this actor's weights: how a weight sync is checked."""
        from vllm import SamplingParams

        out = self.llm.generate([{"prompt_token_ids": seq}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                use_tqdm=False)
        return [float(d[t].logprob) for t, d in zip(seq[1:], out[0].prompt_logprobs[1:])]


def start_cluster(cfg, folder: str, dtype: str, max_len: int, spec: dict | None) -> VllmCluster:
    """rollout.workers VllmActors on Ray (local, or cluster.address), each started and answering."""
    import ray

    from ...cluster.workers import start_ray

    r = cfg.rollout
    start_ray(cfg.cluster.address)
    gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "TAILRL_VLLM_"))}  # TAILRL_VLLM_REPAIR too
    actor = ray.remote(VllmActor).options(num_cpus=0 if gpus else r.worker_threads, num_gpus=gpus,
                                          max_concurrency=1, max_restarts=0)
    handles = [actor.remote(i, folder, dtype, cfg.trainer.seed, max_len, spec, r.max_num_seqs, r.worker_threads, env)
               for i in range(r.workers)]
    cluster = VllmCluster(ray, handles, cfg.cluster.placement, r.max_num_seqs, r.max_tokens / 2)
    need = f"{gpus:g} GPU" if gpus else f"{r.worker_threads} CPU (rollout.worker_threads)"
    try:  # Ray holds an actor until its resources are free: a timeout with the reason, not a hang
        started = cluster._gather({i: h.ping.remote() for i, h in enumerate(handles)}, "start",
                                  max(cfg.cluster.step_timeout_s, 300.0), f"each needs {need}")
        cluster.threads = [started[i][1] for i in range(len(handles))]
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


class VllmCluster:
    """The trainer's side: N VllmActors (Ray handles), prompts placed by predicted length, weights to all."""

    def __init__(self, ray, handles: list, placement: str = "histopipe", max_seqs: int = 256,
                 prior_length: float = 256.0):
        self.ray, self.handles, self.placement, self.max_seqs = ray, handles, placement, max_seqs
        self.predictor = LengthPredictor(prior_length)
        self.cost = StepCost()
        self.last_worker: dict[int, int] = {}  # prompt key -> the actor that sampled it last
        self.where: list[int] = []  # the last rollout's actor of each prompt
        self.threads: list[int] = []  # each actor's torch threads, as it reported at start
        self.metrics: dict = {}

    def __len__(self) -> int:
        return len(self.handles)

    @property
    def num_workers(self) -> int:
        return len(self.handles)

    def run_each(self, fn, args: dict[int, tuple]) -> dict[int, object]:
        """fn(engine, *args[w]) on each actor w at once (VllmActor.run); the first failure raises, naming the actor."""
        return self._gather({w: self.handles[w].run.remote(fn, *a) for w, a in args.items()}, "run the turn loop")

    def _gather(self, calls: dict, what: str, timeout: float | None = None, hint: str = "") -> dict:
        """Every call's result by actor index; the first failure raises, naming the actor."""
        pending = {ref: i for i, ref in calls.items()}
        out = {}
        while pending:
            ready, _ = self.ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:
                raise RuntimeError(f"vLLM rollout actors {sorted(pending.values())} did not {what} within {timeout:.0f} "
                                   f"s; {hint}, and Ray has {self.ray.available_resources()} free (lower "
                                   "rollout.workers or rollout.worker_threads)")
            i = pending.pop(ready[0])
            try:
                out[i] = self.ray.get(ready[0])
            except Exception as e:  # noqa: BLE001 - RayActorError or the actor's own exception, named by index
                raise RuntimeError(f"vLLM rollout actor {i} of {len(self.handles)} failed to {what}: {e}") from e
        return out

    def sync_weights(self, named, dtype: torch.dtype, tied: bool) -> int:
        """(name, tensor) pairs in `dtype` to every actor: one put, each actor loads it. Returns the bytes put."""
        weights = {n: t.detach().to(device="cpu", dtype=dtype) for n, t in named if not (tied and n == "lm_head.weight")}
        ref = self.ray.put(weights)
        self._gather({i: h.load_weights.remote(ref, dtype, tied) for i, h in enumerate(self.handles)},
                     "load the new weights")
        return sum(t.numel() * t.element_size() for t in weights.values())

    def draw(self, prompts: list[list[int]], params: dict, observe: bool = True) -> tuple[list, dict | None]:
        """Like io.draw on one LLM: per prompt its samples, and the actors' proposer counters summed.
        observe: the lengths feed the predictor (sampled rollouts; not greedy evaluations)."""
        units = [Unit(i, 0, params["n"], self.predictor.predict(p)) for i, p in enumerate(prompts)]
        W = len(self.handles)
        plan = (place(units, W, split=False, cost=self.cost, max_seqs=self.max_seqs) if self.placement == "histopipe"
                else static_split(units, W))
        actors = affine(plan, list(range(W)), lambda u: self.last_worker.get(prompt_key(prompts[u.prompt_index])))
        bins = {w: b for w, b in zip(actors, plan) if b}
        t0 = time.perf_counter()
        res = self._gather({w: self.handles[w].draw.remote([prompts[u.prompt_index] for u in b], params)
                            for w, b in bins.items()}, "sample")
        wall = time.perf_counter() - t0
        drawn, self.where, spec, busy = [None] * len(prompts), [-1] * len(prompts), None, {}
        for w, (ds, s, busy[w]) in res.items():
            for u, d in zip(bins[w], ds):
                drawn[u.prompt_index], self.where[u.prompt_index] = d, w
                self.last_worker[prompt_key(prompts[u.prompt_index])] = w
            if s is not None:
                spec = {k: spec[k] + v for k, v in s.items()} if spec is not None else dict(s)
        if observe:
            actual = [sum(len(d.token_ids) for d in ds) / max(len(ds), 1) for ds in drawn]
            self.metrics = {**length_metrics([u.predicted for u in units], actual), **self._busy(busy, wall)}
            for p, ds in zip(prompts, drawn):
                self.predictor.observe(p, None, [len(d.token_ids) for d in ds])
        return drawn, spec

    def _busy(self, busy: dict[int, float], wall: float) -> dict:
        m = {}
        for w in range(len(self.handles)):
            m[f"cluster/busy_s/{w}"] = busy.get(w, 0.0)
            m[f"cluster/idle_s/{w}"] = max(wall - busy.get(w, 0.0), 0.0)
        m["cluster/idle_frac"] = 1 - sum(busy.values()) / (len(self.handles) * wall) if wall else 0.0
        return m

    def prompt_logprobs(self, seq: list[int]) -> list[list[float]]:
        """Each actor's log p of a fixed sequence (vLLM's prompt logprobs), in actor order."""
        out = self._gather({i: h.prompt_logprobs.remote(seq) for i, h in enumerate(self.handles)}, "score")
        return [out[i] for i in range(len(self.handles))]

    def shutdown(self) -> None:
        for h in self.handles:
            try:
                self.ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.handles = []
