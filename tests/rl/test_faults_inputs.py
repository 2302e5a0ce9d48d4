"""Bad input fails alone or fails early, naming its source: config values, dataset rows, model files, reward
modules, output paths (issue 12, classes 2, 5, 6 and 9)."""

import json
import logging
import sys

import pytest

from tailrl.config import ConfigError, DataCfg, load_config
from tailrl.rl.data import load_datasets

pytestmark = pytest.mark.slow  # the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray


@pytest.mark.parametrize("override, key", [
    ("rollout.temperature=0", "rollout.temperature"),  # greedy rollouts give NaN policy-gradient losses
    ("reward.weights=[.nan]", "reward.weights"),
    ("reward.weights=[1.0,0.2,0.5]", "reward.weights"),  # three weights for fewer functions
    ("data.num_eval=0", "data.num_eval"),  # while trainer.eval_every > 0
    ("trainer.keep_checkpoints=0", "trainer.keep_checkpoints"),
])
def test_values_that_would_poison_a_run_fail_at_start(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_no_eval_set_is_fine_without_evaluation():
    cfg = load_config(None, ["data.num_eval=0", "trainer.eval_every=0"])
    assert cfg.data.num_eval == 0


def test_malformed_rows_are_skipped_with_file_and_line(tmp_path, caplog):
    good = {"prompt": "2 + 2 =", "answer": 4}
    bad = [
        {"prompt": ["hello", "there"], "answer": 1},  # chat messages as strings
        {"prompt": [{"role": "user"}], "answer": 1},  # a message without content
        {"prompt": [{"role": "wizard", "content": "hi"}], "answer": 1},  # an unknown role
        {"prompt": 42, "answer": 1},  # a prompt of the wrong type
        {"prompt": "q", "answer": [1, 2]},  # an answer of the wrong type
    ]
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(good).encode()] + [json.dumps(r).encode() for r in bad] + [b'{"prompt": "caf\xe9", "answer": 1}']
    path.write_bytes(b"\n".join(lines + [json.dumps(good).encode()]) + b"\n")
    with caplog.at_level(logging.WARNING):
        train, _ = load_datasets(DataCfg(train_file=str(path), eval_file=str(path)))
    assert len(train) == 2
    text = caplog.text
    for line, what in [(2, "chat message 1 is a str"), (3, "no text 'content'"), (4, "role 'wizard'"),
                       (5, "'prompt' is a int"), (6, "'answer' is a list"), (7, "not UTF-8")]:
        assert f"{path}:{line} skipped" in text and what in text, (line, what)


def test_parquet_without_the_prompt_column_names_the_key_to_set(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "1"}]), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"no column 'prompt' \(columns: answer, question\); set data\.prompt_key"):
        load_datasets(DataCfg(train_file=str(tmp_path / "d.parquet")))


def test_model_config_that_is_not_json_is_named(tmp_path):
    from tailrl.model import load_model

    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_model(str(tmp_path), device="cpu")


def test_reward_module_with_a_syntax_error_is_named(tmp_path, monkeypatch):
    from tailrl.rl.rewards.runner import RewardRunner

    (tmp_path / "broken_rewards.py").write_text("def f(prompts, completions, **kw)\n    return [0.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ValueError, match=r"broken_rewards:f.*SyntaxError.*line 1"):
        RewardRunner(["broken_rewards:f"])


@pytest.mark.parametrize("bad", ["dir", "under_file"])
def test_generate_out_that_cannot_be_written_fails_before_generating(tmp_path, monkeypatch, capsys, bad):
    from tailrl.cli import main
    from tailrl.engine import Engine

    def no_generate(*a, **k):
        raise AssertionError("generated before checking --out")

    monkeypatch.setattr(Engine, "generate", no_generate)
    (tmp_path / "file.txt").write_text("x")
    out = tmp_path if bad == "dir" else tmp_path / "file.txt" / "out.jsonl"
    assert main(["generate", "--out", str(out), "--quiet", "--max-tokens", "2"]) == 2
    assert str(out) in capsys.readouterr().err
