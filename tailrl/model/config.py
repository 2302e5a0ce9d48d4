"""Model configuration for the Llama family (Llama, SmolLM2, Qwen2, Qwen3), read from and written to HF config dicts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    pass


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Llama: bias on q, k, v, o
    qkv_bias: bool = False  # Qwen2: bias on q, k, v only
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict)  # other HF keys, kept so a saved config round-trips

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported architecture model_type={self.model_type!r}; tailrl supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of num_key_value_heads={self.num_key_value_heads}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    @classmethod
    def from_hf(cls, d: dict) -> ModelConfig:
        d = dict(d)
        model_type = d.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = d.get("architectures") or []
            raise UnsupportedModelError(
                f"unsupported architecture model_type={model_type!r} (architectures={archs}); "
                f"tailrl supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if d.get("use_sliding_window") or (model_type == "mistral" and d.get("sliding_window")):
            raise UnsupportedModelError(f"{model_type} with sliding-window attention is not supported")
        # transformers >= 5 keeps theta and scaling in rope_parameters; older configs use rope_theta + rope_scaling
        rope = dict(d.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        scaling = dict(d.get("rope_scaling") or {}) or rope
        if scaling:
            scaling["rope_type"] = scaling.get("rope_type", scaling.pop("type", "default"))
            if scaling["rope_type"] == "default" and len(scaling) == 1:
                scaling = {}
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError("partial rotary embeddings are not supported")
        eos = d.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        heads = d["num_attention_heads"]
        known = {
            "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
            "rope_scaling", "rope_parameters", "max_position_embeddings", "tie_word_embeddings",
            "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id",
        }
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling or None,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)) and model_type != "qwen3",
            qkv_bias=model_type == "qwen2" or (model_type == "qwen3" and bool(d.get("attention_bias", False))),
            qk_norm=model_type == "qwen3",
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=d.get("pad_token_id"),
            extra={k: v for k, v in d.items() if k not in known and not k.startswith("_")},
        )

    def to_hf(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "qkv_bias", "qk_norm", "rope_scaling")}
        d.update(self.extra)
        d.pop("quantization_config", None)
        d["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}[self.model_type]]
        if self.model_type == "qwen3":
            d["attention_bias"] = self.qkv_bias
        d["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id
        d["rope_scaling"] = self.rope_scaling
        d["torch_dtype"] = d.pop("dtype", "float32")
        return d
