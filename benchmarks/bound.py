"""The physical bound of a decode step on this machine, and each engine's fraction of it, per batch size (issue 47).

Measured once: memory bandwidth (a large tensor's sum, and a copy, at the benchmark's threads) and the fp32 and bf16
matrix-product rates (a square product). A plain decode step of B sequences with L cached tokens must read every
weight once (the embedding only as B rows; a tied LM head reads the whole matrix) and the K/V it attends to
(B x L x bytes per token), and do 2 x weights x B multiply-adds plus the attention's 4 x B x L x heads x head_dim. Its
bound is max(bytes / bandwidth, flops / rate) a step, i.e. B / that tokens/s. Each engine's decode step at B is timed
(tailrl: the model runner's decode pass, plain or batch-invariant; vLLM: its generate of T new tokens minus 1, through
benchmarks/vllm_worker.py in vLLM's venv), and the table gives tokens/s and the fraction of the bound.

    .venv/bin/python benchmarks/bound.py [--batches 1 4 16 64] [--context 512] [--dtype float32] [--vllm-venv V]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def best(fn, repeats: int = 5) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def machine() -> dict:
    """Bytes/s of a 256 MiB fp32 sum and copy (8x the L3 of the CPUs we use); flop/s of a 1024^3 product in fp32 and
    bf16."""
    x = torch.ones(2**26)
    y = torch.empty_like(x)
    out = {"sum_Bps": x.numel() * 4 / best(lambda: x.sum()),
           "copy_Bps": 2 * x.numel() * 4 / best(lambda: y.copy_(x))}  # read + write
    del x, y
    for dt in (torch.float32, torch.bfloat16):
        a = torch.randn(1024, 1024).to(dt)
        out[f"mm_{str(dt)[6:]}"] = 2 * 1024**3 / best(lambda: a @ a, 3)
    return out


def step_bytes(cfg, B: int, L: int, itemsize: int) -> tuple[float, float]:
    """(bytes, flops) a plain decode step of B sequences over L cached tokens must read and do."""
    H, I, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = H * (qd + 2 * kvd) + qd * H + 3 * H * I
    weights = layers * per_layer + cfg.vocab_size * H  # the LM head reads the whole (tied) matrix
    kv = B * L * layers * 2 * kvd
    flops = 2 * weights * B + layers * 4 * B * L * qd
    return (weights + kv) * itemsize, flops


def tailrl_steps(batches, L: int, dtype, invariant: bool, steps: int) -> dict[int, float]:
    from tailrl.engine.runner import ModelRunner
    from tailrl.model import load_model

    model, _ = load_model("smollm2-135m", device="cpu", dtype=dtype)
    out = {}
    for B in batches:
        c = model.config  # the K/V this batch needs (fp32 at 1,000 tokens x 64 is over 2 GiB), with room to spare
        need = B * (L + 80) * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim
        r = ModelRunner(model, None if B > 64 else max(2**31, int(1.2 * need * dtype.itemsize)), B, L + 64,
                        invariant=invariant)
        g = torch.Generator().manual_seed(B)
        prompts = torch.randint(3, 49000, (B, L), generator=g).tolist()
        r.kv.ensure(list(range(B)), L + 8)
        with torch.inference_mode():
            for i in range(0, B, 8):
                r.prefill(prompts[i : i + 8], list(range(i, min(i + 8, B))))
            out[B] = best(lambda: r.decode([5] * B, [L] * B, None), steps)
        del r
    return out


def vllm_steps(venv: str, folder: str, batches, L: int, dtype: str, threads: int) -> dict[int, float] | str:
    py = Path(venv) / "bin" / "python"
    if not py.exists():
        return f"no vLLM venv at {venv} (benchmarks/vs_vllm.py makes one)"
    with tempfile.TemporaryDirectory() as d:
        job, out = Path(d) / "job.json", Path(d) / "out.json"
        job.write_text(json.dumps(dict(model=folder, dtype=dtype, seed=0, max_model_len=L + 64, kv_gb=2,
                                       sweep=dict(batches=batches, context=L, tokens=17))))
        p = subprocess.run([str(py), str(HERE / "vllm_worker.py"), str(job), str(out)], capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
        if p.returncode or not out.exists():
            return "vLLM failed: " + " | ".join((p.stderr or p.stdout).strip().splitlines()[-2:])
        return {int(b): s for b, s in json.loads(out.read_text())["step_s"].items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--invariant", action="store_true", help="also time tailrl's batch-invariant passes")
    ap.add_argument("--vllm-venv", default=str(Path.home() / ".cache" / "tailrl" / "vllm-venv"))
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent))
    torch.set_num_threads(args.threads)
    from tailrl.model.load import _gguf_cache_dir, load_model, resolve_model_path

    m = machine()
    print(f"machine ({args.threads} threads): sum {m['sum_Bps'] / 1e9:.1f} GB/s, copy {m['copy_Bps'] / 1e9:.1f} GB/s, "
          f"matmul fp32 {m['mm_float32'] / 1e9:.1f} GFLOP/s, bf16 {m['mm_bfloat16'] / 1e9:.2f} GFLOP/s", flush=True)
    dtype = getattr(torch, args.dtype)
    model, _ = load_model("smollm2-135m", device="cpu", dtype=dtype)
    cfg = model.config
    del model
    bw, rate = m["sum_Bps"], m[f"mm_{args.dtype}"]
    arms = {"tailrl": tailrl_steps(args.batches, args.context, dtype, False, args.steps)}
    if args.invariant:
        arms["tailrl invariant"] = tailrl_steps(args.batches, args.context, dtype, True, args.steps)
    path = resolve_model_path("smollm2-135m")
    folder = str(_gguf_cache_dir(path)) if path.endswith(".gguf") else path
    v = "skipped (--no-vllm)" if args.no_vllm else vllm_steps(args.vllm_venv, folder, args.batches, args.context,
                                                                 args.dtype, args.threads)
    if isinstance(v, str):
        print(f"vLLM: {v}")
    else:
        arms["vLLM"] = v
    print(f"\nSmolLM2-135M {args.dtype}, {args.context} cached tokens a sequence; bound = max(bytes / {bw / 1e9:.1f} GB/s, "
          f"flops / {rate / 1e9:.0f} GFLOP/s)\n")
    names = list(arms)
    print("| batch | MB a step | bound tok/s | " + " | ".join(f"{a} tok/s | {a} of bound" for a in names) + " |")
    print("|---|---|---|" + "---|---|" * len(names))
    for B in args.batches:
        nbytes, flops = step_bytes(cfg, B, args.context, dtype.itemsize)
        bound = B / max(nbytes / bw, flops / rate)
        cells = []
        for a in names:
            s = arms[a].get(B)
            cells += [f"{B / s:.0f}", f"{B / s / bound:.2f}"] if s else ["-", "-"]
        print(f"| {B} | {nbytes / 1e6:.0f} | {bound:.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
