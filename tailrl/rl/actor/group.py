"""`trainer.world_size=N`: the actor as N ranks, Ray actors in a placement group (one GPU each where the cluster
has GPUs, else one CPU), in one torch.distributed group (NCCL on GPUs, gloo on CPU), as verl and OpenRLHF start
theirs; `cluster.address` joins a multi-node Ray cluster as rollout workers do. The driver (this process) holds
the rollout and the rewards, and calls every rank's method with the same arguments (`_all`); rank 0 answers
(metrics, the stream of weights), the others follow the same collectives.

Invariants:
- A rank that dies or hangs stops the run within `trainer.collective_timeout_s` (the process group's timeout,
  and the driver's wait on the ranks), with a `RankFailed` naming the rank, the step and the latest checkpoint;
  every rank is then killed, so nothing is left running.
- Weights go to the engine a layer at a time, in the engine's dtype (bf16 in production): rank 0 yields each
  layer as it is gathered (Ray's object store), the driver copies it into the engine's model; nobody stages a
  full fp32 copy (fsdp.full_layers)."""

from __future__ import annotations

import os
import random
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch

from ...config import Config

FAULT: tuple | None = None  # tests only: (rank, step, "exit" | "hang"), injected into that rank's update


class RankFailed(RuntimeError):
    def __init__(self, rank: int, why: str, what: str, latest: str | None):
        super().__init__(f"trainer rank {rank} {why} during {what}; the latest checkpoint is {latest or 'none'} "
                         f"(resume from it with trainer.resume=true)")
        self.rank, self.latest = rank, latest


class ActorRank:
    """One trainer rank: an Actor (actor.py) in its own process."""

    def __init__(self, cfg: Config, rank: int, world: int, threads: int):
        torch.set_num_threads(threads)
        self.cfg, self.rank, self.world = cfg, rank, world
        self.actor = None

    def address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, addr: str, port: int, rollout_dtype: str) -> dict:
        import torch.distributed as dist

        from .actor import Actor, device_of
        from .ranks import Ranks

        cuda = device_of(self.cfg) == "cuda"
        if cuda:
            torch.cuda.set_device(0)  # Ray gives each rank one GPU (CUDA_VISIBLE_DEVICES)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{addr}:{port}", rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=self.cfg.trainer.collective_timeout_s))
        random.seed(self.cfg.trainer.seed)
        torch.manual_seed(self.cfg.trainer.seed)
        self.actor = Actor(self.cfg, getattr(torch, rollout_dtype), Ranks(self.rank, self.world))
        return {"mode": self.actor.mode, "tied": self.actor.tied, "shapes": self.actor.shapes()}

    def update(self, batch, advantages, step: int, fault) -> tuple[dict, str | None, dict]:
        if fault is not None and fault[0] == self.rank and fault[1] == step:
            if fault[2] == "exit":
                os._exit(1)
            time.sleep(10**6)
        timing: dict = {}
        metrics, reason = self.actor.update(batch, advantages, step, timing)
        mem = self.actor.memory()
        metrics["actor/param_bytes_per_rank"], metrics["actor/optimizer_bytes_per_rank"] = mem["params"], mem["optimizer"]
        return metrics, reason, timing

    def stream(self, dtype: str | None, adapted_only: bool = False):
        """Rank 0 yields {name: full tensor} a layer at a time; the other ranks take part in each gather."""
        for layer in self.actor.layers(getattr(torch, dtype) if dtype else None, adapted_only):
            if self.rank == 0:
                yield layer

    def call(self, method: str, *args):
        return getattr(self.actor, method)(*args)

    def export(self, folder: str, final: bool) -> None:
        """Sharded state into folder/dcp, and the HF export a layer at a time into folder/model (rank 0 writes); with
        LoRA, the adapters' shards (and moments) into folder/dcp and the adapter in PEFT's format into folder/model."""
        folder = Path(folder)
        self.actor.save_sharded(folder / "dcp", final)
        self.actor.write_model(folder, final)  # every rank gathers, rank 0 writes (full_weights.py, lora_weights.py)


