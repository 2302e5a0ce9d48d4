"""The cluster driver with in-process workers around a fake engine (tests/cluster_fakes.py): placement,
migration, sibling forwarding and failure recovery leave every sample's tokens and logprobs unchanged."""

import pytest
import torch

from tailrl.cluster.config import ClusterConfig
from tailrl.cluster.reallocate import move
from tailrl.cluster.rollout import ClusterRollout
from tailrl.engine import SamplingParams

from tests.cluster_fakes import CPU, PARAMS, PROMPTS, fake_rollout, spec


def as_tuples(comps):
    return [(c.token_ids, c.logprobs, c.finish_reason) for c in comps]


@pytest.mark.parametrize("placement", ["histopipe", "static"])
@pytest.mark.parametrize("migrate", [False, True])
def test_cluster_equals_single_engine(placement, migrate):
    ref = fake_rollout(PROMPTS, PARAMS)
    cr = ClusterRollout(spec(), 3, ClusterConfig(placement=placement, migrate=migrate, round_steps=2), CPU, local=True)
    comps = cr.generate(PROMPTS, PARAMS)
    assert as_tuples(comps) == ref
    assert [(c.prompt_index, c.sample_index) for c in comps] == [(i, j) for i in range(8) for j in range(4)]
    m = cr.metrics
    assert m["cluster/worker_failures"] == 0 and m["cluster/requeued"] == 0
    assert (m["cluster/migrated"] > 0) == migrate
    assert comps.stats.generated_tokens == sum(len(c.token_ids) for c in comps)


def test_migrated_sequences_keep_their_tokens_and_count_reprefill():
    ref = fake_rollout(PROMPTS[:2], PARAMS[:2])
    # static placement puts both groups on worker 0 and leaves worker 1 idle: it must take running samples
    cr = ClusterRollout(spec(max_num_seqs=8), 2, ClusterConfig(placement="static", round_steps=3), CPU, local=True)
    comps = cr.generate(PROMPTS[:2], PARAMS[:2])
    assert as_tuples(comps) == ref
    assert cr.metrics["cluster/migrated"] > 0 and cr.metrics["cluster/reprefill_tokens"] > 0
    assert cr.pool.workers[1].engine.imported_tokens > 0


@pytest.mark.parametrize("scheduler_order", [False, True])
def test_sequences_moved_in_any_order_keep_their_labels(scheduler_order):
    """The driver pairs a worker's exported states with its own (prompt, sample) keys by position. Engine.export once
    returned them in slot order, not in the order asked: migrated samples came back as other prompts' (a rare
    failure of the Ray test). Moved in an order unlike the worker's, the rollout stays exact; a worker that answers
    in its own order (scheduler_order) is caught by the driver's label check, which stops the rollout."""
    ref = fake_rollout(PROMPTS[:3], PARAMS[:3])
    cr = ClusterRollout(spec(max_num_seqs=12, scheduler_order=scheduler_order), 2,
                        ClusterConfig(placement="static", round_steps=2, migrate=False), CPU, local=True)
    cr.start(PROMPTS[:3], PARAMS[:3])
    cr.step()
    donor = max(cr.held, key=lambda w: len(cr.held[w]))
    running = [s.seq_id for s in cr.pool.workers[donor].engine.scheduler.running]
    ids = sorted(running, key=lambda i: cr.held[donor][i][::-1])[:5]  # by sample, then prompt: not the run order
    assert len(ids) == 5 and ids != [i for i in running if i in ids]
    if scheduler_order:
        with pytest.raises(RuntimeError, match="returned a sequence of prompt"):
            move(cr, donor, 1 - donor, ids)
        return
    move(cr, donor, 1 - donor, ids)
    while cr.step():
        pass
    comps = cr.finish()
    assert cr.metrics["cluster/migrated"] == 5
    assert as_tuples(comps) == ref


