"""Tiny random checkpoints for smoke runs: an HF folder (config.json + safetensors, saved by transformers itself, so
names and layout are HF's) that `load_model`, `tailrl train model.path=...` and vLLM take, in a second on a CPU.

    from tailrl.model.tiny import make_tiny_chat_model
    make_tiny_chat_model("tiny")   # then: tailrl train model.path=tiny ...

One family, defined here once: `make_tiny_checkpoint` builds every kind (3 layers, 64 wide, 96 token ids; random
biases and norms so that every parameter matters to a comparison), `make_tiny_chat_model` adds a word-level
tokenizer with a chat template (cheap enough to train), `make_tiny_vllm_model` the shape vLLM's CPU kernels take
(head_dim 64). The weights are a function of (kind, seed, vocabulary) only."""

from __future__ import annotations

from pathlib import Path

import torch

# a kind: its model type and what differs from the family's shape (SHAPE)
TINY = {
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True, head_dim=24),
    "llama": dict(model_type="llama", tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}
TINY_EXTRA = {
    "tinychat": dict(model_type="llama", tie_word_embeddings=True),
    # vLLM's CPU attention takes head_dim 64 (and no rope_theta given: transformers' default, 10000)
    "vllm": dict(model_type="llama", tie_word_embeddings=True, hidden_size=128, intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64, rope_theta=None),
}
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)

TINY_WORDS = ["<pad>", "<s>", "<eos>", "<|user|>", "<|assistant|>", "a", "b", "c", "d", "e",
              "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+", "=", "####", "?"]
# the tiny chat model of tool runs: its words and the tags the calls and results use
TOOL_WORDS = TINY_WORDS + ["<calc>", "</calc>", "<lookup>", "</lookup>", "<|system|>", "<result>", "</result>"]
VLLM_WORDS = ["<pad>", "<s>", "<eos>", "<|user|>", "<|assistant|>"] + [f"w{i}" for i in range(59)]
VLLM_TOOL_WORDS = VLLM_WORDS[:5] + ["<|system|>", "<calc>", "</calc>", "<result>", "</result>", "+", "####"] + [
    str(d) for d in range(10)] + [f"w{i}" for i in range(42)]
# prompts of token ids for the tiny vLLM model (ids under 64): the audits' and the vLLM checks'
VLLM_PROMPTS = [[1, 3] + [5 + (7 * i + j) % 50 for j in range(12)] + [4] for i in range(6)]

CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}")


def make_tiny_checkpoint(folder, kind: str, seed: int = 0, vocab: int = 96, head_scale: float = 1.0,
                         perturb: bool = True):
    """A random tiny HF checkpoint of `kind` (TINY, TINY_EXTRA) in `folder`; returns the transformers model.
    perturb: random biases and norms (else transformers' init: ones and zeros); head_scale: the LM head's (above 1:
    peaked, context-dependent next-token distributions, so a chi-square sees a wrong one with few draws)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**SHAPE, **(TINY[kind] if kind in TINY else TINY_EXTRA[kind])}
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab, **{k: v for k, v in spec.items() if v is not None})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        if perturb:  # random biases and norms so that every parameter matters to the comparison
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
        if head_scale != 1.0:
            model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(folder)
    return model


def word_tokenizer(words: list[str], unk: str | None = "?", chat: bool = True):
    """A word-level fast tokenizer over `words` (whitespace split; the first three are pad, bos, eos); unk: the
    unknown word (None: unknown words read as pad, with no unk token); chat: CHAT_TEMPLATE as its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=unk or words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = {"unk_token": unk} if unk else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=words[0], bos_token=words[1], eos_token=words[2],
                                   **extra)
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_chat_model(folder, seed: int = 0, words=TINY_WORDS):
    """A tiny Llama with a 24-word tokenizer (or `words`, with the first five special ones and '?' among them) and a
    chat template: cheap enough to train in a test or a smoke run. Returns the folder."""
    make_tiny_checkpoint(folder, "tinychat", seed=seed, vocab=len(words))
    word_tokenizer(words).save_pretrained(folder)
    return folder


def make_tiny_vllm_model(folder, words=VLLM_WORDS, scale: float = 30.0, chat: bool = False) -> str:
    """A tiny Llama vLLM's CPU kernels take (head_dim 64) with a word-level tokenizer of 64 words. chat: a chat template
    (as make_tiny_chat_model's); scale: the LM head's (30: peaked, context-dependent next-token distributions)."""
    make_tiny_checkpoint(folder, "vllm", seed=0, vocab=len(words), head_scale=scale, perturb=False)
    word_tokenizer(words, unk=None, chat=chat).save_pretrained(folder)
    return str(folder)


def load_tiny(folder, kind: str = "llama", seed: int = 0, dtype=None, **kw):
    """`make_tiny_checkpoint` in `folder`, loaded by tailrl on the CPU (a CausalLM, no tokenizer)."""
    from .load import load_model

    make_tiny_checkpoint(folder, kind, seed=seed, **kw)
    return load_model(str(Path(folder)), device="cpu", dtype=dtype)[0]
