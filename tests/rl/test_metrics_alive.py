"""A short training run logs no metric that is stuck at zero where it should move (issue 54: perf/gen_tokens_per_s
read 0.0 at every step of every run on our engine, because the rollout's statistics were read before the collector
set their wall time). A metric may be zero at every step only for a reason listed in MAY_BE_ZERO."""

import json

import pytest

from tailrl.engine.tail import tail_size
from tailrl.rl.run import train
from tests.rl_helpers import tiny_cfg

pytestmark = pytest.mark.slow

MAY_BE_ZERO = {
    "actor/kl": "algo.kl_coef is 0: no reference model, no KL term",
    "reward/errors": "fault counter", "reward/invalid": "fault counter", "reward/timeouts": "fault counter",
    "rollout/rejected": "fault counter", "rollout/preemptions": "fault counter (the KV cache is large enough)",
    "train/skipped_steps": "fault counter",
    "rollout/filtered_groups": "dynamic sampling is off",
    "sync/bytes": "at world size 1 the engine runs the actor's own module: no bytes are copied",
    "eval/accuracy": "the tiny model's greedy answers are never right",
    "eval/reward": "the tiny model's greedy answers hold no 'a'",
    "spec/probe_share": "probes run every 8-64 decode steps of a batch-size bucket, one of an arm far below plain "
                        "decoding every 64 (speculative/selector.py): 3 steps of 12-token responses may hold none",
}
STALE = "spec/stale/"  # the acceptance watchdog's flags: 1.0 only when a drafter's acceptance collapsed
# the tail's metrics are zero exactly when no step ran with at most a quarter of the sequences (checked below)
TAIL = ("rollout/tail_s", "rollout/tail_share", "rollout/tail_share_off_est", "spec/tail_tokens_per_s")


INVARIANT = "rollout/batch_invariant"  # checked against the resolved config below, not skipped
# shared prompt blocks are reused only where rollout.prefix_cache resolves on: auto follows the invariant passes
# (config/sections.py), so in fp32 (an AVX2-only CPU) nothing is reused; where they run it must move
REUSED = "rollout/prefill_reused_share"


def invariant_passes(cfg) -> bool:
    """What the engine resolves rollout.batch_invariant to for this config on this CPU (engine/probe.py): the dtype
    model.dtype resolves to here (auto: fp32 on an AVX2-only CPU, or under ONEDNN_MAX_CPU_ISA=AVX2), and the probe's
    verdict where it runs."""
    from tailrl.engine.probe import resolve_invariant
    from tailrl.model import load_model
    from tailrl.model.load import resolve_dtype

    model, _ = load_model(cfg.model.path, device="cpu", dtype=resolve_dtype(cfg.model.dtype, "cpu"))
    return resolve_invariant(cfg.rollout.batch_invariant, model)[0]


def test_no_metric_is_stuck_at_zero(tiny_chat, task_file, tmp_path):
    cfg = tiny_cfg(tiny_chat, task_file, tmp_path, "trainer.steps=3", "trainer.eval_every=2", "rollout.max_tokens=12")
    rows = [json.loads(x) for x in (train(cfg) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 3
    for r in steps:  # the headline throughput, at every step
        assert r["perf/gen_tokens_per_s"] > 0 and r["perf/update_tokens_per_s"] > 0, r
    n_seqs = cfg.trainer.prompts_per_step * cfg.rollout.n
    had_tail = any(0 < run <= tail_size(n_seqs) for r in steps for _, _, run in r["rollout/timeline"])
    invariant = invariant_passes(cfg)
    no_reuse = cfg.rollout.prefix_cache is False or (cfg.rollout.prefix_cache == "auto" and not invariant)
    stuck = []
    for key in sorted({k for r in rows for k in r}):
        vals = [r[key] for r in rows if key in r]
        if not all(isinstance(v, (int, float)) and v == 0 for v in vals):
            continue
        if key in MAY_BE_ZERO or key.startswith(STALE) or (key in TAIL and not had_tail) or key == INVARIANT or (
                key == REUSED and no_reuse):
            continue
        stuck.append(key)
    assert not stuck, f"metrics logged as 0 at every step: {stuck}"
    # rollout/batch_invariant says what the engine resolved: 0 wherever its config resolves to the plain passes
    # (auto in fp32, as on an AVX2-only CPU), 1 where the invariant passes run (auto in bf16 where the probe holds)
    assert [r["rollout/batch_invariant"] for r in steps] == [float(invariant)] * 3
    for key in ("perf/gen_tokens_per_s", "spec/accept_length", "actor/grad_norm", "timing_s/gen", "rollout/gen_rounds"):
        assert key in steps[-1], key  # the check above saw the metrics that matter
