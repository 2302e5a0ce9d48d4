"""Fixtures several test folders use (a folder's own are in its conftest.py); the tiny models they build are
tailrl/model/tiny.py's."""

import os

import pytest
import torch

from tailrl.model.tiny import TINY, make_tiny_checkpoint, make_tiny_chat_model

# OMP_NUM_THREADS, where set, wins: two suites side by side on 2 cores must not spin each other's OpenMP barriers
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster of 2 CPUs for a module's tests (`pytestmark = pytest.mark.usefixtures("local_ray")`)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture
def chunked_route(monkeypatch):
    """The batch-invariant passes' attention over fixed key chunks (model/chunked.py), as where our C kernel cannot be
    built (on a CPU it otherwise reads the cache in place, model/paged_attention.py)."""
    from tailrl.model import paged_attention

    monkeypatch.setattr(paged_attention, "_LIB", [None])
    monkeypatch.setattr(paged_attention, "_WHY", ["off for the test"])


@pytest.fixture(scope="session")
def smollm():
    from tailrl.model import load_model

    return load_model("smollm2-135m", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_smollm():
    from transformers import AutoModelForCausalLM

    from tailrl.model import resolve_model_path

    folder, fname = os.path.split(resolve_model_path("smollm2-135m"))
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32).eval()


@pytest.fixture(scope="session", params=list(TINY))
def tiny_ckpt(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny_{request.param}")
    hf = make_tiny_checkpoint(folder, request.param)
    return request.param, str(folder), hf


@pytest.fixture(scope="module")
def tiny_peaked(tmp_path_factory):
    """A tiny random Qwen2 with a 4-token vocabulary and peaked, context-dependent distributions."""
    from tests.helpers import peaked_tiny_model

    return peaked_tiny_model(tmp_path_factory.mktemp("tiny_v4"), vocab=4, scale=4.0)


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """A tiny chat model (24-word tokenizer) in a folder, for training tests."""
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("tinychat")))


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    from tests.rl_helpers import write_task

    return write_task(tmp_path_factory.mktemp("data") / "train.jsonl")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    """The tiny chat model loaded (fp32), for drafter tests."""
    from tailrl.model import load_model

    return load_model(str(make_tiny_chat_model(tmp_path_factory.mktemp("tinylm"))), device="cpu", dtype=torch.float32)
