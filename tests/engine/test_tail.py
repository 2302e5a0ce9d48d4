import json

import pytest

from tailrl.engine import Engine, EngineConfig, SamplingParams, StepRecord
from tailrl.rl.run import train
from tailrl.engine.stats import GenerateStats
from tailrl.engine.tail import in_tail, running_counts, split_tail, tail_metrics, tail_size
from tailrl.speculative.config import SpecConfig
from tests.rl_helpers import small_cfg


def d(batch, total, est):
    return StepRecord("decode", batch=batch, total_s=total, plain_est_s=est)


# 8 sequences: the tail is at most 2 running. A prefill of 2 prompts (it admits the 8 that the next step decodes),
# body steps at 8, 8 and 3, then tail steps at 2, an idle step, 1 and 1 (the last without an SD-off estimate)
RECORDS = [StepRecord("prefill", batch=2, total_s=0.5), d(8, 1.0, 2.0), d(8, 1.0, 1.5), d(3, 0.4, 0.4), d(2, 0.2, 0.6),
           StepRecord("idle"), d(1, 0.1, 0.4), d(1, 0.1, 0.0)]


def test_running_counts_give_a_prefill_the_next_decode_batch():
    assert running_counts(RECORDS) == [8, 8, 8, 3, 2, 0, 1, 1]
    assert running_counts([d(4, 1, 1), StepRecord("prefill", batch=3)]) == [4, 3]  # nothing follows it: its own


def test_tail_share_and_speedups_on_a_hand_built_rollout():
    s = split_tail(RECORDS, 8)
    assert (s.body_s, s.body_off_s) == pytest.approx((0.5 + 1.0 + 1.0 + 0.4, 0.5 + 2.0 + 1.5 + 0.4))
    assert (s.tail_s, s.tail_off_s) == pytest.approx((0.2 + 0.1 + 0.1, 0.6 + 0.4 + 0.1))  # no estimate: measured
    m = tail_metrics(RECORDS, 8)
    assert m["rollout/tail_share"] == pytest.approx(0.4 / 3.3)
    assert m["rollout/tail_share_off_est"] == pytest.approx(1.1 / 5.5)
    assert m["spec/tail_speedup_est"] == pytest.approx(1.1 / 0.4)
    assert m["spec/body_speedup_est"] == pytest.approx(4.4 / 2.9)
    assert m["rollout/timeline"] == [[2.5, 4.0, 8], [2.9, 4.4, 3], [3.1, 5.0, 2], [3.3, 5.5, 1]]
    # a quarter of 12 is 3: the step at 3 running joins the tail
    assert split_tail(RECORDS, 12).tail_s == pytest.approx(0.8)


def test_no_tail_no_time_and_a_bad_count():
    m = tail_metrics([d(8, 1.0, 2.0)], 8)
    assert (m["rollout/tail_share"], m["spec/tail_speedup_est"], m["spec/body_speedup_est"]) == (0.0, 1.0, 2.0)
    assert tail_metrics([], 8)["rollout/tail_share"] == 0.0
    with pytest.raises(ValueError, match="n_seqs=0"):
        split_tail(RECORDS, 0)


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_a_tiny_models_rollout(tiny_lm, mode):
    """A real rollout with lengths 2..16: SD off estimates nothing (speedups exactly 1); the timeline ends at the
    engine's decode + prefill seconds and its running counts only fall."""
    model, _ = tiny_lm
    eng = Engine(model, None, EngineConfig(kv_cache_gb=0.1, spec=SpecConfig(mode=mode), seed=0))
    prompts = [[1, 2, 3, 4]] * 2 + [[5, 6, 7]] * 2 + [[8, 9]] * 4
    params = [SamplingParams(n=2, max_tokens=2 + 2 * i, temperature=1.0, seed=i, ignore_eos=True) for i in range(8)]
    col, records = eng.collector(eng.add_requests(prompts, params)), []
    while eng.has_work():
        out = eng.step()
        col.add(out)
        records.append(out.record)
    st = col.result().stats
    m = tail_metrics(records, 16)
    line = m["rollout/timeline"]
    assert line[-1][0] == pytest.approx(st.decode_s + st.prefill_s, abs=2e-3)
    assert [c for *_, c in line] == sorted((c for *_, c in line), reverse=True) and line[0][2] == 16
    assert 0 < m["rollout/tail_share"] < 1
    assert m["rollout/tail_s"] + m["rollout/body_s"] == pytest.approx(st.decode_s + st.prefill_s)
    if mode == "off":
        assert m["spec/tail_speedup_est"] == m["spec/body_speedup_est"] == 1.0
    else:
        assert m["spec/tail_speedup_est"] > 0 and m["spec/body_speedup_est"] > 0


