"""Config help: the nearest keys for a typo, the choices for a bad value, the groups in `train --help`, and
`config show` (the resolved config as YAML that reads back, with each key's doc)."""

import pytest

from tailrl.cli import main
from tailrl.config import ConfigError, load_config, to_dict, valid_keys
from tailrl.config.help import did_you_mean


@pytest.mark.parametrize("typo, nearest", [
    ("algo.learning_rate", "algo.lr"),  # TRL's name
    ("rollout.temprature", "rollout.temperature"),  # a misspelling
    ("trainer.step", "trainer.steps"),  # a key cut short
    ("actor_rollout_ref.actor.optim.lr", "algo.lr"),  # verl's path: matched by its last part
    ("num_generations", "rollout.n"),
    ("data.max_response_length", "rollout.max_tokens"),
    ("algo.learning_rat", "algo.lr"),  # a typo of TRL's name
    ("num_generation", "rollout.n"),
    ("max_completion_len", "rollout.max_tokens"),
    ("beta", "algo.kl_coef"),
    ("data.train_batch_size", "trainer.prompts_per_step"),  # verl's
    ("data.train_batch_sise", "trainer.prompts_per_step"),  # a typo of verl's
    ("actor_rollout_ref.rollout.n", "rollout.n"),
])
def test_an_unknown_key_gets_the_nearest_valid_keys(typo, nearest):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{typo}=1"])
    msg = str(e.value)
    assert msg.startswith(f"unknown key '{typo}'; did you mean {nearest}") and "\n" not in msg
    assert len(msg) < 160  # not the list of every key


def test_suggestions_are_valid_keys_and_nothing_close_says_where_to_look():
    keys = valid_keys()
    for typo in ("algo.kl", "model.pth", "rollout.spec.mod", "trainer.logger"):
        near = did_you_mean(typo, keys)
        assert near and set(near) <= set(keys), typo
    with pytest.raises(ConfigError, match="config show"):
        load_config(None, ["zzz=1"])
    with pytest.raises(ConfigError, match="did you mean algo.lr"):  # a YAML file's keys too
        from tempfile import NamedTemporaryFile

        with NamedTemporaryFile("w", suffix=".yaml") as f:
            f.write("algo:\n  learning_rate: 1.0e-5\n")
            f.flush()
            load_config(f.name)


@pytest.mark.parametrize("override, key, choices", [
    ("algo.advantage=gpro", "algo.advantage", "grpo, dr_grpo (did you mean grpo?)"),
    ("model.dtype=bf16", "model.dtype", "auto, float32, bfloat16, float16 (did you mean bfloat16?)"),
    ("rollout.spec.mode=histroy", "rollout.spec.mode", "off, auto, history, ngram, learned"),
    ("cluster.placement=random", "cluster.placement", "histopipe, static"),
    ("rollout.backend=vlm", "rollout.backend", "tailrl, vllm (did you mean vllm?)"),
    ("algo.loss=gpso", "algo.loss", "ppo, gspo, cispo (did you mean gspo?)"),
])
def test_an_unknown_choice_lists_the_choices(override, key, choices):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(f"bad value '{override.split('=')[1]}' for {key}: choose one of {choices}")


def test_train_help_lists_the_groups(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for group in ("model", "data", "rollout.spec", "algo", "reward", "trainer", "drafter", "cluster"):
        assert f"\n  {group} " in out, group
    assert "tailrl config show" in out


def test_config_show_reads_back_with_docs(tmp_path, capsys):
    (tmp_path / "my.yaml").write_text("algo:\n  lr: 1.0e-5\nrollout:\n  spec:\n    mode: 'off'\n")
    assert main(["config", "show", str(tmp_path / "my.yaml"), "rollout.n=4", "data.levels=[]"]) == 0
    text = capsys.readouterr().out
    assert "  lr: 1.0e-05  # AdamW learning rate (the peak, with a schedule)\n" in text
    assert "    mode: 'off'  # off | auto" in text
    body = [line for line in text.splitlines() if ":" in line and not line.rstrip().endswith(":")
            and "#" not in line.split(":", 1)[1].split("  #")[0]]
    undocumented = [line for line in body if "  # " not in line]
    assert not undocumented, undocumented  # every key has its one-line doc
    (tmp_path / "shown.yaml").write_text(text)
    cfg = load_config(str(tmp_path / "shown.yaml"))
    assert to_dict(cfg) == to_dict(load_config(str(tmp_path / "my.yaml"), ["rollout.n=4", "data.levels=[]"]))
    assert cfg.algo.lr == 1e-5 and cfg.rollout.spec.mode == "off" and cfg.rollout.n == 4
    assert main(["config", "show", "algo.learning_rate=1"]) == 2
    assert "did you mean algo.lr?" in capsys.readouterr().err


def test_a_misspelled_builtin_reward_names_the_nearest():
    from tailrl.rl.rewards.runner import RewardRunner

    with pytest.raises(ValueError, match=r"'mth': choose one of math, .*verl \(did you mean math\?\)"):
        RewardRunner(["mth"])


def test_a_removed_key_says_why():
    with pytest.raises(ConfigError, match="drafter.spot_batch' was removed: the long tail has one definition"):
        load_config(None, ["drafter.spot_batch=4"])
