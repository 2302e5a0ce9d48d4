"""LoRA adapters in and out in PEFT's format: a folder with `adapter_config.json` (PEFT's LoraConfig, naming the
base in `base_model_name_or_path`) and `adapter_model.safetensors` (keys `base_model.model.<module>.lora_A.weight`,
as `PeftModel.save_pretrained` writes them), which `peft.PeftModel.from_pretrained(transformers_base, folder)`
loads; the merged model as an HF folder; `load_any` for `tailrl eval` and `tailrl generate`.

Invariants: a folder written here holds exactly the adapters' fp32 tensors (never the base); loading checks every
adapter tensor's name and shape against the live model and the base's architecture recorded at save time, and a
mismatch is a ValueError naming the tensor or the field (an adapter trained on another base never loads
silently)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .lora import add_adapters, merged_state, peft_config
from ...config.actor import LoraCfg

PREFIX = "base_model.model."
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
ARCH = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "vocab_size")  # the base's fields an adapter depends on, recorded at save time


def is_adapter(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def adapter_state(model: nn.Module, gather: bool = False) -> dict[str, torch.Tensor]:
    """The adapters' tensors under PEFT's saved names (adapter name dropped, `base_model.model.` prefixed). gather:
    FSDP2 shards gathered whole (a collective: every rank calls it)."""
    from .lora import full

    return {PREFIX + n.replace(".default.", "."): full(p) if gather else p.detach()
            for n, p in model.named_parameters() if ".lora_" in n}


def param_name(key: str) -> str:
    """The model's parameter name of a PEFT-named adapter tensor (`adapter_state`'s names back)."""
    return key.removeprefix(PREFIX).replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")


def module_names(shapes: dict) -> dict:
    """{name: shape} with PEFT-named adapter tensors under the model's parameter names (as dcp/ saves them)."""
    return {param_name(n) if n.startswith(PREFIX) else n: s for n, s in shapes.items()}


def load_adapter_state(model: nn.Module, sd: dict[str, torch.Tensor], where: str = "the adapter") -> None:
    """PEFT-named tensors into the model's adapters (every one required, shapes checked)."""
    live = adapter_state(model)
    missing, extra = sorted(live.keys() - sd.keys()), sorted(sd.keys() - live.keys())
    if missing or extra:
        raise ValueError(f"{where} does not fit this model's adapters: missing {missing[:3]}, unexpected {extra[:3]} "
                         "(another base model, or other actor.lora.target_modules?)")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for k, t in sd.items():
            p = params[param_name(k)]
            if p.shape != t.shape:
                raise ValueError(f"{where}: tensor {k} has shape {tuple(t.shape)}, the model's is {tuple(p.shape)} "
                                 "(an adapter for another base model, or another rank?)")
            p.copy_(t)


def _arch(model: nn.Module) -> dict:
    hf = model.config.to_hf()
    return {k: hf.get(k) for k in ARCH}


def save_adapter(model: nn.Module, folder: Path, lora: LoraCfg, base_path: str,
                 state: dict[str, torch.Tensor] | None = None) -> None:
    """adapter_config.json + adapter_model.safetensors (fp32) into folder. state: the adapter's whole tensors
    (adapter_state(model, gather=True), which FSDP2 ranks gather together before rank 0 writes); default the
    model's own."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    peft_config(lora, base_path).save_pretrained(str(folder))
    sd = {k: v.float().contiguous().cpu() for k, v in (state if state is not None else adapter_state(model)).items()}
    save_file(sd, str(folder / WEIGHTS), metadata={"format": "pt", "tailrl_base_arch": json.dumps(_arch(model))})


def read_adapter(folder: Path) -> tuple[dict, dict[str, torch.Tensor], dict | None]:
    """(adapter_config, tensors, the base architecture recorded at save time or None)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        cfg = json.loads((folder / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{folder / CONFIG} does not read as JSON ({e})") from e
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder / CONFIG}: peft_type {cfg.get('peft_type')!r}; only LoRA adapters load here")
    with safe_open(str(folder / WEIGHTS), "pt") as f:
        meta = (f.metadata() or {}).get("tailrl_base_arch")
    return cfg, load_file(str(folder / WEIGHTS)), json.loads(meta) if meta else None


def lora_cfg_of(cfg: dict) -> LoraCfg:
    """Our settings from PEFT's adapter_config.json."""
    targets = cfg.get("target_modules") or []
    return LoraCfg(rank=int(cfg["r"]), alpha=float(cfg.get("lora_alpha", cfg["r"])),
                   target_modules=sorted(targets) if not isinstance(targets, str) else [targets],
                   dropout=float(cfg.get("lora_dropout", 0.0)))


def check_base(model: nn.Module, saved: dict | None, folder: Path, base: str) -> None:
    if saved is None:
        return
    live = _arch(model)
    diff = [k for k in ARCH if saved.get(k) != live.get(k)]
    if diff:
        k = diff[0]
        raise ValueError(f"adapter folder {folder} was trained on another base model than {base}: {k} is "
                         f"{saved.get(k)} there and {live.get(k)} here")


def load_any(path: str, device=None, dtype=None, base: str | None = None):
    """(CausalLM, tokenizer) of a model path (load_model's) or of an adapter folder: its base (named by its
    adapter_config, or `base`) with the adapter merged, in dtype."""
    from ...model import load_model
    from ...model.load import build_model, resolve_dtype

    if not is_adapter(path):
        return load_model(path, device=device, dtype=dtype)
    folder = Path(path)
    cfg, sd, arch = read_adapter(folder)
    base = base or cfg.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{folder / CONFIG} names no base model (base_model_name_or_path); give one")
    try:
        model, tokenizer = load_model(base, device=device, dtype=torch.float32)
    except FileNotFoundError as e:
        raise ValueError(f"the base model of adapter {folder} ({base}) does not load: {e}") from e
    check_base(model, arch, folder, base)
    try:
        add_adapters(model, lora_cfg_of(cfg))
    except ValueError as e:
        raise ValueError(f"adapter folder {folder} does not fit base {base}: {e}") from e
    load_adapter_state(model, sd, f"adapter folder {folder}")
    dtype = resolve_dtype(dtype, model.device)
    merged = build_model(model.config, merged_state(model, torch.float32), model.device, dtype)
    return merged, tokenizer


def save_merged(model: nn.Module, folder: Path, tokenizer=None) -> None:
    """The base with the adapter merged, as an HF folder (fp32)."""
    from ...model import save_pretrained
    from ...model.load import build_model

    save_pretrained(build_model(model.config, merged_state(model, torch.float32), model.device, torch.float32),
                    folder, tokenizer)
