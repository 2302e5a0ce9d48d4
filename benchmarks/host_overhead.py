"""Where a decode step's time goes, per batch size, SD off against SD auto: the forward, sampling and acceptance
(verify), drafting, and the rest (the speculator's feedback, bookkeeping). On a GPU the forward of a small model
is a few ms with CUDA graphs, so host work decides the step; a cProfile of the auto arm names its top costs.
Random weights in SmolLM2-135M's shape (host costs do not depend on the weights; acceptance does, so read
benchmarks/spec_rollout.py for that), random prompts, sampling at T=1 without EOS: every sequence runs the whole
length. Graph captures happen in an untimed warm-up run.

    .venv/bin/python benchmarks/host_overhead.py [--device cuda] [--batches 1 8 32 128] [--tokens 128] [--profile]
    .venv/bin/python benchmarks/host_overhead.py --tiny     # CPU: a 2-layer, 2048-word model, so that the host work
                                                            # shows as on a GPU (the forward takes ~1 ms)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import ModelConfig
from tailrl.model.load import build_model
from tailrl.speculative.config import SpecConfig

SMOLLM2_135M = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
TINY = dict(SMOLLM2_135M, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=2048)


def run(eng: Engine, B: int, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ps = torch.randint(3, eng.model.config.vocab_size, (B, 48), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=seed)
    t = time.perf_counter()
    outs = eng.generate(ps, params)
    return outs.stats, time.perf_counter() - t


def choices(st) -> str:
    counts: dict[str, int] = {}
    for per_bucket in st.choices.values():
        for arm, n in per_bucket.items():
            counts[arm] = counts.get(arm, 0) + n
    return ", ".join(f"{a} {n}" for a, n in sorted(counts.items(), key=lambda kv: -kv[1])[:4])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="cProfile the auto arm at the largest batch")
    ap.add_argument("--tiny", action="store_true", help="a tiny model of SmolLM2's kind: host costs without the forward")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.device == "cpu":
        torch.set_num_threads(2)
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY if args.tiny else SMOLLM2_135M)
    hf_cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device(args.device):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    model = build_model(ModelConfig.from_hf(hf_cfg.to_dict()), dict(hf.state_dict()), args.device, dtype)
    del hf
    where = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    shape = "tiny (2 layers, 64 wide, 2,048 words)" if args.tiny else "SmolLM2-135M shape"
    print(f"{shape}, random weights, {dtype}, {where}; {args.tokens} tokens per sequence, T=1\n")
    print("| batch | arm | ms per decode step | forward | verify (sampling) | drafting | rest (feedback, loop) | "
          "tok/s | auto / off | auto's choices |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    engines = {a: Engine(model, None, EngineConfig(max_num_seqs=max(args.batches), spec=SpecConfig(mode=a)))
               for a in ("off", "auto")}
    prof = None
    for B in args.batches:
        rates = {}
        for arm, eng in engines.items():
            run(eng, B, args.tokens, 1)  # warm-up: graph captures, the selector's first measurements
            if args.profile and arm == "auto" and B == max(args.batches):
                prof = cProfile.Profile()
                prof.enable()
            st, wall = run(eng, B, args.tokens, 2)
            if args.profile and arm == "auto" and B == max(args.batches):
                prof.disable()
            n = max(st.decode_steps, 1)
            ms = lambda s: f"{1000 * s / n:.2f}"  # noqa: E731
            rest = st.decode_s - st.forward_s - st.verify_s - st.draft_s
            rates[arm] = st.generated_tokens / (st.total_s - st.capture_s)
            rel = f"{rates['auto'] / rates['off']:.2f}x" if arm == "auto" else ""
            print(f"| {B} | {arm} | {ms(st.decode_s)} | {ms(st.forward_s)} | {ms(st.verify_s)} | {ms(st.draft_s)} | "
                  f"{ms(rest)} | {rates[arm]:.0f} | {rel} | {choices(st) if arm == 'auto' else ''} |")
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(f"\ncProfile of the auto arm at batch {max(args.batches)} (by own time):\n")
        print(out.getvalue())


if __name__ == "__main__":
    main()
