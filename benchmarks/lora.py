"""LoRA against full fine-tuning: peak memory (the process's peak RSS) and the policy update's time per step, on
SmolLM2-135M (real weights) and on Qwen2.5-1.5B's public configuration with random weights (benchmarks/gpu/models.py).

Each variant runs in a process of its own (peak RSS is per process) and holds what a one-process run holds:
- full: the fp32 master, its bf16 compute copy (which the engine also runs), AdamW's two fp32 moments and fp32
  gradients (rl/actor/precision.py, `train_compute=bfloat16`);
- lora-R: the frozen bf16 base, the engine's own bf16 copy (merged weights land there), fp32 adapters with their
  moments and gradients (rl/actor/lora.py).
The update is `policy_update` over a GRPO-shaped batch (random tokens), one AdamW step; the first update warms up,
the time reported is the mean of the next `--repeats`.

Memory guard: a variant runs only when its estimated resident size (weights, gradients and moments, computed from
the parameter counts, plus a margin for activations) fits in MemAvailable less `--reserve-gb`; otherwise the table
says what it would need. The machine is shared: nothing here may run it out of memory.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/lora.py [--models smollm2-135m,qwen2.5-1.5b] [--ranks 8,64]

`--worlds 1,2` instead: LoRA at `trainer.world_size` 1 and 2 (FSDP2 ranks, gloo; fsdp.apply_fsdp_lora), one process
a rank, each timing the same `policy_update` (the ranks split the batch's groups) and reporting its own peak RSS:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lora.py --models smollm2-135m --ranks 16 --worlds 1,2
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.update, from any directory

GB = 2**30


def mem_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def model_config(name: str):
    from benchmarks.gpu.models import RANDOM
    from tailrl.model import ModelConfig, resolve_model_path
    from tailrl.model.load import _load_gguf

    if name in RANDOM:
        return ModelConfig.from_hf(dict(RANDOM[name]))
    return ModelConfig.from_hf(_load_gguf(resolve_model_path(name))[0])


def param_counts(name: str, rank: int) -> tuple[int, int]:
    """(base parameters, adapter parameters at this rank over every projection), from the config alone."""
    from tailrl.model.llama import CausalLM

    cfg = model_config(name)
    with torch.device("meta"):
        m = CausalLM(cfg)
    base = sum(p.numel() for p in m.parameters())
    lin = [mod for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear) and n != "lm_head"]
    return base, sum(rank * (x.in_features + x.out_features) for x in lin)


def estimate(name: str, rank: int) -> int:
    """Bytes a variant holds: full 4 (master) + 4 (grad) + 8 (moments) + 2 (bf16 copy) + 2 (its grads) per
    parameter; LoRA 2 (base) + 2 (engine copy) per base parameter and 16 per adapter parameter; + 1.5 GB."""
    base, ad = param_counts(name, rank or 8)
    return (20 * base if rank == 0 else 4 * base + 16 * ad) + int(1.5 * GB)


def build(name: str, dtype: torch.dtype):
    from benchmarks.gpu.models import RANDOM
    from tailrl.model import load_model
    from tailrl.model.llama import CausalLM
    from tailrl.model.load import build_model

    if name not in RANDOM:
        return load_model(name, device="cpu", dtype=dtype)[0]
    cfg = model_config(name)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in CausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    sd = {k: (torch.ones(s, dtype=dtype) if "norm" in k else (torch.randn(s, generator=g) * 0.02).to(dtype))
          for k, s in shapes.items()}
    return build_model(cfg, sd, "cpu", dtype)


def watchdog(floor_gb: float = 1.0) -> None:
    """Exits this process (status 3) the moment the machine's MemAvailable falls under floor_gb: a variant that
    grows past its estimate stops itself before the machine runs out of memory."""
    import os
    import threading

    def watch():
        while True:
            if mem_available() < floor_gb * GB:
                print(f"stopped: MemAvailable under {floor_gb} GB", file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()


def run_one(name: str, rank: int, prompts: int, n: int, resp: tuple, micro: int, repeats: int) -> dict:
    import copy

    watchdog()

    from benchmarks.update import fake_completions
    from tailrl.config import AlgoCfg
    from tailrl.rl.actor.forward import make_batch
    from tailrl.rl.actor.lora import add_adapters
    from tailrl.config.actor import LoraCfg
    from tailrl.rl.actor.precision import Precision, make_adamw
    from tailrl.rl.actor.update import policy_update

    torch.manual_seed(0)
    if rank == 0:
        policy = build(name, torch.float32).requires_grad_(True)
        prec = Precision(policy, "bfloat16")  # the bf16 compute copy, which the engine runs too
        engine = prec.model
    else:
        policy = build(name, torch.bfloat16)
        engine = copy.deepcopy(policy)  # the engine's own copy: merged weights land there
        add_adapters(policy, LoraCfg(rank=rank, alpha=2 * rank))
        prec = Precision(policy, "float32")
        prec.mode = "bfloat16"
    trainable = [p for p in policy.parameters() if p.requires_grad]
    opt = make_adamw(trainable, lr=1e-5, betas=(0.9, 0.99))
    batch = make_batch(fake_completions(policy.config.vocab_size, prompts, n, plen=(50, 70), rlen=resp), pad=0)
    B = len(batch)
    algo = AlgoCfg(mini_batch_size=B, micro_batch_size=micro)
    adv = torch.randn(B, generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(1 + repeats):
        t = time.perf_counter()
        policy_update(prec, opt, None, batch, adv, algo, 1.0, random.Random(0), {})
        times.append(time.perf_counter() - t)
    del engine
    return {"update_s": sum(times[1:]) / repeats, "warmup_s": times[0], "tokens": batch.tokens, "seqs": B,
            "trainable": sum(p.numel() for p in trainable), "params": sum(p.numel() for p in policy.parameters()),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB}


def run_rank(name: str, rank: int, world: int, r: int, store: str, prompts: int, n: int, resp: tuple, micro: int,
             repeats: int) -> dict:
    """Trainer rank r of `world` with LoRA-`rank` (world 1: the one-process actor, which also holds the engine's bf16
    copy; world N: an FSDP2 rank, whose engine is the driver's, not in this process)."""
    import copy

    watchdog()

    import torch.distributed as dist

    from benchmarks.update import fake_completions
    from tailrl.config import AlgoCfg
    from tailrl.rl.actor.forward import make_batch
    from tailrl.rl.actor.fsdp import apply_fsdp_lora, local_bytes
    from tailrl.rl.actor.lora import add_adapters
    from tailrl.config.actor import LoraCfg
    from tailrl.rl.actor.precision import Precision, make_adamw
    from tailrl.rl.actor.ranks import Ranks
    from tailrl.rl.actor.update import policy_update

    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=r, world_size=world)
    torch.manual_seed(0)
    policy = build(name, torch.bfloat16)
    engine = copy.deepcopy(policy) if world == 1 else None  # at N ranks the engine is the driver's
    add_adapters(policy, LoraCfg(rank=rank, alpha=2 * rank))
    if world > 1:
        apply_fsdp_lora(policy)
    prec = Precision(policy, "float32")
    prec.mode = "bfloat16"
    opt = make_adamw([p for p in policy.parameters() if p.requires_grad], lr=1e-5, betas=(0.9, 0.99))
    batch = make_batch(fake_completions(policy.config.vocab_size, prompts, n, plen=(50, 70), rlen=resp), pad=0)
    algo = AlgoCfg(mini_batch_size=len(batch), micro_batch_size=micro)
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(1 + repeats):
        if world > 1:
            dist.barrier()
        t = time.perf_counter()
        policy_update(prec, opt, None, batch, adv, algo, 1.0, random.Random(0), {}, Ranks(r, world))
        times.append(time.perf_counter() - t)
    mem = local_bytes(policy, opt)
    del engine
    if world > 1:
        dist.destroy_process_group()
    return {"update_s": sum(times[1:]) / repeats, "tokens": batch.tokens, "seqs": len(batch),
            "params_gb": mem["params"] / GB, "optimizer_mb": mem["optimizer"] / 2**20,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB}


