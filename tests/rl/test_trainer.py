import json

import pytest
import torch

from tailrl.cli import main
from tailrl.rl.run import train
from tailrl.rl.trainer import Trainer
from tailrl.rollout.weights import push_weights
from tests.rl_helpers import tiny_cfg

pytestmark = pytest.mark.slow  # the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray


def always_raises(prompts, completions, **_):
    raise RuntimeError("reward bug")


def always_hangs(prompts, completions, **_):
    import time

    time.sleep(120)
    return [1.0] * len(completions)


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [{"prompt": f"{i % 10} + {(i * 3) % 10} =", "answer": str(i % 10 + (i * 3) % 10)} for i in range(64)]
    rows.insert(5, {"no_prompt": True})  # a malformed row is skipped with a warning
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    return str(path)


def test_a_few_steps_raise_the_reward(tiny_chat, task_file, tmp_path):
    cfg = tiny_cfg(tiny_chat, task_file, tmp_path, "trainer.steps=8", "trainer.save_every=0")
    rows = [json.loads(line) for line in (train(cfg) / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 8
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.1, rewards
    for key in ("timing_s/gen", "timing_s/update", "timing_s/step", "response_length/mean", "actor/pg_loss",
                "actor/entropy", "actor/grad_norm", "spec/accept_length", "spec/speedup_est"):
        assert key in rows[-1]


def test_kill_and_resume_continues_exactly(tiny_chat, task_file, tmp_path):
    full = tmp_path / "full"
    train(tiny_cfg(tiny_chat, task_file, full, "trainer.steps=3", "algo.mini_batch_size=8"))
    part = tmp_path / "part"
    train(tiny_cfg(tiny_chat, task_file, part, "trainer.steps=2", "algo.mini_batch_size=8"))
    with (part / "metrics.jsonl").open("a") as f:  # a killed run may have logged a step it never saved
        f.write(json.dumps({"step": 3, "reward/mean": -1.0}) + "\n")
    train(tiny_cfg(tiny_chat, task_file, part, "trainer.steps=3", "trainer.resume=true", "algo.mini_batch_size=8"))
    a = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == [1, 2, 3]
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean", "response_lengths"):
        assert a[2][key] == pytest.approx(b[2][key], rel=1e-5, abs=1e-6), key
    # and the weights after the resumed step, which depend on the optimizer state the checkpoint held
    from safetensors.torch import load_file

    wa, wb = (load_file(str(d / "checkpoints" / "step_000003" / "model" / "model.safetensors")) for d in (full, part))
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-7) for k in wa), "weights differ after step 3"