def test_history_prediction_improves_with_epochs():
    cr = ClusterRollout(spec(), 2, ClusterConfig(round_steps=4), CPU, local=True, prior_length=10)
    cr.generate(PROMPTS, PARAMS)
    first = cr.metrics["cluster/len_pred_mae"]
    cr.generate(PROMPTS, PARAMS)  # same prompts and seeds: history predicts each group's mean exactly
    assert cr.metrics["cluster/len_pred_mae"] < first
    assert cr.metrics["cluster/len_pred_mae"] == pytest.approx(0.0)
    assert cr.metrics["cluster/len_pred_corr"] == pytest.approx(1.0)
    busy = [cr.metrics[f"cluster/busy_s/{w}"] for w in range(2)]
    assert all(b > 0 for b in busy)


def test_split_groups_forward_sibling_tokens():
    prompts, params = [[50, 1]], [SamplingParams(n=4, max_tokens=48, seed=7)]
    ref = fake_rollout(prompts, params)
    cr = ClusterRollout(spec(), 2, ClusterConfig(round_steps=2, migrate=False), CPU, local=True)
    comps = cr.generate(prompts, params)
    assert as_tuples(comps) == ref
    assert cr.metrics["cluster/remote_tokens"] > 0
    held = {w: {(0, j) for j in range(4)} - set(cr.pool.workers[w].engine.speculator.drafters["history"].remote)
            for w in range(2)}
    assert held[0] and held[1]  # the group was divided between the two workers
    for w in range(2):
        for key, toks in cr.pool.workers[w].engine.speculator.drafters["history"].remote.items():
            assert key not in held[w] or not toks
            assert toks == comps[key[1]].token_ids[: len(toks)]  # siblings' tokens, in order, no duplicates


def test_a_failing_worker_is_rerun_elsewhere_and_restarted():
    ref = fake_rollout(PROMPTS, PARAMS)
    cr = ClusterRollout(spec(), 2, ClusterConfig(round_steps=2), CPU, local=True)
    cr.sync_weights({"weight": torch.zeros(2, 2)})
    cr.start(PROMPTS, PARAMS)
    for _ in range(3):
        cr.step()

    def boom():
        raise RuntimeError("worker lost")

    cr.pool.workers[1].engine.step = boom
    while cr.step():
        pass
    comps = cr.finish()
    assert as_tuples(comps) == ref
    assert cr.metrics["cluster/worker_failures"] == 1 and cr.metrics["cluster/requeued"] > 0
    assert 1 in cr.pool.dead
    # the next step restarts the worker with the current weights; new weights change the fake's tokens
    cr.sync_weights({"weight": torch.ones(2, 2)})
    comps = cr.generate(PROMPTS, PARAMS)
    assert not cr.pool.dead and cr.metrics["cluster/worker_failures"] == 0
    assert as_tuples(comps) != ref and all(float(w.engine.model.weight.sum()) == 4 for w in cr.pool.workers)


def test_unseeded_requests_get_driver_seeds():
    params = [SamplingParams(n=2, max_tokens=16) for _ in PROMPTS]
    cr = ClusterRollout(spec(), 2, ClusterConfig(round_steps=2), CPU, local=True, seed=3)
    comps = cr.generate(PROMPTS, params)
    seeded = [SamplingParams(n=2, max_tokens=16, seed=p.seed) for p in cr.params]
    assert as_tuples(comps) == fake_rollout(PROMPTS, seeded)


def test_a_worker_failing_while_taking_requeued_work_loses_nothing():
    ref = fake_rollout(PROMPTS, PARAMS)
    cr = ClusterRollout(spec(), 3, ClusterConfig(round_steps=2, migrate=False), CPU, local=True)
    cr.start(PROMPTS, PARAMS)
    cr.step()

    def boom(*_):
        raise RuntimeError("worker lost")

    cr.pool.workers[0].engine.step = boom  # worker 0 dies in the next round ...
    cr.pool.workers[1].engine.add_requests = boom  # ... and worker 1 dies taking its samples
    while cr.step():
        pass
    assert as_tuples(cr.finish()) == ref
    assert cr.metrics["cluster/worker_failures"] == 2
