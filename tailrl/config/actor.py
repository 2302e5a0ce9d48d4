"""The actor's settings (the `actor:` config section): LoRA, validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# Hugging Face's names of the Llama/Qwen attention and MLP projections (the layers LoRA adapts by default)
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraCfg:
    # LoRA's rank: 0 = off (full fine-tuning); > 0 trains W + (alpha / rank) B A on the target layers, W frozen
    # (Hu et al 2021); LoRA wants ~10x the full fine-tuning lr (with the default 3e-5, try algo.lr=3e-4; "LoRA
    # Without Regret", Schulman et al 2025, and verl say so); ranks 8-64 match full fine-tuning for outcome-reward RL
    rank: int = 0
    alpha: float = 32.0  # the adapter's scale is alpha / rank (PEFT's lora_alpha)
    # module names adapted (PEFT's target_modules: a layer whose name ends with one of them); default: every
    # attention and MLP projection
    target_modules: list[str] = field(default_factory=lambda: list(PROJECTIONS))
    dropout: float = 0.0  # dropout on the adapter's input while training (PEFT's lora_dropout)
    merged_export: bool = False  # the final checkpoint also holds merged/: the base with the adapter merged (HF fp32)

    def __post_init__(self):
        if self.rank < 0 or not self.alpha > 0:
            raise ValueError(f"actor.lora.rank must be >= 0 (0 = off) and alpha > 0 (got rank={self.rank}, "
                             f"alpha={self.alpha})")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"actor.lora.dropout must be in [0, 1) (got {self.dropout})")
        if self.rank and not self.target_modules:
            raise ValueError("actor.lora.target_modules is empty: name the layers to adapt (e.g. q_proj,v_proj)")
        bad = [t for t in self.target_modules if t in ("lm_head", "embed_tokens")]
        if bad:
            raise ValueError(f"actor.lora.target_modules: {bad[0]} cannot take an adapter here (the LM head and the "
                             "embedding stay full; adapt the projections: " + ", ".join(PROJECTIONS) + ")")


@dataclass
class ActorCfg:
    lora: LoraCfg = field(default_factory=LoraCfg)  # LoRA adapters instead of full fine-tuning

    def __post_init__(self):
        if isinstance(self.lora, dict):
            self.lora = LoraCfg(**self.lora)
        elif dataclasses.is_dataclass(self.lora):
            self.lora = LoraCfg(**dataclasses.asdict(self.lora))