def worlds(name: str, rank: int, sizes: list[int], repeats: int, shape: tuple) -> None:
    """LoRA-rank at each world size: one process a rank (started together), each reporting its own numbers."""
    import tempfile

    p, n, lo, hi, micro = shape
    print(f"torch {torch.__version__}; {name} LoRA {rank}; {p} prompts x {n} samples; update = policy_update, one "
          "AdamW step, mean of the repeats after a warm-up; each rank a process")
    print(f"{'world':>5} {'rank':>4} {'update s':>9} {'peak RSS GB':>12} {'params GB':>10} {'AdamW MB':>9}")
    for world in sizes:
        store = tempfile.mktemp(prefix="lora_world_")
        procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", f"{name}:{rank}:{world}:{r}:{store}:{p}:{n}:"
                                   f"{lo}:{hi}:{micro}", "--repeats", str(repeats)], stdout=subprocess.PIPE, text=True)
                 for r in range(world)]
        for r, proc in enumerate(procs):
            out, _ = proc.communicate()
            if proc.returncode != 0:
                print(f"{world:>5} {r:>4} failed ({proc.returncode})")
                continue
            x = json.loads(out.strip().splitlines()[-1])
            print(f"{world:>5} {r:>4} {x['update_s']:>9.2f} {x['peak_rss_gb']:>12.2f} {x['params_gb']:>10.3f} "
                  f"{x['optimizer_mb']:>9.1f}   ({x['seqs']} seqs, {x['tokens']} tokens)", flush=True)