def test_a_cosine_run_killed_after_a_step_resumes_at_the_same_rates(tiny_chat, task_file, tmp_path):
    import shutil

    from safetensors.torch import load_file

    extra = ("trainer.steps=3", "algo.mini_batch_size=8", "algo.lr_schedule=cosine", "algo.lr_min_ratio=0.1")
    run = train(tiny_cfg(tiny_chat, task_file, tmp_path / "run", *extra))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["actor/lr"] for r in rows] == pytest.approx([0.02, 0.011, 0.002])  # tiny_cfg's lr 0.02, floor 0.1
    w3 = load_file(str(run / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
    shutil.rmtree(run / "checkpoints" / "step_000003")  # killed before its last checkpoint was written
    train(tiny_cfg(tiny_chat, task_file, run, *extra, "trainer.resume=true"))
    again = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert again["step"] == 3 and again["actor/lr"] == pytest.approx(0.002)
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response_lengths"):
        assert again[key] == pytest.approx(rows[2][key], rel=1e-5, abs=1e-6), key
    wb = load_file(str(run / "checkpoints" / "step_000003" / "model" / "model.safetensors"))
    assert all(torch.allclose(w3[k], wb[k], rtol=1e-5, atol=1e-7) for k in w3), "weights differ after step 3"


def test_raising_and_hanging_rewards_do_not_stop_a_run(tiny_chat, task_file, tmp_path):
    cfg = tiny_cfg(tiny_chat, task_file, tmp_path, "trainer.steps=1", "reward.timeout_s=5",
                   "reward.functions=[tests.rl.test_trainer:always_raises,tests.rl.test_trainer:always_hangs,tailrl.rl.smoke:count_a]",
                   "reward.weights=[1.0,1.0,1.0]", "rollout.n=2", "trainer.prompts_per_step=1")
    rows = [json.loads(x) for x in (train(cfg) / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["reward/errors"] >= 1 and rows[-1]["reward/timeouts"] >= 1
    assert rows[-1]["reward/mean"] == pytest.approx(rows[-1]["reward/count_a/mean"])


def test_engine_logprobs_equal_trainer_logprobs_after_a_step(tiny_chat, task_file, tmp_path):
    from tailrl.engine import SamplingParams
    from tailrl.rl.algos import token_logprobs

    # an fp32 property: the engine runs the trainer's own fp32 module (bf16 engines differ, see test_bf16_*)
    trainer = Trainer(tiny_cfg(tiny_chat, task_file, tmp_path, "trainer.steps=1", "rollout.spec.mode=off",
                               "model.dtype=float32"))
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    trainer.train_step()
    assert any(not torch.equal(before[k], v) for k, v in trainer.policy.state_dict().items())
    # a separate engine model gets the trained weights pushed in process
    import copy

    engine_model = copy.deepcopy(trainer.policy)
    with torch.no_grad():
        for p in engine_model.parameters():
            p.zero_()
    push_weights(trainer.policy, engine_model)
    trainer.engine.model = engine_model
    ids = trainer.train_set[0].ids
    out = trainer.engine.generate([ids], SamplingParams(max_tokens=6, seed=3, ignore_eos=True))[0]
    tokens = torch.tensor([ids + out.token_ids])
    with torch.no_grad():
        logits, _ = trainer.policy.forward_full(tokens[:, :-1], logits_start=len(ids) - 1)
        lp, _ = token_logprobs(logits, tokens[:, len(ids):])
    assert lp[0].tolist() == pytest.approx(out.logprobs, abs=1e-4)


def test_bad_config_key_says_the_nearest_in_one_line(capsys):
    assert main(["train", "algo.learning_rate=1"]) == 2
    err = capsys.readouterr().err
    assert err == "error: unknown key 'algo.learning_rate'; did you mean algo.lr?\n"


def test_an_override_keeps_text_after_a_hash():
    from tailrl.config import load_config

    cfg = load_config(None, ["data.system_prompt=Write the answer after ####, as in: #### 5", "algo.lr=1e-5",
                             "reward.functions=[math]", "data.eval_file='a#b.jsonl'"])
    assert cfg.data.system_prompt == "Write the answer after ####, as in: #### 5"
    assert cfg.algo.lr == 1e-5 and cfg.reward.functions == ["math"] and cfg.data.eval_file == "a#b.jsonl"


def test_report_is_written(tiny_chat, task_file, tmp_path):
    from tailrl.report import make_report

    train(tiny_cfg(tiny_chat, task_file, tmp_path, "trainer.steps=2", "trainer.eval_every=1"))
    md = make_report(tmp_path)
    assert (tmp_path / "report.png").stat().st_size > 10_000
    text = md.read_text()
    assert "| 2 |" in text and "eval accuracy" in text
    evals = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if "eval/accuracy" in x]
    assert [r["step"] for r in evals] == [0, 1, 2]  # one eval table row per evaluation, with its accuracy
    for r in evals:
        assert f"| {r['step']} | {r['eval/accuracy']:.2f} |" in text


def test_push_weights_matches_parameters_by_name_not_position():
    class Policy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(4, 4)
            self.down = torch.nn.Linear(4, 4)

    class EngineModel(torch.nn.Module):  # the same names, registered in the other order
        def __init__(self):
            super().__init__()
            self.down = torch.nn.Linear(4, 4)
            self.up = torch.nn.Linear(4, 4)

    torch.manual_seed(0)
    policy, engine_model = Policy(), EngineModel()
    push_weights(policy, engine_model)
    for name, p in policy.state_dict().items():
        assert torch.equal(engine_model.state_dict()[name], p), name
    engine_model.extra = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match="extra"):
        push_weights(policy, engine_model)
