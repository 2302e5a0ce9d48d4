"""LoRA weights into vLLM, per sync: the merged model streamed (what actor.lora does today) against vLLM's adapter-only
path (`enable_lora`, a LoRARequest naming the adapter folder, a new id per sync). Prints a table of bytes and seconds
per sync and the rollout's seconds under each (vLLM's LoRA kernels on this build against its plain linears).

    OMP_NUM_THREADS=2 VLLM_CPU_OMP_THREADS_BIND=nobind python benchmarks/lora_vllm.py --rank 16 --syncs 3

Each sync: new adapter weights (B drawn again), then (merged) merge_into + stream_weights, or (adapter) save the PEFT
folder + the next generate with a LoRARequest of a new id (vLLM loads it on that call: its load is inside the first
rollout after the sync, so the table's "sync s" for the adapter path is the save alone and the load shows in the
rollout's seconds). The rollout: P prompts x n samples of --max-tokens tokens, temperature 1, ignore_eos."""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()

    import vllm
    from vllm.lora.request import LoRARequest

    from tailrl.model import load_model, resolve_model_path
    from tailrl.rl.actor.lora import add_adapters, merge_into
    from tailrl.config.actor import LoraCfg
    from tailrl.rl.actor.lora_io import save_adapter
    from tailrl.rollout.vllm.io import stream_weights
    from tailrl.rollout.vllm.llm import hf_folder

    folder = hf_folder(a.model)
    base, _ = load_model(a.model, device="cpu", dtype=torch.bfloat16)
    engine = copy.deepcopy(base)
    lora = LoraCfg(rank=a.rank, alpha=2 * a.rank)
    policy = add_adapters(copy.deepcopy(base), lora)
    prompts = [{"prompt_token_ids": [1] + [100 + 37 * i + j for j in range(40)]} for i in range(a.prompts)]
    sp = vllm.SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, ignore_eos=True, seed=0)
    llm = vllm.LLM(model=folder, dtype="bfloat16", seed=0, max_model_len=512, enforce_eager=True,
                   enable_lora=True, max_lora_rank=max(a.rank, 8), max_loras=1)
    tmp = Path(tempfile.mkdtemp(prefix="lora_vllm_"))
    rows = {"merged": [], "adapter": []}
    g = torch.Generator().manual_seed(0)
    for k in range(a.syncs):
        with torch.no_grad():  # "an update": new adapter weights
            for n, p in policy.named_parameters():
                if ".lora_B." in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        # merged: W + (alpha/r) B A into the engine copy, streamed by name into vLLM's plain linears
        t = time.perf_counter()
        merge_into(policy, engine)
        sent = stream_weights(llm, engine.state_dict().items(), torch.bfloat16, tied=True)
        sync_s = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        rows["merged"].append((sent, sync_s, time.perf_counter() - t))
        # adapter only: vLLM's base back, the adapter folder written, a LoRARequest of a new id per sync
        stream_weights(llm, base.state_dict().items(), torch.bfloat16, tied=True)
        t = time.perf_counter()
        path = tmp / f"sync{k}"
        save_adapter(policy, path, lora, str(resolve_model_path(a.model)))
        size = sum(f.stat().st_size for f in path.iterdir())
        sync_s = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False, lora_request=LoRARequest(f"sync{k}", k + 1, str(path)))
        rows["adapter"].append((size, sync_s, time.perf_counter() - t))
    print(f"{a.model} bf16, LoRA rank {a.rank} on all 7 projections; rollout {a.prompts} x {a.n} x {a.max_tokens} tokens;"
          f" {a.syncs} syncs, the first dropped from the means")
    print("| path | bytes per sync | sync s | rollout s after the sync | rollout vs merged |")
    print("|---|---|---|---|---|")
    mean = {k: [sum(x[i] for x in v[1:]) / max(len(v) - 1, 1) for i in range(3)] for k, v in rows.items()}
    for k, (b, s, r) in mean.items():
        print(f"| {k} | {b / 2**20:.1f} MiB | {s:.3f} | {r:.2f} | {mean['merged'][2] / r:.2f}x |")


if __name__ == "__main__":
    main()
