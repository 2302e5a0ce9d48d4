"""tailrl engine vs transformers `generate` on SmolLM2-135M (fp32, CPU), side by side in one run.

(a) batch 1, greedy, fixed length; (b) 32 requests with a long-tailed spread of max lengths (most short,
a few 8x longer), where static batching keeps computing for finished rows. Also: the engine's per-step
overhead at batch 1 against a bare model forward, and each case's peak memory (each runs in its own process).

    .venv/bin/python benchmarks/engine.py [--tokens 128] [--short 32] [--long 256] [--repeats 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import tempfile
import time

PROMPT = [{"role": "user", "content": "Tell me a long story about a robot who learns to paint."}]


def tail_lengths(short: int, long: int) -> list[int]:
    return [long if i % 8 == 7 else short for i in range(32)]  # 28 short, 4 long


def _prompts(tok, n):
    topics = ["a robot", "the ocean", "a city at night", "mathematics", "a cat", "winter", "trains", "music"]
    return [tok.apply_chat_template([{"role": "user", "content": f"Write about {topics[i % 8]} ({i})."}],
                                    add_generation_prompt=True, tokenize=False) for i in range(n)]


def run_case(kind: str, case: str, hf_dir: str, args: dict, out: mp.Queue):
    import torch

    torch.set_num_threads(2)
    torch.manual_seed(0)
    if kind == "tailrl":
        from tailrl.engine import Engine, EngineConfig, SamplingParams
        from tailrl.model import load_model

        model, tok = load_model(hf_dir, device="cpu", dtype=torch.float32)
        eng = Engine(model, tok, EngineConfig(kv_cache_gb=2.0))
        eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        if case == "a":
            ids = [eng.encode(PROMPT)]
            params = [SamplingParams(temperature=0, max_tokens=args["tokens"], ignore_eos=True)]
        else:
            ids = [tok.encode(p, add_special_tokens=False) for p in _prompts(tok, 32)]
            params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in tail_lengths(args["short"], args["long"])]
        t = time.perf_counter()
        comps = eng.generate(ids, params)
        dt = time.perf_counter() - t
        useful = sum(len(c.token_ids) for c in comps)
        extra = {}
        if case == "a":
            st = eng.last_stats
            extra["engine_step_ms"] = 1000 * st.decode_s / st.decode_steps
            extra["bare_forward_ms"] = bare_forward_ms(eng, ids[0], args["tokens"])
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(hf_dir)
        tok.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        if case == "a":
            texts, lens = [tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)], [args["tokens"]]
        else:
            texts, lens = _prompts(tok, 32), tail_lengths(args["short"], args["long"])
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)  # warm-up
            t = time.perf_counter()
            # static batching: the batch runs until its longest request is done; shorter ones are cut after
            model.generate(**enc, max_new_tokens=max(lens), min_new_tokens=max(lens), do_sample=False,
                           pad_token_id=tok.pad_token_id)
            dt = time.perf_counter() - t
        useful = sum(lens)
        extra = {}
    out.put(dict(kind=kind, case=case, seconds=dt, tokens=useful,
                 peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **extra))


def bare_forward_ms(eng, prompt_ids: list[int], n: int) -> float:
    """Model forward alone at batch 1 for the same cache lengths the engine saw (no scheduling or sampling)."""
    import torch

    from tailrl.model import make_step

    P = len(prompt_ids)
    eng.kv.ensure([0], P + n + 1)
    with torch.inference_mode():
        eng.model(torch.tensor(prompt_ids), make_step([0], [P], [0]), eng.kv)
        ids = torch.tensor([prompt_ids[-1]])
        steps = [make_step([P + i], [1], [0]) for i in range(n)]
        t = time.perf_counter()
        for s in steps:
            eng.model(ids, s, eng.kv)
        return 1000 * (time.perf_counter() - t) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--long", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    args = vars(ap.parse_args())
    from tailrl.model import load_model, save_pretrained

    model, tok = load_model("smollm2-135m", device="cpu")
    hf_dir = tempfile.mkdtemp(prefix="tailrl-bench-")
    save_pretrained(model, hf_dir, tok)
    del model
    ctx = mp.get_context("spawn")
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args["repeats"]):
        for case in ("a", "b"):
            for kind in ("tailrl", "transformers"):  # interleaved so machine noise hits both alike
                q = ctx.Queue()
                p = ctx.Process(target=run_case, args=(kind, case, hf_dir, args, q))
                p.start()
                r = q.get()
                p.join()
                results.setdefault((kind, case), []).append(r)
    best = {k: min(v, key=lambda r: r["seconds"]) for k, v in results.items()}
    names = {"a": f"(a) batch 1, {args['tokens']} tokens", "b": f"(b) 32 requests, 28x{args['short']} + 4x{args['long']} tokens"}
    print(f"\nSmolLM2-135M fp32, CPU, greedy; best of {args['repeats']} per cell\n")
    print("| case | tailrl tok/s | transformers tok/s | ratio | tailrl peak RSS MB | transformers peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for case in ("a", "b"):
        t, h = best[("tailrl", case)], best[("transformers", case)]
        tt, ht = t["tokens"] / t["seconds"], h["tokens"] / h["seconds"]
        print(f"| {names[case]} | {tt:.1f} | {ht:.1f} | {tt / ht:.2f}x | {t['peak_rss_mb']:.0f} | {h['peak_rss_mb']:.0f} |")
    a = best[("tailrl", "a")]
    print(f"\nbatch-1 decode step: engine {a['engine_step_ms']:.2f} ms vs bare model forward {a['bare_forward_ms']:.2f} ms "
          f"(engine overhead {100 * (a['engine_step_ms'] / a['bare_forward_ms'] - 1):+.1f}%)")


if __name__ == "__main__":
    main()
