"""The CUDA-graph pool (TLT): padded decode and verify forwards captured per bucket and replayed.

On a GPU a small model's decode step is bound by kernel launches and Python; one replay launches the whole
forward. Graphs are captured lazily, the first time a bucket (engine/buckets.py) runs, while the pool holds
less than its memory budget (so it may overshoot by one graph); a bucket past it runs eagerly.

Invariants:
- a graph holds the addresses of the KV cache storage, of its StaticBatch's inputs and of its outputs. The
  batches live as long as the runner; the cache's storage is stable within one `KVCache.generation`, and the
  pool drops every graph when the generation changes (a re-layout).
- weights are read at their addresses too: updates must copy in place (rollout/weights.py push_weights does), and
  a model whose parameters are replaced needs a new pool.
- all graphs share one memory pool, so a replay's outputs (and any graph's temporaries) are valid only until
  the next replay: the runner copies out the real rows at once.
- a capture runs the pass once eagerly first (kernels pick their algorithms outside the capture) and replays
  once after: both write the same K/V values at the same positions, so the pass is idempotent."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from .buckets import Bucket, StaticBatch

log = logging.getLogger(__name__)


class GraphPool:
    def __init__(self, device: torch.device, budget_bytes: int):
        self.device, self.budget = torch.device(device), budget_bytes
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        self.generation = -1
        self.pool = None
        self.bytes = 0  # device memory the captures took (graphs, their pool, first-capture output buffers)
        self.capture_s = 0.0
        self.declined = 0  # passes run eagerly because the budget was spent
        self.last_capture_s = 0.0  # the capture time inside the last `run` (0 when it only replayed)

    def clear(self) -> None:
        self.graphs.clear()
        self.pool, self.bytes = None, 0

    def run(self, bucket: Bucket, batch: StaticBatch, fn: Callable, generation: int):
        """Replays (capturing first if need be) the bucket's graph of fn over the batch's current inputs. Returns
        the batch's outputs, or None when the budget is spent and the caller must run the pass eagerly."""
        if generation != self.generation:
            self.clear()
            self.generation = generation
        self.last_capture_s = 0.0
        graph = self.graphs.get(bucket)
        if graph is None:
            if self.bytes >= self.budget:
                self.declined += 1
                return None
            graph = self._capture(bucket, batch, fn)
        graph.replay()
        return batch.outputs

    def _capture(self, bucket: Bucket, batch: StaticBatch, fn: Callable) -> torch.cuda.CUDAGraph:
        dev = self.device
        torch.cuda.synchronize(dev)
        free0, t0 = torch.cuda.mem_get_info(dev)[0], time.perf_counter()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            warm = fn()
        torch.cuda.current_stream(dev).wait_stream(side)
        if batch.outputs is None:
            batch.outputs = tuple(None if o is None else torch.empty_like(o) for o in warm)
        del warm
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            for dst, out in zip(batch.outputs, fn()):
                if dst is not None:
                    dst.copy_(out)
        torch.cuda.synchronize(dev)
        took, used = time.perf_counter() - t0, max(free0 - torch.cuda.mem_get_info(dev)[0], 0)
        self.graphs[bucket] = graph
        self.bytes += used
        self.capture_s += took
        self.last_capture_s = took
        log.info("CUDA graph %s captured in %.2f s, %.1f MiB (pool: %d graphs, %.1f MiB, %.2f s capturing)",
                 bucket, took, used / 2**20, len(self.graphs), self.bytes / 2**20, self.capture_s)
        return graph

    def summary(self) -> dict:
        return {"cuda_graphs": len(self.graphs), "cuda_graph_mb": self.bytes / 2**20,
                "cuda_graph_capture_s": self.capture_s, "cuda_graph_declined": self.declined}
