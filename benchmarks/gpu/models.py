"""Models for the device benchmarks (benchmarks/gpu/cost.py, benchmarks/gpu/vs_hf.py): the packaged SmolLM2-135M with
its real weights, or random weights in the public configurations of larger models (speed figures that do not
depend on acceptance). Each comes as a tailrl CausalLM and a transformers model sharing the same weights."""

from __future__ import annotations

import tempfile

import torch

# config.json values of the public checkpoints (Qwen/Qwen2.5-1.5B-Instruct, Qwen/Qwen3-8B), as published
RANDOM = {
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_dtype(device: str) -> str:
    return "bfloat16" if device.startswith("cuda") else "float32"


def describe(name: str, device: str, dtype: str) -> str:
    where = torch.cuda.get_device_name(0) if device.startswith("cuda") else "CPU"
    weights = "random weights, public config" if name in RANDOM else "real weights"
    return f"{name} ({weights}), {dtype}, {where}, torch {torch.__version__}"


def load_pair(name: str, device: str, dtype: str, hf: bool = True):
    """(tailrl model, tokenizer or None, transformers model or None) on device in dtype, with shared weights for
    the random ones and identical weights (one checkpoint) for the real one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tailrl.model import ModelConfig, load_model, save_pretrained
    from tailrl.model.load import build_model

    dt = DTYPES[dtype]
    if name in RANDOM:
        spec = dict(RANDOM[name])
        cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
        torch.manual_seed(0)
        with torch.device(device):
            ref = AutoModelForCausalLM.from_config(cfg, dtype=dt).eval()
        model = build_model(ModelConfig.from_hf(cfg.to_dict()), dict(ref.state_dict()), device, dt)
        return model, None, ref if hf else None
    model, tok = load_model(name, device=device, dtype=dt)
    if not hf:
        return model, tok, None
    folder = tempfile.mkdtemp(prefix="tailrl-bench-")
    save_pretrained(model, folder, tok)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=dt).to(device).eval()
    return model, tok, ref


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