class ActorGroup:
    """The driver's handle on N ranks, with the Actor's methods (the step loop does not know which it has)."""

    def __init__(self, cfg: Config, rollout_dtype: torch.dtype):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ...cluster.workers import start_ray

        self.cfg, self.world = cfg, cfg.trainer.world_size
        self.timeout = cfg.trainer.collective_timeout_s
        self.step, self.what = 0, "start-up"
        start_ray(cfg.cluster.address)
        self.ray = ray
        gpus = ray.cluster_resources().get("GPU", 0) >= self.world and cfg.model.device in (None, "cuda")
        bundle = {"GPU": 1, "CPU": 1} if gpus else {"CPU": 1}
        self.pg = placement_group([bundle] * self.world, strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=self.timeout)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            raise RuntimeError(f"trainer.world_size={self.world} needs {self.world} x {bundle} and Ray has "
                               f"{ray.available_resources()} free: lower trainer.world_size or rollout.workers")
        threads = max(1, (os.cpu_count() or 1) // self.world) if not gpus else 1
        cls = ray.remote(ActorRank)
        self.ranks = [cls.options(num_cpus=1, num_gpus=1 if gpus else 0, max_restarts=0, max_concurrency=1,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, i)).remote(
                                      cfg, i, self.world, threads) for i in range(self.world)]
        addr, port = self._all("address", ranks=[0])[0]
        info = self._all("setup", addr, port, str(rollout_dtype).removeprefix("torch."))[0]
        self.mode, self.tied, self._shapes = info["mode"], info["tied"], info["shapes"]

    # ---- calls on every rank, failures named -------------------------------------------------------------

    def _latest(self) -> str | None:
        from ..checkpoint.store import latest_name

        return latest_name(Path(self.cfg.trainer.out_dir) / "checkpoints")

    def _wait(self, refs: list) -> list:
        """Every rank's answer, or RankFailed naming the first rank that died, else one that hung, else raised."""
        ray = self.ray
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout + 10)
        out, died, raised = [], [], []
        for i, ref in enumerate(refs):
            if ref not in ready:
                continue
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                died.append(i)
            except Exception as e:  # noqa: BLE001 - a rank's error: reported below
                raised.append((i, e))
        hung = [i for i, ref in enumerate(refs) if ref not in ready]
        if died or hung or raised:
            self.close()
            what = f"{self.what} of step {self.step + 1}" if self.what != "start-up" else "start-up"
            if died:
                raise RankFailed(died[0], "died (its process exited)", what, self._latest())
            if hung:
                raise RankFailed(hung[0], f"did not answer within trainer.collective_timeout_s={self.timeout:g} s",
                                 what, self._latest())
            i, e = raised[0]
            last = next((x for x in reversed(str(e).strip().splitlines()) if x.strip()), "")  # the rank's own error
            raise RankFailed(i, f"failed ({last.strip()[:300]})", what, self._latest()) from e
        return out

    def _all(self, method: str, *args, ranks: list[int] | None = None) -> list:
        ids = range(self.world) if ranks is None else ranks
        return self._wait([getattr(self.ranks[i], method).remote(*args) for i in ids])

    # ---- the Actor's methods ---------------------------------------------------------------------------

    def update(self, batch, advantages: torch.Tensor, step: int, timing: dict) -> tuple[dict, str | None]:
        self.step, self.what = step, "the update"
        b, a = self.ray.put(batch), self.ray.put(advantages)
        metrics, reason, rank_timing = self._all("update", b, a, step, FAULT)[0]
        timing.update(rank_timing)
        return metrics, reason

    def layers(self, dtype: torch.dtype | None, adapted_only: bool = False):
        """{name: full tensor} a layer at a time, as rank 0 gathers them (the other ranks gather with it)."""
        self.what = "the weight sync"
        name = str(dtype).removeprefix("torch.") if dtype is not None else None
        gen = self.ranks[0].stream.options(num_returns="streaming").remote(name, adapted_only)
        others = [r.stream.options(num_returns="streaming").remote(name, adapted_only) for r in self.ranks[1:]]
        while True:
            ready, _ = self.ray.wait([gen], timeout=self.timeout + 10)
            if not ready:
                self._wait([gen.completed()] + [g.completed() for g in others])
            try:
                ref = next(gen)
            except StopIteration:
                break
            try:
                yield self.ray.get(ref)
            except Exception:  # noqa: BLE001 - which rank: _wait names it
                self._wait([gen.completed()] + [g.completed() for g in others])
                raise
        self._wait([g.completed() for g in others])

    def weights(self) -> dict:
        return {n: t for layer in self.layers(None) for n, t in layer.items()}

    def sync_to(self, rollout) -> int:
        """Streams the new weights into the rollout's engine (its dtype); returns the bytes moved. LoRA into our
        engine (which loaded the base itself): the merged adapted layers alone, as at one rank (lora.merge_into);
        into vLLM every tensor."""
        dtype, adapted_only = rollout.dtype, bool(self.cfg.actor.lora.rank) and not rollout.streams_policy
        return rollout.load_weights((n, t) for layer in self.layers(dtype, adapted_only) for n, t in layer.items())

    def shapes(self, dcp: bool = False) -> dict:
        """Actor.shapes's, from rank 0."""
        from .lora_io import module_names

        return module_names(self._shapes) if dcp else self._shapes

    def non_finite(self) -> list[str]:
        self.what = "the checkpoint"
        return self._all("call", "non_finite")[0]

    def write_model(self, folder: Path, final: bool) -> None:
        self.what = "the checkpoint"
        self._all("export", str(folder), final)

    def optimizer_state(self, final: bool) -> None:
        return None  # in the sharded checkpoint (dcp/)

    def load_sharded(self, folder: Path) -> bool:
        self.what = "the resume"
        return self._all("call", "load_sharded", str(folder))[0]

    def load(self, model_sd: dict, optimizer_sd: dict | None) -> None:
        if self.cfg.actor.lora.rank:  # a LoRA run's adapter and moments are small: every rank takes them whole
            self.what = "the resume"
            self._all("call", "load", model_sd, optimizer_sd)
            return
        raise ValueError("this checkpoint was written by a one-process trainer (trainer.world_size=1): resume it at "
                         "world_size=1; checkpoints written at world_size > 1 resume at any world size")

    def close(self) -> None:
        for r in getattr(self, "ranks", []):
            try:
                self.ray.kill(r, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.ranks = []
        if getattr(self, "pg", None) is not None:
            try:
                self.ray.util.remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
            self.pg = None
