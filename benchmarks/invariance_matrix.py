"""Batch invariance of the bf16 CPU passes across thread counts and oneDNN ISA caps, each in a process of its own:
the engine's start-up probe (engine/probe.py, the very check `tailrl train` and `generate` run at start, with its
call sizes), then a prompt of CHUNK + 40 tokens prefilled alone and beside a 30-token prompt and its last token
decoded. Where the probe holds but the bits differ, the probe misses what breaks on that machine.

    .venv/bin/python benchmarks/invariance_matrix.py [--threads 1 2 16] [--isas default AVX512_CORE_BF16 AVX2]
        [--model random | smollm2-135m]

--model random (the default) builds a random SmolLM2-135M-shaped model (no weights needed); smollm2-135m loads the
installed weights, the model the engine runs by default (on an Intel Xeon with AMX the probe failed end to end on it
while it held on the random model: issue 45).

Found on an Intel Xeon with AMX (a GPU host, torch 2.11, 2026-11-26): at 2 threads with the default ISA the prefill
beside another prompt and the decode step differed from the prefill alone while the probe held (session 19; fixed
by the probe's call sizes, session 20). On an Emerald Rapids with torch 2.13 the probe's product checks held on
random data while 4 rows differed (issue 45): the probe now checks on cancelling data (engine/probe_data.py)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

from tailrl.engine.kv_cache import KVCache
from tailrl.engine.probe import probe_invariance
from tailrl.model import ModelConfig, load_model
from tailrl.model.chunked import CHUNK
from tailrl.model.load import build_model
from tailrl.model.step import make_step

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def build(name: str):
    if name != "random":
        return load_model(name, device="cpu", dtype=torch.bfloat16)[0]
    import transformers

    torch.manual_seed(0)
    hf_cfg = transformers.AutoConfig.for_model("llama", **SMOLLM2_135M)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    return build_model(ModelConfig.from_hf(hf_cfg.to_dict()), dict(hf.state_dict()), "cpu", torch.bfloat16)


def check(threads: int, name: str) -> str:
    torch.set_num_threads(threads)
    model = build(name)
    verdict = probe_invariance(model)  # the engine's start-up probe; first: it sizes the product calls used below
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (CHUNK + 40,))
    short = torch.randint(0, model.config.vocab_size, (30,))
    with torch.inference_mode():
        kv = KVCache(model.config, 256 << 20, "cpu", torch.bfloat16)
        kv.layout(2, 2 * CHUNK)
        alone = model(ids, make_step([0], [len(ids)], [0], invariant=True), kv)[0]
        together = model(torch.cat([short, ids]), make_step([0, 0], [30, len(ids)], [1, 0], invariant=True), kv)[0]
        P = len(ids) - 1
        decode = model(ids[P:], make_step([P], [1], [0], invariant=True), kv)[0]
    rows = (together[30:] != alone).any(-1).nonzero().flatten().tolist()
    calls = ", ".join(f"{i}->{o}: {n}" for (o, i), n in verdict.call_rows.items() if n < 256)
    return (f"probe {verdict.summary()} ({verdict.seconds:.1f} s) | prefill beside another == alone: {not rows} "
            f"({len(rows)} rows differ) | decode == prefill: {torch.equal(decode, alone[-1:])} | "
            f"product calls below 256 rows: {calls or 'none'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 16])
    ap.add_argument("--isas", nargs="+", default=["default", "AVX512_CORE_BF16", "AVX2"])
    ap.add_argument("--model", default="random", help="random (SmolLM2-135M-shaped) or an installed model name")
    ap.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # the child: one check at these threads
    args = ap.parse_args()
    if args.one:
        print(check(args.one, args.model), flush=True)
        return
    print(f"torch {torch.__version__}, model {args.model}\n\n| threads | ONEDNN_MAX_CPU_ISA | result |\n|---|---|---|")
    for isa in args.isas:
        for threads in args.threads:
            env = dict(os.environ)
            env.pop("ONEDNN_MAX_CPU_ISA", None)
            if isa != "default":
                env["ONEDNN_MAX_CPU_ISA"] = isa
            run = subprocess.run([sys.executable, __file__, "--one", str(threads), "--model", args.model], env=env,
                                 capture_output=True, text=True, timeout=900)
            out = run.stdout.strip().splitlines()[-1] if run.returncode == 0 else f"failed: {run.stderr[-300:]}"
            print(f"| {threads} | {isa} | {out} |", flush=True)


if __name__ == "__main__":
    main()
