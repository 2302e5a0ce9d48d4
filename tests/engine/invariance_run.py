"""Run in a subprocess by tests/engine/test_invariant.py under one ONEDNN_MAX_CPU_ISA (oneDNN reads it once, at start):
the probe's verdict, and whether SD off and history drafting emit the very same bf16 tokens. Prints one JSON line.

The model has SmolLM2-135M's shapes (hidden 576, 9 heads over 3 K/V heads, 49,152-token head: the kernels a real
run meets) but 2 layers of random weights, its LM head scaled so that sampled responses repeat themselves and
history drafts get accepted. `--break-tiles` runs the matrix products on single rows (the construction undone), so
the probe has something to find where this CPU's kernels differ by row count."""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.engine.probe import probe_invariance
from tailrl.model.config import ModelConfig
from tailrl.model.llama import CausalLM
from tailrl.speculative.config import SpecConfig


def smol_shaped(seed: int = 0) -> CausalLM:
    cfg = ModelConfig(model_type="llama", head_dim=64, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=False, eos_token_id=[2])
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.02 if "norm" not in name else 0.1).add_(1.0 if "norm" in name else 0.0)
        model.lm_head.weight.mul_(12.0)
    return model.eval().to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--break-tiles", action="store_true")
    ap.add_argument("--generate", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("TAILRL_TEST_THREADS", "2")))
    if args.break_tiles:
        import tailrl.engine.probe as probe
        import tailrl.model.chunked as chunked

        probe.ROW_TILE = chunked.ROW_TILE = 1
    model = smol_shaped()
    verdict = probe_invariance(model)
    out = {"isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""), "ok": verdict.ok, "failed": verdict.failed,
           "probe_s": round(verdict.seconds, 3), "call_rows": {"x".join(map(str, k)): v for k, v in verdict.call_rows.items()}}
    if args.generate:
        prompts = [[1 + (7 * i + j) % 500 for j in range(5 + 3 * i)] for i in range(8)]
        params = SamplingParams(temperature=1.0, max_tokens=48, n=4, seed=3, ignore_eos=True)
        try:
            off = Engine(model, None, EngineConfig(kv_cache_gb=0.5, batch_invariant=True)).generate(prompts, params)
            eng = Engine(model, None, EngineConfig(kv_cache_gb=0.5, batch_invariant=True,
                                                   spec=SpecConfig(mode="history", min_match=1, epsilon=0.3)))
            # every step drafts, history at budget 4 and 15 in turn (3 and 15 on the chunked route: budgets are cut
            # to whole query blocks, of 16 rows in place and 4 chunked): the selector's own choice follows measured
            # times, so how much it drafts would depend on the machine's load
            history = [x for x in eng.speculator.selector.arms if x.drafter == "history"]
            arms = [history[2], history[-1]]
            assert [a.budget for a in arms] in ([4, 15], [3, 15]), eng.speculator.selector.arms
            turn = itertools.cycle(arms)
            eng.speculator.selector.choose = lambda batch, contexts=None, *_, **__: next(turn)
            eng.generate(prompts, params)  # the history of the second epoch
            on = eng.generate(prompts, params)
            out["identical"] = [a.token_ids for a in off] == [b.token_ids for b in on]
            out["differ"] = sum(a.token_ids != b.token_ids for a, b in zip(off, on))
            out["accepted"] = sum(o.stats["accepted"] for o in on)
        except RuntimeError as e:  # batch_invariant=true where the probe failed: the error must name it
            out["error"] = str(e)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
