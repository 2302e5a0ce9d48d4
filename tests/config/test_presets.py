import dataclasses

import pytest

from tailrl.cli import main
from tailrl.config import Config, ConfigError, load_config
from tailrl.presets import preset_names

pytestmark = pytest.mark.slow  # the fast tier (pytest -m 'not slow') leaves out runs, processes and Ray


@pytest.mark.parametrize("name", preset_names())
def test_every_packaged_preset_validates(name):
    load_config(None, [], name)  # raises on a bad key or value, like any config


def test_the_long_preset_and_the_default_beside_it():
    long = load_config(None, [], "long")
    assert long.rollout.max_tokens >= 1024 and long.data.levels == [1, 2, 3, 4]
    assert long.trainer.out_dir == "runs/long"
    # the default run reads no preset: exactly the dataclass defaults
    assert dataclasses.asdict(load_config()) == dataclasses.asdict(Config())
    assert load_config().rollout.max_tokens == 96


def test_a_yaml_and_overrides_win_over_the_preset(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("rollout:\n  max_tokens: 512\n")
    assert load_config(str(y), [], "long").rollout.max_tokens == 512
    cfg = load_config(str(y), ["rollout.max_tokens=2048"], "long")
    assert cfg.rollout.max_tokens == 2048 and cfg.data.levels == [1, 2, 3, 4]


def test_an_unknown_preset_is_one_line_naming_the_presets(capsys):
    with pytest.raises(ConfigError, match="unknown preset 'lnog'; did you mean long"):
        load_config(None, [], "lnog")
    assert main(["train", "--preset", "nope", "trainer.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "presets: long" in err
