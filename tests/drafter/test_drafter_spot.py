"""The spot trainer: background drafter training in the rollout's long tail. Checked in steps and events (a pause
drops the step in progress and no micro-batch runs after it; a share on a test clock is a number of steps; pauses
from another thread while rollouts run never hang); its seconds on a real machine are benchmarks/spot_pause.py's."""

import threading
import time

import pytest
import torch

from tailrl.drafter import DrafterConfig, EagleDrafter, make_speculator
from tailrl.drafter.buffer import DraftBuffer
from tailrl.drafter.propose import LearnedDrafter
from tailrl.drafter.train import DrafterTrainer, SpotLender, SpotTrainer
from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.speculative.config import SpecConfig
from tests.helpers import StubSpot, tiny_draft_buffer

pytestmark = pytest.mark.slow  # the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray


def wait_for(cond, timeout: float = 120.0) -> bool:
    """Polls cond until it holds; the timeout only keeps a broken implementation from hanging the suite."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(cond())


def test_spot_training_pauses_promptly_and_never_touches_a_running_rollout(tiny_lm):
    """The spot trainer trains while a rollout drafts from the engine's head; a pause that lands in the first
    micro-batch of a step (of several) is acknowledged after that micro-batch: no further micro-batch runs, the
    partly accumulated step is dropped, and nothing trains after pause(wait=True) returns."""
    model, tok = tiny_lm
    cfg = DrafterConfig(draft_vocab=0, batch_tokens=64, spot_share=1.0, spot_micro_tokens=16)
    head = EagleDrafter(model.config).bind(model)
    trainer = DrafterTrainer(head, cfg, buffer=tiny_draft_buffer(model))
    spot = SpotTrainer(trainer, cfg)
    spot.begin_step(1, last_step_s=1000.0)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=24, n=2, ignore_eos=True)
    plain = Engine(model, None, EngineConfig(kv_cache_gb=0.2)).generate(prompts, params)
    spec = SpecConfig(mode="learned")
    eng = Engine(model, None, EngineConfig(kv_cache_gb=0.2, spec=spec), make_speculator(spec, LearnedDrafter(head, cfg)))
    rollout_done, paused = threading.Event(), threading.Event()
    seen = {"micro": 0, "step": -1}

    def pause_in_a_step(module, args):  # runs in the trainer's thread at the start of each micro-batch's forward
        seen["micro"] += 1
        first, seen["step"] = trainer.steps != seen["step"], trainer.steps
        if first and rollout_done.is_set() and not paused.is_set():
            spot.pause(wait=False)
            seen["at"] = (seen["micro"], trainer.steps)
            paused.set()

    trainer.model.register_forward_pre_hook(pause_in_a_step)
    try:
        assert spot.resume()
        outs = eng.generate(prompts, params)  # drafting from `head` while the trainer updates its own copy
        rollout_done.set()
        assert paused.wait(120) and spot.pause(wait=True, timeout=120)
        micro, steps = seen["at"]
        assert steps > 0 and sum(s.train_positions for s in trainer.buffer.items) > 2 * 16  # steps of several micro-batches
        assert seen["micro"] == micro, "a micro-batch ran after the pause"
        assert trainer.steps == steps, "the step in progress at the pause was not dropped"
        time.sleep(0.3)
        assert (seen["micro"], trainer.steps) == (micro, steps), "the spot trainer kept training after pause()"
    finally:
        spot.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(torch.equal(before[k], v) for k, v in head.state_dict().items()), "the engine's head changed mid-rollout"
    trainer.publish(head)
    assert not all(torch.equal(before[k], v) for k, v in head.state_dict().items()), "publish copied nothing"


def test_spot_trainer_respects_its_time_share(tiny_lm):
    """A clock in which each optimizer step takes 0.25 s: a share of 1 s (0.1 of a 10 s RL step) is 4 steps, the
    trainer stops before a fifth would run over it, and the next RL step brings a new share."""
    model, _ = tiny_lm
    cfg = DrafterConfig(draft_vocab=0, batch_tokens=64, spot_share=0.1)
    trainer = DrafterTrainer(EagleDrafter(model.config).bind(model), cfg, buffer=tiny_draft_buffer(model))
    spot = SpotTrainer(trainer, cfg, clock=lambda: 0.25 * trainer.steps)
    spot.begin_step(1, last_step_s=10.0)
    try:
        assert spot.resume()
        assert wait_for(lambda: not spot.running), "the spot trainer did not stop at its share"
        assert trainer.steps == 4 and spot.steps_this_rl_step == 4 and spot.used_s == 1.0, (trainer.steps, spot.used_s)
        assert not spot.resume(), "the share is spent until the next step"
        spot.begin_step(2, last_step_s=10.0)
        assert spot.resume(), "a new step brings a new share"
        assert wait_for(lambda: not spot.running) and trainer.steps == 8 and spot.used_s == 1.0
    finally:
        spot.close()


def test_concurrent_rollout_and_spot_thread_do_not_deadlock(tiny_lm):
    """The engine hook path (rl/trainer.py's rollout): a rollout steps the engine and lends the long tail to the spot
    trainer, while another thread pauses the trainer 5 times, each while a micro-batch runs. No pause hangs, and
    the rollouts finish with the tokens of plain decoding."""
    model, _ = tiny_lm
    cfg = DrafterConfig(draft_vocab=0, batch_tokens=64, spot_share=1.0, spot_micro_tokens=16)
    head = EagleDrafter(model.config).bind(model)
    trainer = DrafterTrainer(head, cfg, buffer=tiny_draft_buffer(model))
    spot = SpotTrainer(trainer, cfg)
    threads = torch.get_num_threads()
    lender = SpotLender(spot, trainer.buffer, cfg, n_seqs=256, threads=max(threads, 2))  # tail: <= 64 running
    prompts, params = [[1, 2, 3, 4], [5, 6, 7]], SamplingParams(temperature=0, max_tokens=24, n=2, ignore_eos=True)
    plain = Engine(model, None, EngineConfig(kv_cache_gb=0.2)).generate(prompts, params)
    spec = SpecConfig(mode="learned")
    eng = Engine(model, None, EngineConfig(kv_cache_gb=0.2, spec=spec), make_speculator(spec, LearnedDrafter(head, cfg)))
    in_rollout, results, started = threading.Event(), [], [0]
    trainer.model.register_forward_pre_hook(lambda module, args: started.__setitem__(0, started[0] + 1))

    def pauser():  # each pause once a micro-batch has begun since the last one
        for _ in range(5):
            mark = started[0]
            if not wait_for(lambda: spot.running and started[0] > mark):
                return
            results.append((in_rollout.is_set(), spot.pause(wait=True, timeout=10)))

    def rollouts():  # rollouts until the 5 pauses are done; a hang here leaves the thread alive, failing the test
        while pausing.is_alive() and len(outs) < 500:
            col = eng.collector(eng.add_requests(prompts, params))
            in_rollout.set()
            try:
                while eng.has_work():
                    out = eng.step()
                    col.add(out)
                    lender.on_engine_step(eng.num_running, out.finished)
            finally:
                in_rollout.clear()
                lender.stop()
            outs.append([o.token_ids for o in col.result()])

    outs: list = []
    pausing = threading.Thread(target=pauser, daemon=True)
    rolling = threading.Thread(target=rollouts, daemon=True)
    try:
        lender.begin_step(1, 1000.0)
        pausing.start()
        rolling.start()
        pausing.join(300)
        rolling.join(120)
        assert not pausing.is_alive() and not rolling.is_alive(), "a pause or a rollout hung"
        assert len(results) == 5 and all(ok for _, ok in results) and any(mid for mid, _ in results), results
        assert outs and all(o == [c.token_ids for c in plain] for o in outs)
    finally:
        spot.close()
        torch.set_num_threads(threads)


def test_threads_lent_to_the_spot_trainer_come_back_when_it_stops_itself():
    """Once the spot trainer has spent its share mid-tail, the rollout gets its threads back at the next step."""
    before = torch.get_num_threads()
    lender = SpotLender(StubSpot(), DraftBuffer(), DrafterConfig(), n_seqs=16, threads=2)  # tail: <= 4 running
    try:
        lender.on_engine_step(2, [])  # the long tail: threads lent
        assert lender.lent and torch.get_num_threads() == 1
        lender.spot.running = False  # the trainer spent its share and stopped by itself
        lender.on_engine_step(2, [])
        assert not lender.lent and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_spot_trainer_saves_up_its_share_for_a_step_longer_than_one_share(tiny_lm):
    """A drafter step of 3 s against a share of 1 s an RL step (0.1 of 10 s): without saving up, the trainer ran its
    first step and never again. With spot_bank it trains every few RL steps, and over the run it never takes more
    than its shares plus the one step it could not know the cost of."""
    model, _ = tiny_lm
    cfg = DrafterConfig(draft_vocab=0, batch_tokens=64, spot_share=0.1, spot_bank=8)
    trainer = DrafterTrainer(EagleDrafter(model.config).bind(model), cfg, buffer=tiny_draft_buffer(model))
    spot = SpotTrainer(trainer, cfg, clock=lambda: 3.0 * trainer.steps)
    used = 0.0
    try:
        for step in range(1, 13):
            spot.begin_step(step, last_step_s=10.0)
            if spot.resume():
                assert wait_for(lambda: not spot.running), "the spot trainer did not stop at its share"
            used += spot.used_s
        assert trainer.steps >= 3, trainer.steps  # 1 without saving up
        assert used <= 12 * 1.0 + 3.0, used
    finally:
        spot.close()