def pair(name: str, rank: int, repeats: int) -> None:
    """Update time only, full and LoRA in one process, alternating (the same load on both); one prompt x 8 samples."""
    import copy

    from benchmarks.update import fake_completions
    from tailrl.config import AlgoCfg
    from tailrl.rl.actor.forward import make_batch
    from tailrl.rl.actor.lora import add_adapters
    from tailrl.config.actor import LoraCfg
    from tailrl.rl.actor.precision import Precision, make_adamw
    from tailrl.rl.actor.update import policy_update

    watchdog()
    torch.manual_seed(0)
    base = build(name, torch.float32)
    full = copy.deepcopy(base).requires_grad_(True)
    lora = add_adapters(base.to(torch.bfloat16), LoraCfg(rank=rank, alpha=2 * rank))
    pl = Precision(lora, "float32")
    pl.mode = "bfloat16"
    arms = {"full": (Precision(full, "bfloat16"), make_adamw(list(full.parameters()), lr=1e-5)),
            f"lora-{rank}": (pl, make_adamw([p for p in lora.parameters() if p.requires_grad], lr=1e-5))}
    batch = make_batch(fake_completions(full.config.vocab_size, 1, 8, plen=(50, 70), rlen=(30, 100)), pad=0)
    algo = AlgoCfg(mini_batch_size=len(batch), micro_batch_size=8)
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(1))
    times = {k: [] for k in arms}
    for _ in range(1 + repeats):
        for k, (prec, opt) in arms.items():
            t = time.perf_counter()
            policy_update(prec, opt, None, batch, adv, algo, 1.0, random.Random(0), {})
            times[k].append(time.perf_counter() - t)
    for k, v in times.items():
        print(f"{k:<8} update s {sum(v[1:]) / repeats:.2f} (each: {', '.join(f'{x:.2f}' for x in v[1:])})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-1.5b")
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-full", action="store_true", help="the LoRA ranks only")
    ap.add_argument("--pair", type=int, default=0, help="rank R: time full and LoRA-R alternately in one process")
    ap.add_argument("--reserve-gb", type=float, default=3.0, help="memory left to the machine's other users")
    ap.add_argument("--worlds", default="", help="LoRA at these trainer world sizes (FSDP2 ranks), e.g. 1,2")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # name:rank:prompts:n:rlo:rhi:micro (child)
    ap.add_argument("--rank-of", default="", help=argparse.SUPPRESS)  # name:rank:world:r:store:p:n:lo:hi:micro (child)
    args = ap.parse_args()
    shapes = {"smollm2-135m": (2, 8, 30, 100, 8), "qwen2.5-1.5b": (1, 2, 30, 60, 2)}  # prompts, n, resp lo-hi, micro
    if args.rank_of:
        name, rank, world, r, store, p, n, lo, hi, micro = args.rank_of.split(":")
        print(json.dumps(run_rank(name, int(rank), int(world), int(r), store, int(p), int(n), (int(lo), int(hi)),
                                  int(micro), args.repeats)))
        return
    if args.worlds:
        name = args.models.split(",")[0]
        return worlds(name, int(args.ranks.split(",")[0]), [int(w) for w in args.worlds.split(",")], args.repeats,
                      shapes.get(name, (2, 4, 30, 120, 4)))
    if args.pair:
        return pair(args.models.split(",")[0], args.pair, args.repeats)
    if args.one:
        name, rank, p, n, lo, hi, micro = args.one.split(":")
        print(json.dumps(run_one(name, int(rank), int(p), int(n), (int(lo), int(hi)), int(micro), args.repeats)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; update = policy_update over one batch, "
          "one AdamW step; peak RSS of the variant's own process")
    print(f"{'model':<14} {'variant':<8} {'trainable':>11} {'batch':>12} {'update s':>9} {'vs full':>8} "
          f"{'peak RSS GB':>12} {'est. GB':>8}")
    for name in args.models.split(","):
        p, n, lo, hi, micro = shapes.get(name, (2, 4, 30, 120, 4))
        full_s = None
        for rank in ([] if args.no_full else [0]) + [int(r) for r in args.ranks.split(",")]:
            label = "full" if rank == 0 else f"lora-{rank}"
            need, avail = estimate(name, rank), mem_available()
            if need > avail - args.reserve_gb * GB:
                print(f"{name:<14} {label:<8} {'':>11} {'':>12} {'-':>9} {'':>8} {'not run':>12} {need / GB:>8.1f}"
                      f"   (needs ~{need / GB:.1f} GB; {avail / GB:.1f} GB available, {args.reserve_gb:g} kept free)")
                continue
            out = subprocess.run([sys.executable, __file__, "--one", f"{name}:{rank}:{p}:{n}:{lo}:{hi}:{micro}",
                                  "--repeats", str(args.repeats)], capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{name:<14} {label:<8} failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            full_s = r["update_s"] if rank == 0 else full_s
            ratio = f"{full_s / r['update_s']:.2f}x" if full_s else "-"
            print(f"{name:<14} {label:<8} {r['trainable'] / 1e6:>10.2f}M {r['seqs']:>3} x {r['tokens']:>5}t "
                  f"{r['update_s']:>9.2f} {ratio:>8} {r['peak_rss_gb']:>12.2f} {need / GB:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
