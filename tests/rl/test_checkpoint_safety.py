"""Opening a run folder runs no code from it, and a checkpoint is checked before it is trusted (issue 36): a
pickled payload never runs, a malformed field falls back to the checkpoint before with a warning naming it, and
an old pickled state resumes only with trainer.trust_pickled_state=true, which rewrites it."""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tailrl.cli import main
from tailrl.rl.checkpoint.store import CheckpointError
from tailrl.rl.run import train
from tailrl.rl.checkpoint.state_check import python_rng
from tailrl.rl.checkpoint.state_io import PICKLED, STATE_JSON, STATE_TENSORS, read_state
from tailrl.rl.trainer import Trainer
from tests.rl_helpers import PIN_LR, small_cfg

pytestmark = pytest.mark.slow  # the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray

BUILTIN_REWARD = ("reward.functions=[math]", "reward.weights=[1.0]")  # no worker process: cheaper
FLAG = "trainer.trust_pickled_state=true"


class Payload:
    """Unpickling this creates `marker`: what a hostile trainer_state would do, made visible."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def cfg(tiny_chat, task_file, out, *extra):
    return small_cfg(tiny_chat, task_file, out, *BUILTIN_REWARD, *extra)


def overrides(tiny_chat, task_file, out, *extra) -> list[str]:
    return [f"model.path={tiny_chat}", f"data.train_file={task_file}", "data.num_eval=4", f"trainer.out_dir={out}",
            *BUILTIN_REWARD, "rollout.n=4", "trainer.prompts_per_step=2", "rollout.max_tokens=6",
            "algo.mini_batch_size=8", "algo.micro_batch_size=8", "trainer.eval_every=0", "trainer.save_every=1",
            "rollout.kv_cache_gb=0.1", "trainer.report=false", *PIN_LR, *extra]


@pytest.fixture(scope="module")
def two_steps(tiny_chat, task_file, tmp_path_factory):
    """A run of 2 steps with a checkpoint after each (new format); tests copy it."""
    out = tmp_path_factory.mktemp("two_steps")
    train(cfg(tiny_chat, task_file, out, "trainer.steps=2"))
    return out


@pytest.fixture
def run(two_steps, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    return out


def to_pickled(ckpt) -> None:
    """Rewrites a checkpoint in the layout before issue 36: torch.save of the state dict the old code built."""
    state = read_state(ckpt)
    state["python_rng"] = python_rng(state["python_rng"])  # the old code saved random.getstate() as it is
    torch.save(state, ckpt / PICKLED)
    (ckpt / STATE_JSON).unlink()
    (ckpt / STATE_TENSORS).unlink()


def resume(tiny_chat, task_file, out, *extra) -> Trainer:
    t = Trainer(cfg(tiny_chat, task_file, out, "trainer.steps=3", "trainer.resume=true", *extra))
    try:
        t.resume()
    finally:
        t.close()
    return t


@pytest.mark.parametrize("where", [PICKLED, STATE_JSON, STATE_TENSORS])
def test_a_pickled_payload_in_a_trainer_state_never_runs(tiny_chat, task_file, run, tmp_path, caplog, where):
    marker = tmp_path / "payload_ran"
    newest = run / "checkpoints" / "step_000002"
    if where == PICKLED:  # an old-format folder: its only state is the pickle
        (newest / STATE_JSON).unlink()
        (newest / STATE_TENSORS).unlink()
    torch.save({"step": 2, "x": Payload(marker)}, newest / where)  # as the old file, or in place of a new one
    with caplog.at_level(logging.WARNING):
        try:
            got, err = resume(tiny_chat, task_file, run).step, ""
        except CheckpointError as e:
            got, err = None, str(e)
    assert not marker.exists(), "the payload ran"
    if where == PICKLED:  # refused, naming the flag
        assert got is None and f"{PICKLED} holds the trainer state as a pickle" in err and FLAG in err
    else:  # unusable: the checkpoint before is used
        assert got == 1 and f"checkpoint step_000002 is unusable ({newest / where}" in caplog.text


def test_the_cli_refuses_an_old_format_folder_naming_the_flag(tiny_chat, task_file, run, tmp_path, capsys):
    marker = tmp_path / "payload_ran"
    for ckpt in sorted((run / "checkpoints").glob("step_*")):
        to_pickled(ckpt)
    torch.save({"step": 2, "x": Payload(marker)}, run / "checkpoints" / "step_000002" / PICKLED)
    code = main(["train", *overrides(tiny_chat, task_file, run, "trainer.steps=3", "trainer.resume=true")])
    assert not marker.exists(), "the payload ran"
    err = capsys.readouterr().err
    assert code == 2 and f"error: {run / 'checkpoints' / 'step_000002' / PICKLED} holds the trainer state as a pickle" in err
    assert FLAG in err and "Traceback" not in err


def edit_json(ckpt, change) -> None:
    doc = json.loads((ckpt / STATE_JSON).read_text())
    change(doc["state"])
    (ckpt / STATE_JSON).write_text(json.dumps(doc))


def edit_tensors(path, change) -> None:
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def shape_of(tensors, name, shape):
    tensors[name] = torch.zeros(shape)


BREAKS = {  # what is changed in the newest checkpoint -> the field its warning must name
    "missing key": (lambda c: edit_json(c, lambda s: s.pop("loader")), "trainer_state: loader: missing"),
    "wrong type": (lambda c: edit_json(c, lambda s: s.update(step="2")),
                   "trainer_state: step: '2' is not a non-negative integer"),
    "wrong nested type": (lambda c: edit_json(c, lambda s: s["loader"].update(epoch=[0])),
                          "trainer_state: loader.epoch: [0] is not a non-negative integer"),
    "wrong shape": (lambda c: edit_tensors(c / STATE_TENSORS, lambda t: shape_of(t, "optimizer/state/3/exp_avg", (5,))),
                    "trainer_state: optimizer.state.3.exp_avg: shape (5) where"),
    "rng": (lambda c: edit_tensors(c / STATE_TENSORS, lambda t: shape_of(t, "torch_rng", (16,))),
            "trainer_state: torch_rng: shape (16) where (5056) was expected"),
    "optimizer group": (lambda c: edit_json(c, lambda s: s["optimizer"]["param_groups"][0]["params"].pop()),
                        "trainer_state: optimizer.param_groups.0.params:"),
    "model weight": (lambda c: edit_tensors(c / "model" / "model.safetensors",
                                            lambda t: shape_of(t, "model.norm.weight", (3,))),
                     "model.safetensors: model.norm.weight: shape (3) where ("),
    "dangling tensor": (lambda c: edit_json(c, lambda s: s.update(torch_rng={"$tensor": "gone"})),
                        "StateError: torch_rng: tensor 'gone' is not in trainer_state.safetensors"),
}


@pytest.mark.parametrize("kind", list(BREAKS))
def test_a_malformed_field_falls_back_to_the_checkpoint_before(tiny_chat, task_file, run, caplog, kind):
    change, field = BREAKS[kind]
    change(run / "checkpoints" / "step_000002")
    with caplog.at_level(logging.WARNING):
        t = resume(tiny_chat, task_file, run)
    assert t.step == 1
    warned = [r.getMessage() for r in caplog.records if "step_000002 is unusable" in r.getMessage()]
    assert len(warned) == 1 and field in warned[0] and "trying the one before" in warned[0], caplog.text
    assert "\n" not in warned[0]


def test_no_usable_checkpoint_stops_with_an_error(tiny_chat, task_file, run, capsys):
    for ckpt in (run / "checkpoints").glob("step_*"):
        edit_json(ckpt, lambda s: s.pop("step"))
    assert main(["train", *overrides(tiny_chat, task_file, run, "trainer.steps=3", "trainer.resume=true")]) == 2
    err = capsys.readouterr().err
    assert "none of the 2 checkpoints" in err and "is usable" in err and "Traceback" not in err
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2  # nothing trained over it


def test_an_old_format_folder_resumes_with_the_flag_exactly_and_is_rewritten(tiny_chat, task_file, tmp_path, caplog):
    def run_cfg(out, *extra):  # a reward the tiny model earns, so that every step updates the weights
        return cfg(tiny_chat, task_file, out, "reward.functions=[tailrl.rl.smoke:count_a]", "trainer.seed=3", *extra)

    run = train(run_cfg(tmp_path / "run", "trainer.steps=2"))
    for ckpt in (run / "checkpoints").glob("step_*"):
        to_pickled(ckpt)
    with pytest.raises(CheckpointError, match=FLAG):
        train(run_cfg(run, "trainer.steps=3", "trainer.resume=true"))
    assert (run / "checkpoints" / "step_000002" / PICKLED).is_file()  # refused: nothing rewritten
    with caplog.at_level(logging.WARNING):
        train(run_cfg(run, "trainer.steps=3", "trainer.resume=true", FLAG))
    assert "trust_pickled_state=true: unpickling" in caplog.text and "rewrote the trainer state" in caplog.text
    step2 = run / "checkpoints" / "step_000002"
    assert not (step2 / PICKLED).exists() and read_state(step2)["step"] == 2
    full = train(run_cfg(tmp_path / "full", "trainer.steps=3"))  # never stopped
    a, b = ([json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (full, run))
    # the premise: the steps update the weights (which steps have a zero-advantage batch follows the CPU's kernels)
    assert [r["step"] for r in b] == [1, 2, 3] and any(r["actor/grad_norm"] > 0 for r in a[1:])
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response_lengths"):
        assert a[2][key] == pytest.approx(b[2][key], rel=1e-5, abs=1e-6), key
    # the weights after step 3 too: they depend on the optimizer state the old file held
    wa, wb = (load_file(str(d / "checkpoints" / "step_000003" / "model" / "model.safetensors")) for d in (full, run))
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-5, atol=1e-7) for k in wa), "weights differ after step 3"
    assert resume(tiny_chat, task_file, run).step == 3  # no flag needed any more


@pytest.mark.parametrize("content", ["payload", "dict", "out of range"])
def test_a_drafter_folder_runs_no_code_from_its_vocabulary_file(tiny_chat, tmp_path, content):
    from tailrl.drafter.eagle import VOCAB_FILE, EagleDrafter, load_drafter, save_drafter
    from tailrl.model import load_model

    model, _ = load_model(tiny_chat, device="cpu", dtype=torch.float32)
    folder = save_drafter(EagleDrafter(model.config, torch.tensor([0, 2, 5])).bind(model), tmp_path / "drafter")
    assert load_drafter(folder).vocab.tolist() == [0, 2, 5]
    marker = tmp_path / "payload_ran"
    bad = {"payload": Payload(marker), "dict": {"ids": [0, 2]}, "out of range": torch.tensor([0, 10**6])}[content]
    torch.save(bad, folder / VOCAB_FILE)
    with pytest.raises(ValueError, match=f"{VOCAB_FILE} (holds more than a tensor|is not a 1-D tensor of token ids)"):
        load_drafter(folder)
    assert not marker.exists(), "the payload ran"
