"""The rollout role: the in-process engine or the Ray rollout workers (ray_cluster.py), the speculator and the
learned drafter (its head drafts in the engine; its trainer learns on idle capacity, TLT's spot trainer).

It takes the policy's weights by name (`load_weights`: a stream of (name, tensor) pairs, each copied into the
engine's model as it arrives), so it never knows whether the actor is one process or N sharded ranks.

Invariant: rollout seeds depend only on (run seed, step, prompt), so a resumed run, N rollout workers and N
trainer ranks all sample what the one-process run samples from the same weights."""

from __future__ import annotations

import dataclasses
import time

import torch

from ..config import Config
from ..drafter.compose import make_speculator
from ..drafter.eagle import EagleDrafter, load_drafter
from ..drafter.propose import LearnedDrafter
from ..drafter.train import DrafterTrainer, SpotLender, SpotTrainer
from ..engine import Engine, EngineConfig, SamplingParams
from ..engine.tail import tail_metrics
from .base import make_requests, requests_of
from .ray_cluster import cluster_rollout, make_cluster
from .ray_worker import head_state, merge_heads
from .turns import TurnLoop, seq_lens
from .weights import push_weights


def build_drafter(cfg: Config, target):
    """The learned drafter: the engine's head (drafts), a trainer with its own copy (online training when
    drafter.spot is on; otherwise the head stays as loaded: a frozen drafter)."""
    d = cfg.drafter
    if not (d.enabled or d.path):
        return None, None, None
    # target: the engine's model; the head drafts inside the engine, on its hidden states and in its dtype
    if d.path:
        head = load_drafter(d.path, target)
    else:
        head = EagleDrafter(target.config).to(device=target.device, dtype=target.dtype).bind(target)
    trainer = DrafterTrainer(head, d, seed=cfg.trainer.seed) if d.spot else None
    spot = SpotTrainer(trainer, d) if trainer is not None else None
    return head, trainer, spot


def make_rollout(cfg: Config, engine_model: torch.nn.Module, tokenizer):
    """The rollout of rollout.backend: ours (EngineRollout) or vLLM's (vllm/rollout.py, imported only then)."""
    if cfg.rollout.backend == "vllm":
        from .vllm.rollout import VllmRollout

        return VllmRollout(cfg, engine_model, tokenizer)
    return EngineRollout(cfg, engine_model, tokenizer)


