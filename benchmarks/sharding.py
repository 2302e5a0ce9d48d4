"""Per-rank memory of the sharded trainer (issue 28) for public Qwen configs, and the update's tokens/s on CPU at
trainer.world_size 1 and 2.

    .venv/bin/python benchmarks/sharding.py            # the memory table (meta device: no weights, no download)
    .venv/bin/python benchmarks/sharding.py --cpu      # and a tiny model trained at world_size 1 and 2, 1 thread a rank

Memory per rank, FSDP2 as tailrl/rl/actor/fsdp.py applies it (each parameter's dim 0 cut in N, padded):
  params fp32 master 4 B, grads fp32 4 B, AdamW moments 2 x 4 B, all / N (exact per-tensor shard sizes);
  gathered bf16: the root (embeddings, norm, head) plus two decoder layers (one computing, one prefetched);
  activations (stated estimate, not measured): Korthikanti et al. 2022, 34 x tokens x hidden bytes per layer in
  bf16 with fused attention and no recomputation, for a micro-batch of --tokens packed tokens per rank (they do
  not shrink with N: each rank runs its own micro-batches); with activation checkpointing
  (trainer.activation_checkpointing) 2 x tokens x hidden a layer plus one layer's 34 x tokens x hidden.
Not counted: the rollout engine's weights and KV cache when colocated (they are freed or slept during the update
on GPUs), the CUDA context (about 1 GB) and allocator fragmentation: "fits" leaves 10% of 80 GB for them."""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tailrl.model.config import ModelConfig  # noqa: E402
from tailrl.model.llama import CausalLM  # noqa: E402

# the public config.json values (huggingface.co/Qwen/<name>/blob/main/config.json)
QWEN = {
    "Qwen2.5-1.5B": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "Qwen3-8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False),
    "Qwen2.5-32B": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
COMMON = dict(rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768, hidden_act="silu")
GB = 1e9


def meta_model(cfg: dict) -> CausalLM:
    with torch.device("meta"):
        return CausalLM(ModelConfig.from_hf({**COMMON, **cfg}))


def shard_numel(shape, n: int) -> int:
    """Elements on the rank with the most: dim 0 cut in n chunks of ceil(d0 / n) (FSDP2's padding)."""
    rest = math.prod(shape[1:]) if len(shape) > 1 else 1
    return math.ceil(shape[0] / n) * rest


def per_rank(model: CausalLM, n: int, tokens: int, checkpointing: bool) -> dict:
    params = list(model.parameters())
    shard = sum(shard_numel(p.shape, n) for p in params)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    root = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("model.layers."))
    c = model.config
    per_layer = 34 * tokens * c.hidden_size
    acts = (c.num_hidden_layers * 2 * tokens * c.hidden_size + per_layer) if checkpointing else c.num_hidden_layers * per_layer
    out = {"params": 4 * shard, "grads": 4 * shard, "optimizer": 8 * shard, "gathered": 2 * (root + 2 * layer),
           "activations": acts}
    out["total"] = sum(out.values())
    return out


def memory_table(tokens: int, checkpointing: bool) -> list[str]:
    lines = [f"| model | parameters | ranks | params GB | grads GB | AdamW GB | gathered bf16 GB | activations GB "
             f"| total GB / rank | fits 80 GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, cfg in QWEN.items():
        model = meta_model(cfg)
        total = sum(p.numel() for p in model.parameters())
        for n in (1, 2, 4, 8, 16):
            m = per_rank(model, n, tokens, checkpointing)
            fits = "yes" if m["total"] <= 0.9 * 80 * GB else "no"
            lines.append(f"| {name} | {total / 1e9:.2f}B | {n} | {m['params'] / GB:.1f} | {m['grads'] / GB:.1f} | "
                         f"{m['optimizer'] / GB:.1f} | {m['gathered'] / GB:.1f} | {m['activations'] / GB:.1f} | "
                         f"{m['total'] / GB:.1f} | {fits} |")
    return lines


def cpu_update_rate(steps: int) -> list[str]:
    """perf/update_tokens_per_s of the tiny test model at world_size 1 and 2 (one thread a rank)."""
    import ray

    from tailrl.rl.run import train
    from tailrl.model.tiny import make_tiny_chat_model
    from tailrl.rl.smoke import tiny_cfg, write_task

    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    out = ["| world_size | update tokens/s (mean of steps 2..) | timing_s/update | timing_s/sync |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        chat, task = str(make_tiny_chat_model(d / "chat")), write_task(d / "train.jsonl")
        for world in (1, 2):
            run = train(tiny_cfg(chat, task, d / f"w{world}", "model.dtype=float32", f"trainer.steps={steps}",
                                 "trainer.save_every=0", f"trainer.world_size={world}", "trainer.loggers=[jsonl]"))
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][1:]
            mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
            out.append(f"| {world} | {mean('perf/update_tokens_per_s'):.0f} | {mean('timing_s/update'):.3f} | "
                       f"{mean('timing_s/sync'):.4f} |")
    ray.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="packed tokens per micro-batch per rank")
    ap.add_argument("--checkpointing", action="store_true", help="activations with trainer.activation_checkpointing")
    ap.add_argument("--cpu", action="store_true", help="also train the tiny model at world_size 1 and 2 on CPU")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    print(f"per-rank memory, micro-batch of {args.tokens} tokens, activation checkpointing "
          f"{'on' if args.checkpointing else 'off'}:")
    print("\n".join(memory_table(args.tokens, args.checkpointing)))
    if args.cpu:
        print("\nupdate on CPU, tiny model (2 layers, 64 wide), 4 prompts x 8 samples x 8 tokens a step, 1 thread a rank:")
        print("\n".join(cpu_update_rate(args.steps)))


if __name__ == "__main__":
    main()