@pytest.mark.slow  # a training run
def test_a_training_step_logs_the_tail(tiny_chat, task_file, tmp_path):
    rows = [json.loads(x) for x in (train(small_cfg(tiny_chat, task_file, tmp_path, "trainer.steps=1", "trainer.save_every=0"))
                                    / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "reward/mean" in r)
    assert 0 <= step["rollout/tail_share"] <= 1 and step["spec/tail_speedup_est"] > 0
    assert step["rollout/timeline"][0][2] == 8  # 2 prompts x 4 samples


def test_the_report_shows_the_tail(tmp_path):
    from tailrl.report import make_report

    def row(step, split):
        m = tail_metrics(RECORDS, split)
        return {"step": step, "reward/mean": 0.1 * step, "acc/mean": 0.1, "response_length/mean": 50.0,
                "timing_s/gen": 3.3, "timing_s/update": 1.0, "timing_s/step": 4.3, **m}

    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(row(s, n)) for s, n in ((1, 8), (2, 12))) + "\n")
    text = make_report(tmp_path).read_text()
    # step 1: tail 0.4 s (off 1.1), body 2.9 s (off 4.4); step 2: tail 0.8 s (off 1.5), body 2.5 s (off 4.0)
    assert "1s of 7s of rollout (18%)" in text and "2.17x in the tail, 1.56x in the body" in text
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_one_tail_for_the_metrics_the_engine_stats_and_the_spot_lender():
    """At most a quarter of the rollout's sequences running: the split's tail, the engine's tail tokens/s and the
    steps where the spot trainer is lent threads are the same steps."""
    from tailrl.drafter.buffer import DraftBuffer
    from tailrl.drafter.config import DrafterConfig
    from tailrl.drafter.train import SpotLender
    from tests.helpers import StubSpot

    assert [in_tail(r, 16) for r in (0, 1, 4, 5, 16)] == [False, True, True, False, False]
    assert tail_size(3) == 0 and not in_tail(1, 3)  # fewer than 4 sequences: no tail
    stats = GenerateStats(tail_size=tail_size(8))
    for r in RECORDS:
        stats.add(r)
    assert stats.tail_s == pytest.approx(split_tail(RECORDS, 8).tail_s)  # no prefill falls in this tail

    lender = SpotLender(StubSpot(), DraftBuffer(), DrafterConfig(), threads=1)
    lender.begin_step(1, 10.0, n_seqs=8)
    lent = []
    for r in RECORDS[1:]:
        lender.on_engine_step(r.batch, [])
        lent.append(lender.lent)
    assert lent == [in_tail(b, 8) for b in running_counts(RECORDS)[1:]]


def test_the_sd_off_estimate_prices_a_later_turn_after_the_one_it_continues(tiny_lm):
    """A tool trajectory's next turn is a request that continues a finished one (params.resume): its completion says
    so (`continues`), and the rollout's SD-off estimate schedules it after that turn (speculative/off_estimate.py).
    Turns a (6 tokens) then a2 (5), beside b (14), a plain step priced B^2: a and b run steps 1-5 (4 each), a2 and b
    steps 6-9 (4 each), b alone steps 10-13 (1 each): 40. Every turn from step 0 would read 48; the first requests
    alone (the estimate before) 28."""
    model, _ = tiny_lm
    eng = Engine(model, None, EngineConfig(kv_cache_gb=0.1, spec=SpecConfig(mode="auto"), seed=0))
    first = [SamplingParams(max_tokens=6, temperature=1.0, seed=1, ignore_eos=True),
             SamplingParams(max_tokens=14, temperature=1.0, seed=2, ignore_eos=True)]
    col = eng.collector(eng.add_requests([[1, 2, 3, 4], [5, 6, 7]], first))
    a = col.ids[0]
    while a not in col.done:
        col.add(eng.step())
    nxt = SamplingParams(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True, resume=a)
    (a2,) = eng.add_requests([[1, 2, 3, 4] + col.done[a].token_ids + [9, 9]], nxt)
    while eng.has_work():
        col.add(eng.step())
    st = col.result().stats
    assert col.done[a2].continues == a and col.done[a].continues is None
    assert [len(col.done[i].token_ids) for i in (a, col.ids[1], a2)] == [6, 14, 5]
    eng.speculator.selector.plain_step_s = lambda contexts: float(len(contexts)) ** 2
    eng.end_rollout(st)
    assert st.off_body_s + st.off_tail_s == 40.0


def test_a_rollout_estimated_slower_than_sd_off_makes_the_next_one_plain(tiny_lm):
    """The engine gives the selector's ledger each rollout's own SD-off estimate (speculative/ledger.py): priced so
    that plain decoding would have taken no time, the rollout lost, so the next decodes plainly in every step (its
    stats say so: spec/rested), the same tokens as SD off, and the one after speculates again."""
    from tailrl.speculative.ledger import REST_BELOW

    model, _ = tiny_lm
    eng = Engine(model, None, EngineConfig(kv_cache_gb=0.1, spec=SpecConfig(mode="auto", epsilon=0.0), seed=0))
    off = Engine(model, None, EngineConfig(kv_cache_gb=0.1, seed=0))
    prompts = [[1, 2, 3, 4] * 3, [5, 6, 7] * 4]
    p = SamplingParams(max_tokens=24, temperature=1.0, seed=1, ignore_eos=True, n=2)
    sel = eng.speculator.selector
    col = eng.collector(eng.add_requests(prompts, p))
    while eng.has_work():
        col.add(eng.step())
    st = col.result().stats
    price = sel.plain_step_s
    sel.plain_step_s = lambda contexts: 1e-9 * len(contexts)
    eng.end_rollout(st)
    sel.plain_step_s = price
    assert st.speedup_est < REST_BELOW and sel.ledger.resting and sel.ledger.last == st.speedup_est
    assert st.gauges["spec/rested"] == 0.0 and st.gauges["spec/rest_streak"] == 0.0
    rested = eng.generate(prompts, p)
    assert {arm for counts in rested.stats.choices.values() for arm in counts} == {"off"}
    assert rested.stats.gauges["spec/rested"] == 1.0 and rested.stats.gauges["spec/rest_streak"] == 1.0
    assert [o.token_ids for o in rested] == [o.token_ids for o in off.generate(prompts, p)]
    assert not sel.ledger.resting  # one rollout of rest after a first loss
