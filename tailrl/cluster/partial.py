"""Partial rollouts on the workers (rollout/partial.py): a `ClusterRollout` continues the sequences a step carried,
ahead of the new prompts, runs rounds until the step's horizon is known, and hands back the unfinished ones.

Invariant: a carried sequence keeps its own slot (n = 1, its seed), so the driver's label checks hold for it, and a
worker that fails while holding it re-imports it from its carried state (ClusterRollout._requeue), never from its
prompt."""

from __future__ import annotations

import dataclasses
import logging

from ..engine import Completions
from .pool import WorkerFailed
from .rollout import ClusterRollout, Sample

log = logging.getLogger(__name__)


def partial_rollout(cr: ClusterRollout, prompts: list, sampling: list, carried: list,
                    done) -> tuple[Completions, list, list]:
    """A partial rollout (rollout/partial.py): `carried` states continue, `prompts` start, and rounds run until
    `done(finished, running)` says the step has enough: finished, the round's new completions (labelled by their
    key); running(), (slot, sample, tokens so far) of every unfinished sample. Returns
    (the finished completions, the unfinished sequences exported as states, the keys of those lost with a
    failed worker: their tokens are gone, they restart)."""
    cr.start(prompts, sampling, None, lambda: continue_carried(cr, carried))
    told: set = set()
    while True:
        more = cr.step()
        fresh = [k for k in cr.done if k not in told]
        told.update(fresh)
        running = lambda: [(i, j, len(cr.samples[(i, j)].tokens)) for w in cr._live()  # noqa: E731
                           for i, j in cr.held[w].values()]
        if done([cr.done[k] for k in fresh], running) or not more:
            break
    left, lost = [], []
    for w in cr._live():
        ids = list(cr.held[w])
        if not ids:
            continue
        try:
            states = cr.pool.call(w, "export", ids, timeout=cr.cfg.step_timeout_s)
        except WorkerFailed as e:  # the pool marks it dead; it restarts at the next step
            cr.counts["cluster/worker_failures"] += 1
            log.warning("worker %d failed handing back its %d unfinished samples (%s): they restart", w, len(ids), e)
            lost += list(cr.held[w].values())
            cr.held[w] = {}
            continue
        for i, st in zip(ids, states):
            key = cr.held[w].pop(i)
            cr._check_label(w, key, st.prompt_index, st.prompt_ids, st.seed)
            left.append(dataclasses.replace(st, prompt_index=key[0], sample_index=key[1]))
    return cr.finish(partial=True), left, lost


def continue_carried(cr: ClusterRollout, states: list) -> None:
    """Carried sequences, each its own prompt slot (n = 1, its seed), to the workers holding the fewest."""
    by_worker: dict[int, list] = {}
    for st in states:
        i = len(cr.prompts)
        cr.prompts.append(list(st.prompt_ids))
        cr.tasks.append(None)
        cr.params.append(dataclasses.replace(st.params, n=1, seed=st.seed - st.sample_index))
        cr.predicted.append(cr.predictor.predict(cr.prompts[i], None))
        cr.prompt_ids[i] = list(st.prompt_ids)
        key = (i, st.sample_index)
        cr.samples[key] = Sample(i, st.sample_index, tokens=list(st.output_ids))
        w = min(cr._live(), key=lambda v: (len(by_worker.get(v, [])), v))
        cr.carried[key] = dataclasses.replace(st, prompt_index=i)
        by_worker.setdefault(w, []).append((key, cr.carried[key]))
    cr._import(by_worker)

