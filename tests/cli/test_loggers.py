"""trainer.loggers: W&B offline (the run's files hold the metrics of metrics.jsonl and the config; a resume
continues the same W&B run), a missing wandb package fails at start, and a logger left out is not written."""

import json
import re
import sys
import time

import pytest

from tailrl.cli import main

pytestmark = pytest.mark.slow  # the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray


def wandb_records(path) -> list:
    """The records of a W&B .wandb file (a LevelDB-style log of protobuf Records in 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, part, out = path.read_bytes(), 7, b"", []  # 7: the ':W&B' header, magic and version
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        n, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if pos + 7 + n > len(data):  # a record still being written
            break
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 2):  # full, first
            part = chunk
        elif kind in (3, 4):  # middle, last
            part += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(part)
            out.append(rec)
    return out


def finished_records(run_file, wait_s: float = 120.0) -> list:
    """The records once the run's 'exit' record is in the file (W&B's service process writes it a moment after
    run.finish() returns)."""
    deadline = time.monotonic() + wait_s
    while True:
        recs = wandb_records(run_file) if run_file.is_file() else []
        if any(r.WhichOneof("record_type") == "exit" for r in recs) or time.monotonic() > deadline:
            return recs
        time.sleep(0.2)


def history(run_file) -> dict[int, dict]:
    rows = {}
    for rec in finished_records(run_file):
        if rec.WhichOneof("record_type") == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
            rows[row["_step"]] = row
    return rows


def train_args(tiny_chat, task_file, out, *extra):
    return ["train", f"model.path={tiny_chat}", f"data.train_file={task_file}", "data.num_eval=4", f"trainer.out_dir={out}",
            "reward.functions=[math]", "rollout.n=4", "rollout.max_tokens=6", "trainer.prompts_per_step=2",
            "algo.mini_batch_size=8", "trainer.eval_every=1", "trainer.save_every=1", "rollout.kv_cache_gb=0.1",
            "trainer.report=false", *extra]


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    for var, sub in (("WANDB_CONFIG_DIR", "cfg"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    yield
    import wandb

    wandb.teardown()  # the W&B service process ends with the test


def test_wandb_offline_has_the_metrics_and_a_resume_continues_the_run(tiny_chat, task_file, tmp_path, offline_wandb):
    out = tmp_path / "run"
    assert main(train_args(tiny_chat, task_file, out, "trainer.steps=2", "trainer.loggers=[jsonl,wandb]",
                           "trainer.run_name=first")) == 0
    run_id = (out / "wandb_run_id").read_text().strip()
    runs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and not (out / "tensorboard").exists()  # tensorboard was left out
    jsonl = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    logged = history(runs[0] / f"run-{run_id}.wandb")
    assert sorted(logged) == [0, 1, 2]
    for step in (1, 2):  # the names and values of metrics.jsonl
        for key in ("reward/mean", "acc/mean", "eval/accuracy", "timing_s/gen", "actor/grad_norm"):
            if key in jsonl[step]:
                assert logged[step][key] == pytest.approx(jsonl[step][key]), (step, key)
        assert "response_lengths" not in logged[step]
    assert logged[0]["eval/accuracy"] == pytest.approx(jsonl[0]["eval/accuracy"])
    recs = finished_records(runs[0] / f"run-{run_id}.wandb")
    run = next(r.run for r in recs if r.WhichOneof("record_type") == "run")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert run.run_id == run_id and run.display_name == "first"
    assert config["rollout"]["n"] == 4 and config["trainer"]["loggers"] == ["jsonl", "wandb"]
    # resume: the same W&B run goes on from step 3
    assert main(train_args(tiny_chat, task_file, out, "trainer.steps=3", "trainer.loggers=[jsonl,wandb]",
                           "trainer.resume=true")) == 0
    assert (out / "wandb_run_id").read_text().strip() == run_id
    runs = sorted((out / "wandb").glob("offline-run-*"))
    # wandb names a folder offline-run-<time>-<id>, with "-1" added when both runs began in the same second
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", r.name) for r in runs)
    later = next(r for r in runs if 3 in history(r / f"run-{run_id}.wandb"))
    assert sorted(history(later / f"run-{run_id}.wandb")) == [3]


def test_a_missing_wandb_package_fails_at_start(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    out = tmp_path / "run"
    assert main(["train", "trainer.loggers=[console,wandb]", f"trainer.out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "wandb package is not installed" in err and "pip install wandb" in err and err.count("\n") == 1
    assert not out.exists()  # before the run folder, the model or the data


def test_a_misspelled_logger_names_the_choices(capsys):
    assert main(["train", "trainer.loggers=[console,wandbb]"]) == 2
    assert "choose one of console, jsonl, tensorboard, wandb (did you mean wandb?)" in capsys.readouterr().err
