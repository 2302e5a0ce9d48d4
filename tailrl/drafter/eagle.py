"""EAGLE-style draft head: g_t = layer(fc([embed(x_{t+1}); h_t])), logits = lm_head(g_t).

h_t is the target's last hidden state (after the final norm) at position t and x_{t+1} the token that follows;
g_t predicts h_{t+1}, so lm_head(g_t) drafts x_{t+2}. Drafting further feeds g back in place of h. The head
is one decoder layer of the target's family without its input norm and without a final norm (EAGLE-1, the
layout SGLang's LlamaForCausalLMEagle / Qwen2ForCausalLMEagle load). Embedding and LM head are the
target's own, frozen and never stored here; the head can be cut to a draft vocabulary of frequent tokens
(SGLang's hot-token map), which matters for a small model whose LM head is a large share of its cost."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from pathlib import Path

import torch
from torch import nn

from ..model.config import ModelConfig
from ..model.llama import DecoderLayer
from ..model.rope import rope_cos_sin, rope_inv_freq

EAGLE_ARCH = {"llama": "LlamaForCausalLMEagle", "mistral": "LlamaForCausalLMEagle",
              "qwen2": "Qwen2ForCausalLMEagle", "qwen3": "Qwen3ForCausalLMEagle"}
VOCAB_FILE = "hot_token_ids.pt"  # SGLang: --speculative-token-map


class EagleDrafter(nn.Module):
    def __init__(self, target_cfg: ModelConfig, vocab: torch.Tensor | None = None):
        super().__init__()
        self.config = dataclasses.replace(target_cfg, num_hidden_layers=1, extra=dict(target_cfg.extra))
        H = target_cfg.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.layer = DecoderLayer(self.config, 0)
        self.layer.input_layernorm = nn.Identity()
        self.register_buffer("inv_freq", rope_inv_freq(self.config), persistent=False)
        self.register_buffer("vocab", torch.empty(0, dtype=torch.long) if vocab is None else vocab.long(), persistent=False)
        self._target: list = []  # the target model, not a submodule: its weights are neither trained nor saved here
        self._head: torch.Tensor | None = None
        with torch.no_grad():  # start as "copy the hidden state": fc = [0 | I], so g ~ h before any training
            self.fc.weight.zero_()
            self.fc.weight[:, H:] = torch.eye(H)
            self.fc.bias.zero_()

    # ---- the target's frozen parts -----------------------------------------------------------------------

    def bind(self, target) -> EagleDrafter:
        if target.config.hidden_size != self.config.hidden_size or target.config.vocab_size != self.config.vocab_size:
            raise ValueError(f"drafter (hidden {self.config.hidden_size}, vocab {self.config.vocab_size}) does not "
                             f"fit the target (hidden {target.config.hidden_size}, vocab {target.config.vocab_size})")
        self._target = [target]
        self.sync_head()
        return self

    @property
    def target(self):
        if not self._target:
            raise RuntimeError("the drafter is not bound to a target model; call bind(target)")
        return self._target[0]

    def sync_head(self) -> None:
        """Re-reads the target's LM head rows of the draft vocabulary (after the policy's weights moved)."""
        w = self.target.lm_head.weight.detach()
        self._head = w[self.vocab.to(w.device)].to(self.fc.weight.dtype) if len(self.vocab) else w

    def head(self) -> torch.Tensor:
        if self._head is None:
            self.sync_head()
        return self._head

    def trained_state(self) -> dict:
        """The weights the drafter trainer learns, by part ({"fc": ..., "layer": ...}); the LM head rows are the
        target's (`sync_head`), the vocabulary is set apart (`set_vocab`)."""
        return {"fc": self.fc.state_dict(), "layer": self.layer.state_dict()}

    @torch.no_grad()
    def load_trained(self, state: dict) -> None:
        """Copies the trained weights from a `trained_state()` (another head's, a worker's, a checkpoint's) into
        this head's own tensors, cast to their dtype and device."""
        self.fc.load_state_dict(state["fc"])
        self.layer.load_state_dict(state["layer"])

    def set_vocab(self, vocab: torch.Tensor) -> None:
        self.vocab = vocab.long().to(self.fc.weight.device)
        if self._target:
            self.sync_head()

    @property
    def draft_vocab_size(self) -> int:
        return len(self.vocab) if len(self.vocab) else self.config.vocab_size

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        return self.vocab[idx] if len(self.vocab) else idx

    # ---- forwards ------------------------------------------------------------------------------------------

    def _inputs(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        emb = self.target.model.embed_tokens(next_ids).detach()
        return self.fc(torch.cat((emb.to(hidden.dtype), hidden), dim=-1))

    def step(self, hidden: torch.Tensor, next_ids: torch.Tensor, step, kv) -> torch.Tensor:
        """Cached forward over packed positions (hidden [T, H], next_ids [T]) described by StepMeta."""
        x = self._inputs(hidden, next_ids)
        cos, sin = rope_cos_sin(self.inv_freq, step.positions, x.dtype)
        return self.layer(x, cos, sin, step, kv)

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal forward over whole sequences (hidden [B, L, H], next_ids [B, L], positions [B, L] or
        0..L-1); differentiable."""
        x = self._inputs(hidden, next_ids)
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)[None]
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        return self.layer(x, cos, sin, attn_mask=attn_mask)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd]."""
        return g @ self.head().t()

    def trainable(self) -> list[nn.Parameter]:
        return list(self.fc.parameters()) + list(self.layer.parameters())


def choose_vocab(counts: torch.Tensor, size: int, always: list[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids (counts [V]) plus `always` (EOS and other stop tokens), sorted."""
    V = counts.shape[0]
    if size <= 0 or size >= V:
        return torch.empty(0, dtype=torch.long)
    keep = set(int(t) for t in always if 0 <= t < V)
    order = torch.argsort(counts.float(), descending=True, stable=True)
    ids = keep | set(order[: max(size - len(keep), 0)].tolist())
    return torch.tensor(sorted(ids), dtype=torch.long)


def save_drafter(drafter: EagleDrafter, folder: str | Path, meta: dict | None = None, embeddings: bool = False) -> Path:
    """The EAGLE layout SGLang and vLLM load: config.json (the target's family, one layer), model.safetensors
    (fc.*, layers.0.*), and hot_token_ids.pt when the head uses a draft vocabulary. `embeddings` also stores
    the target's embedding (embed_tokens.weight) for loaders that do not take it from the target."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {f"fc.{k}": v for k, v in drafter.fc.state_dict().items()}
    sd.update({f"layers.0.{k}": v for k, v in drafter.layer.state_dict().items()})
    if embeddings:
        sd["embed_tokens.weight"] = drafter.target.model.embed_tokens.weight
    sd = {k: v.detach().contiguous().cpu() for k, v in sd.items()}
    tmp = folder / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / "model.safetensors")
    cfg = drafter.config.to_hf()
    cfg["architectures"] = [EAGLE_ARCH[drafter.config.model_type]]
    cfg["num_hidden_layers"] = 1
    cfg["torch_dtype"] = str(drafter.fc.weight.dtype).removeprefix("torch.")
    cfg["tailrl"] = {"draft_vocab_size": drafter.draft_vocab_size, **(meta or {})}
    if len(drafter.vocab):
        cfg["hot_vocab_size"] = len(drafter.vocab)
        torch.save(drafter.vocab.cpu().clone(), folder / VOCAB_FILE)
    else:
        (folder / VOCAB_FILE).unlink(missing_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def load_drafter(folder: str | Path, target=None, device=None, dtype=None) -> EagleDrafter:
    """Reads a folder written by save_drafter (or an EAGLE-1 checkpoint of the same layout)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(f"{folder} is not a drafter folder (config.json + model.safetensors expected)")
    hf = json.loads((folder / "config.json").read_text())
    hf["num_hidden_layers"] = 1
    cfg = ModelConfig.from_hf(hf)
    cfg.extra.pop("tailrl", None)
    cfg.extra.pop("hot_vocab_size", None)
    vocab = None
    if (folder / VOCAB_FILE).is_file():  # weights_only: tensors and plain containers only, never code from the file
        try:
            vocab = torch.load(folder / VOCAB_FILE, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:  # a type outside weights_only's allow-list: refused before it runs
            raise ValueError(f"{folder / VOCAB_FILE} holds more than a tensor ({str(e).splitlines()[0]})") from None
        if not isinstance(vocab, torch.Tensor) or vocab.dim() != 1 or vocab.is_floating_point() or (
                len(vocab) and not 0 <= int(vocab.min()) <= int(vocab.max()) < cfg.vocab_size):
            raise ValueError(f"{folder / VOCAB_FILE} is not a 1-D tensor of token ids below {cfg.vocab_size}")
    drafter = EagleDrafter(cfg, vocab)
    sd = load_file(str(folder / "model.safetensors"))
    sd.pop("embed_tokens.weight", None)
    fc = {k[3:]: v for k, v in sd.items() if k.startswith("fc.")}
    layer = {k[9:]: v for k, v in sd.items() if k.startswith("layers.0.") and "input_layernorm" not in k}
    if "bias" not in fc:  # TLT / some EAGLE checkpoints have no fc bias
        fc["bias"] = torch.zeros(cfg.hidden_size)
    drafter.load_trained({"fc": fc, "layer": layer})
    if target is not None:
        device = device or target.device
        dtype = dtype or target.dtype
    drafter.to(device=device or "cpu", dtype=dtype or torch.float32)
    if target is not None:
        drafter.bind(target)
    return drafter
