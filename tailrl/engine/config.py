"""Engine settings, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..speculative.config import SpecConfig


@dataclass
class EngineConfig:
    max_num_seqs: int = 256
    kv_cache_gb: float | None = None  # None: 25% of RAM (CPU, at most 8 GiB) or 60% of free GPU memory
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_prefill_tokens: int = 4096
    kv_watermark: float = 0.01  # share of KV blocks admission leaves free (running sequences grow into it)
    seed: int = 0
    capture_hidden: bool = False  # keep the target's last hidden states per token (drafter training data)
    cuda_graphs: bool = True  # replay decode/verify passes from CUDA graphs per bucket (only where the model is on CUDA)
    cuda_graph_mem_gb: float = 4.0  # device memory the graphs may take; buckets captured past it run eagerly
    pad_to_buckets: bool = False  # pad decode/verify passes to buckets without graphs too (eager; for tests)
    batch_invariant: bool | str = "auto"  # logits independent of the pass's shape (engine/invariant.py); auto: CPU bf16
    # requests whose prompts begin with the same whole blocks share them: a prompt's later requests (and other prompts
    # with its few-shot prefix) prefill only what differs (engine/scheduler.py). Off: every group prefills its prompt
    prefix_cache: bool | str = False  # auto: where the passes are batch-invariant (the same tokens either way)
    spec: SpecConfig = field(default_factory=lambda: SpecConfig(mode="off"))

    def __post_init__(self):
        if isinstance(self.spec, dict):
            self.spec = SpecConfig(**self.spec)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb={self.kv_cache_gb} must be > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")
        if not self.cuda_graph_mem_gb >= 0:
            raise ValueError(f"cuda_graph_mem_gb={self.cuda_graph_mem_gb} must be >= 0")
        if self.prefix_cache not in (True, False, "auto"):
            raise ValueError(f"prefix_cache={self.prefix_cache!r}: use true, false or auto")
        if self.batch_invariant not in (True, False, "auto"):
            raise ValueError(f"batch_invariant={self.batch_invariant!r}: use true, false or auto")
        if not 0 <= self.kv_watermark < 1:
            raise ValueError(f"kv_watermark={self.kv_watermark} must be in [0, 1)")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens={self.max_prefill_tokens} must be >= 1")