class EngineRollout:
    """The `Rollout` (base.py) on our engine: in process, or on Ray rollout workers with rollout.workers > 1."""

    version = "tailrl engine"
    streams_policy = False  # at world size 1 the engine runs the policy or its compute copy: nothing to send

    def __init__(self, cfg: Config, engine_model: torch.nn.Module, tokenizer):
        self.cfg = cfg
        r = cfg.rollout
        self.head, self.drafter_trainer, self.spot = build_drafter(cfg, engine_model)
        self.lender = None
        if self.spot is not None:
            self.lender = SpotLender(self.spot, self.drafter_trainer.buffer, cfg.drafter)
        self.engine = Engine(engine_model, tokenizer, EngineConfig(
            kv_cache_gb=r.kv_cache_gb, max_num_seqs=r.max_num_seqs, seed=cfg.trainer.seed, spec=r.spec,
            cuda_graphs=r.cuda_graphs, batch_invariant=r.batch_invariant, prefix_cache=r.prefix_cache,
            max_model_len=min(cfg.data.max_prompt_tokens + r.max_tokens, engine_model.config.max_position_embeddings)),
            make_speculator(r.spec, LearnedDrafter(self.head, cfg.drafter) if self.head is not None else None))
        self.cluster = make_cluster(cfg, self.engine.config)  # rollout.workers > 1: Ray rollout workers
        self.loop = TurnLoop(cfg.agent, tokenizer)  # the turn loop (turns.py) drives the engine, tools or none
        self.agent = self.loop.turns  # agent.tools: a trajectory's turns (tool_turns.py); None: single-turn
        self._metrics: dict = {}  # the last rollout's (metrics())

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.model.dtype

    @property
    def batch_invariant(self) -> bool:
        return self.engine.runner.invariant  # the start-up probe's verdict (engine/probe.py)

    @property
    def spec_note(self) -> str:
        r = self.cfg.rollout
        return (r.spec.mode + (" + learned drafter" if self.head is not None else "")
                + (f", {r.workers} Ray workers" if r.workers > 1 else ""))

    def encode(self, prompt) -> list[int]:
        if self.agent is not None and isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.loop.encode_prompt(prompt)  # hermes: the tools' schemas in the prompt
        return self.engine.encode(prompt)

    def progress(self) -> tuple[int, int]:
        return self.engine.last_stats.generated_tokens, self.engine.num_running + self.engine.num_waiting

    def metrics(self) -> dict:
        return dict(self._metrics)

    @property
    def _colocated(self) -> bool:  # the update shares the device: the KV cache and graphs give it room
        return self.engine.model.device.type == "cuda"

    def sleep(self) -> None:
        if self._colocated:
            self.engine.sleep()

    def wake(self) -> None:
        if self._colocated:
            self.engine.wake()

    @property
    def history(self):
        """The engine's history drafter (its index is part of checkpoints), or None."""
        spec = self.engine.speculator
        return spec.drafters.get("history") if spec is not None else None

    def close(self) -> None:
        self.loop.close()
        if self.cluster is not None:
            self.cluster.shutdown()
        if self.spot is not None:
            self.spot.close()

    def generate(self, examples: list, step: int, weights, last_step_s: float, gen_round: int = 0):
        """One step's samples, rollout.n per prompt, in (prompt, sample) order. weights(): the policy's state by
        name, called only with Ray workers (they take this step's weights before the rollout)."""
        reqs = self._requests(examples, step, gen_round)
        params = [q.params for q in reqs]
        if self.cluster is not None and self.agent is not None:  # each worker runs its prompts' trajectories
            return self._cluster_agent_rollout(reqs, weights)
        if self.cluster is not None:  # this step's weights (and drafter head) to the workers, then their rollout
            comps, cluster = cluster_rollout(self.cluster, weights(), [q.ids for q in reqs], params, head=self.head)
            self._metrics = {**self._rollout_metrics(comps.stats), **cluster}
            return comps
        return self._run(reqs, step, last_step_s).completions

    def _requests(self, examples: list, step: int, gen_round: int = 0, greedy: bool = False) -> list:
        c = self.cfg
        return make_requests(examples, c.rollout, c.trainer.seed, step, gen_round, greedy, c.data.system_prompt)

    def _cluster_agent_rollout(self, reqs: list, weights=None):
        """Multi-turn trajectories on the Ray workers (remote_partial.py): this step's weights first (none for the
        eval, which runs on the weights the last step synced), then the driver's rounds until every trajectory has
        ended, idle workers taking trajectories from loaded ones (cluster.migrate)."""
        from .remote_partial import cluster_tool_rollout

        t = time.perf_counter()
        sync_s = self.cluster.sync_weights(weights()) if weights is not None else 0.0
        self.cluster.revive()
        comps, agent = cluster_tool_rollout(self.cluster, self.cfg.agent, reqs)
        self.engine.last_stats = comps.stats
        self._metrics = {**self._rollout_metrics(comps.stats), **agent, "timing_s/sync": sync_s,
                         "timing_s/cluster_rollout": time.perf_counter() - t}
        return comps

    def generate_partial(self, prompts: list, params: list, labels: list[int], states: list, step: int,
                         last_step_s: float, done, weights=None,
                         messages: dict | None = None) -> tuple[list, list, list]:
        """A partial rollout (rollout/partial.py): continues `states` (carried responses, re-prefilled under the weights
        the engine holds now, first in the queue) and starts `prompts` (token ids, their params, group labels);
        `done(finished, running)` is told of each engine step's finished responses and, on demand, (label, sample,
        tokens so far) of the unfinished ones, and returns True once the rollout may stop (rollout/partial.py's Horizon). Returns (the finished completions, the unfinished responses exported as states, the (label,
        sample) keys of responses lost with a failed Ray worker, which restart). weights(): as for generate.
        With agent.tools the responses are trajectories (rollout/tool_partial.py): messages[label] is each prompt's
        chat conversation, the clock counts the model's tokens, and the rollout cuts its trajectories where done
        (a Horizon) stops: done.limit(key)."""
        if self.cluster is not None and self.agent is not None:
            return self._cluster_tool_partial(prompts, params, labels, states, done, weights, messages)
        if self.cluster is not None:
            return self._cluster_partial(prompts, params, labels, states, done, weights)
        if self.agent is None:
            reqs = requests_of(prompts, params, labels=labels)
            out = self._run(reqs, step, last_step_s, lambda fin: done(fin, self._unfinished), states)
            return out.completions, out.left, []
        reqs = requests_of(prompts, params, [messages[i] for i in labels], labels)

        def running():  # (label, sample, drawn tokens so far) of every unfinished trajectory
            return self.agent.running(seq_lens(self.engine))

        out = self._run(reqs, step, last_step_s, lambda fin: done(fin, running), states,
                        messages=[messages[st.prompt_index] for st in states], limit=getattr(done, "limit", None))
        return out.completions, out.left, []

    def _cluster_partial(self, prompts, params, labels, states, done, weights):
        """The partial rollout on Ray workers: this step's weights first, then the driver's rounds until `done`;
        keys come back as (label, sample) like the engine's."""
        from ..cluster.partial import partial_rollout

        t = time.perf_counter()
        c = self.cluster
        sync_s = c.sync_weights(weights(), head_state(self.head) if self.head is not None else None)
        slot_label = list(labels) + [st.prompt_index for st in states]

        def relabel(x):
            return dataclasses.replace(x, prompt_index=slot_label[x.prompt_index])

        comps, left, lost = partial_rollout(c, prompts, params, states, lambda fin, running: done(
            [relabel(x) for x in fin], lambda: [(slot_label[i], j, n) for i, j, n in running()]))
        metrics = {k: v for k, v in c.metrics.items() if isinstance(v, (int, float))}
        if self.head is not None:
            metrics["drafter/idle_train_steps"] = merge_heads(self.head, c.idle_states)
            self.head.sync_head()
        metrics.update({"timing_s/sync": sync_s, "timing_s/cluster_rollout": time.perf_counter() - t})
        self._metrics = {**self._rollout_metrics(comps.stats), **metrics}
        return [relabel(x) for x in comps], [relabel(x) for x in left], [(slot_label[i], j) for i, j in lost]

    def _cluster_tool_partial(self, prompts, params, labels, states, done, weights, messages):
        """The partial rollout with tools on Ray workers (remote_partial.py): this step's weights first (a worker
        that failed in the last step comes back with them), then the driver's rounds until `done` stops it."""
        from .remote_partial import cluster_tool_partial

        t = time.perf_counter()
        c = self.cluster
        sync_s = c.sync_weights(weights()) if weights is not None else 0.0
        c.revive()
        reqs = requests_of(prompts, params, [messages[i] for i in labels], labels)
        comps, left, lost, metrics = cluster_tool_partial(c, self.cfg.agent, reqs, states, messages, done)
        self.engine.last_stats = comps.stats
        self._metrics = {**self._rollout_metrics(comps.stats), **metrics, "timing_s/sync": sync_s,
                         "timing_s/cluster_rollout": time.perf_counter() - t}
        return comps, left, lost

    def start_state(self, label: int, j: int, prompt_ids: list[int], params: SamplingParams, seed: int):
        """A response not yet begun, as a state this engine continues (its stop tokens and context limit applied as
        for the engine's own groups): partial rollouts restart responses from these."""
        from ..engine.requests import SeqState

        stop = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.engine.eos_ids)))
        max_tokens = min(params.max_tokens, self.engine.max_model_len - len(prompt_ids))
        return SeqState(label, j, list(prompt_ids), [], [], dataclasses.replace(params, n=1), seed, max_tokens, stop)

    def _run(self, reqs: list, step: int | None, last_step_s: float = 0.0, done=None, states: list | None = None,
             record: bool = True, **carry):
        """The turn loop (turns.py) over the engine, single-turn or with tools; between steps the lender feeds the
        drafter buffer and lends threads in the long tail (step None: no lending, the evaluation). done and states:
        a partial rollout's (turns.py); carry: with tools, its messages and limit. record: this rollout's metrics
        become metrics()'s. Returns the TurnsOut."""
        n_seqs = sum(q.params.n for q in reqs) + len(states or [])
        lend = self.lender is not None and step is not None
        if lend:
            self.drafter_trainer.model.sync_head()
            self.lender.begin_step(step, last_step_s, n_seqs=n_seqs)
        on_step = (lambda out: self.lender.on_engine_step(self.engine.num_running, out.finished)) if lend else None
        try:
            out = self.loop.run(self.engine, reqs, on_step, done, states, **carry)
        finally:
            if lend:
                self.lender.stop()
        self.engine.end_rollout(out.completions.stats)
        if record:  # the rollout's tail metrics (tail.py) come from its step records; the stats' SD-off estimate
            # (the rollout's own plain schedule, off_estimate.off_seconds) wins over tail.py's per-step one
            self._metrics = {**tail_metrics(out.records, n_seqs), **self._rollout_metrics(out.completions.stats),
                             **out.metrics}
        return out

    def _unfinished(self) -> list[tuple[int, int, int]]:
        """(label, sample, tokens so far) of the engine's running and waiting sequences."""
        return [(s.prompt_index, s.sample_index, len(s.output_ids)) for s in self._seqs()]

    def _seqs(self) -> list:
        sched = self.engine.scheduler
        return [*sched.running, *(s for g in sched.waiting for s in g)]

    def _rollout_metrics(self, stats) -> dict:
        return {"rollout/batch_invariant": float(self.batch_invariant), "perf/gen_tokens_per_s": stats.tokens_per_s,
                **stats.metrics()}

    def greedy(self, examples: list) -> list:
        """Greedy completions of examples (evaluation), rejected ones left out."""
        reqs = self._requests(examples, 0, greedy=True)
        comps = self._run(reqs, None, record=self.agent is not None).completions
        return [c for c in comps if c.finish_reason != "error"]

    def load_policy(self, policy: torch.nn.Module) -> int:
        """The master's weights in process, cast to the engine's dtype; returns the bytes copied (0 when the engine
        runs that very module)."""
        if self.engine.model is policy:
            return 0
        push_weights(policy, self.engine.model)
        return sum(t.numel() * t.element_size() for t in self.engine.model.state_dict().values())

    def load_weights(self, named) -> int:
        """Streamed weights: (name, tensor) pairs, each copied into the engine model's tensor of that name as it
        arrives (a name the engine lacks is an error naming it). Returns the bytes received."""
        dst, got = self.engine.model.state_dict(), 0
        with torch.no_grad():
            for name, t in named:
                if name not in dst:
                    raise ValueError(f"streamed weight {name!r} is not a parameter of the engine's model")
                d = dst[name]
                if d.shape != t.shape:
                    raise ValueError(f"streamed weight {name}: shape {tuple(t.shape)}, engine shape {tuple(d.shape)}")
                d.copy_(t.to(dtype=d.dtype, device=d.device))
                got += t.numel() * t.element_size()
        return got

    def drafter_sync(self) -> dict:
        """Between steps: the trained head's weights (and, once known, its draft vocabulary) go to the engine,
        and both heads re-read the policy's new LM head rows."""
        if self.head is None:
            return {}
        if self.drafter_trainer is None or self.cluster is not None:  # with workers: merged in cluster_rollout
            self.head.sync_head()
            return {}
        tr = self.drafter_trainer
        tr.maybe_set_vocab(None, self.engine.model.config.eos_token_id)
        tr.publish(self.head)
        m = {"drafter/train_steps": tr.steps, "drafter/spot_steps": self.spot.steps_this_rl_step,
             "drafter/spot_s": self.spot.used_s, "drafter/buffer_tokens": tr.buffer.tokens}
        m.update({k: v for k, v in tr.last.items() if k.startswith("drafter/")})
        return m

    def state(self) -> dict:
        """What checkpoints keep of the rollout: the history index and the drafter trainer's state."""
        return {"history": self.history.state_dict() if self.history is not None else None,
                "drafter": self.drafter_trainer.state_dict() if self.drafter_trainer is not None else None}

    def load_state(self, state: dict, drafter) -> None:
        """state: a checkpoint's trainer state; drafter: its saved head (or None)."""
        if self.history is not None:  # exactly the checkpoint's index: none if its run kept none (SD off)
            self.history.load_state_dict(state.get("history") or {"prompts": []})
        if self.head is not None and drafter is not None:
            self.head.set_vocab(drafter.vocab)
            self.head.load_trained(drafter.trained_state())
            self.head.sync_head()
        if state.get("drafter") is not None and self.drafter_trainer is not None:
            self.drafter_trainer.load_state_dict(state["drafter"])
