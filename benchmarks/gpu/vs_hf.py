"""tailrl against transformers on the same device and dtype (issue 11): parity, then decode speed.

`parity`: logits of whole prompts (tailrl's cached forward against HF's forward) and greedy generation (the
engine against HF `generate`, one prompt at a time so HF pads nothing); a differing greedy token is allowed only
where HF's own two best logits tie within --tie.
`speed`: decode tokens/s at batch 1, 8 and 64 (B x (T - 1) tokens over the time a T-token generate takes beyond
a 1-token one, so prefill is left out alike), and the long-tailed batch of benchmarks/engine.py (32 requests,
28 x 32 + 4 x 256 tokens; useful tokens over wall time; HF batches statically). tailrl with CUDA graphs on and
off (on CPU only "off" runs), against HF `generate`.

    .venv/bin/python benchmarks/gpu/vs_hf.py parity [--model smollm2-135m] [--device cuda] [--dtype bfloat16]
    .venv/bin/python benchmarks/gpu/vs_hf.py speed [--model qwen2.5-1.5b] [--tokens 128]
"""

from __future__ import annotations

import argparse
import time

import torch

from models import DTYPES, default_dtype, describe, load_pair

from tailrl.engine import Engine, EngineConfig, SamplingParams
from tailrl.model import make_step

CHATS = ["List the first ten prime numbers.", "Count from 1 to 20 separated by commas.",
         "What is the capital of Japan? Answer in one sentence.", "Spell the word 'banana' letter by letter.",
         "Write a haiku about the sea.", "Explain what a hash table is in two sentences."]


def prompts(tok, vocab: int, n: int, length: int = 48) -> list[list[int]]:
    if tok is not None:
        texts = [tok.apply_chat_template([{"role": "user", "content": CHATS[i % len(CHATS)] + f" ({i})"}],
                                         add_generation_prompt=True, tokenize=False) for i in range(n)]
        return [tok.encode(t, add_special_tokens=False) for t in texts]
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def engine(model, tok, graphs: bool) -> Engine:
    return Engine(model, tok, EngineConfig(cuda_graphs=graphs, max_num_seqs=128))


def parity(model, tok, ref, device: str, tokens: int, tie: float) -> None:
    from tailrl.engine.kv_cache import KVCache

    ps = prompts(tok, model.config.vocab_size, 6)
    kv = KVCache(model.config, 2**30, device, model.dtype)
    kv.layout(1, 1024)
    kv.touch(1024)
    diffs, agree, n = [], 0, 0
    for p in ps:
        ids = torch.tensor(p, device=device)
        a = model(ids, make_step([0], [len(p)], [0], device), kv)[0].float()
        b = ref(ids[None]).logits[0].float()
        diffs.append(float((a - b).abs().max()) / float(b.std()))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        n += len(p)
    print(f"\nLogits of {len(ps)} prompts: max |tailrl - HF| / std(HF logits) = {max(diffs):.3g}; "
          f"top-1 agreement {agree}/{n} positions")
    eng = engine(model, tok, True)
    outs = eng.generate(ps, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    eos = ref.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    same = tied = 0
    for k, (p, c) in enumerate(zip(ps, outs)):
        ids = torch.tensor([p], device=device)
        # no min_new_tokens: it masks EOS in HF's logits, so HF would take the runner-up where the engine (which
        # ignores EOS only to keep going) emits EOS; both are compared up to the first EOS instead
        hf = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                          do_sample=False)[0, len(p):].tolist()
        ours, hf = _until_eos(c.token_ids, eos), _until_eos(hf, eos)
        i = next((j for j, (x, y) in enumerate(zip(ours, hf)) if x != y), None)
        if i is None and len(ours) != len(hf):  # one stopped at EOS where the other went on
            i = min(len(ours), len(hf))
        if i is None:
            same += 1
            continue
        top2 = torch.topk(ref(torch.tensor([p + hf[:i]], device=device)).logits[0, -1].double(), 2).values
        margin = float(top2[0] - top2[1])
        tied += margin < tie
        print(f"  prompt {k}: first differs at token {i}, HF top-2 margin {margin:.3g}"
              f" ({'a tie' if margin < tie else 'NOT a tie'})")
    print(f"Greedy, {tokens} tokens: {same}/{len(ps)} identical, {tied} differ at a tie (< {tie}), "
          f"{len(ps) - same - tied} differ otherwise")


def _until_eos(ids: list[int], eos: set[int]) -> list[int]:
    """ids up to and including the first EOS."""
    i = next((j for j, t in enumerate(ids) if t in eos), None)
    return list(ids) if i is None else list(ids[: i + 1])


def timed(fn, repeats: int = 2) -> float:
    """Best of `repeats` wall times."""
    best = float("inf")
    for _ in range(repeats):
        sync_dev()
        t = time.perf_counter()
        fn()
        sync_dev()
        best = min(best, time.perf_counter() - t)
    return best


def sync_dev() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def tailrl_rate(eng: Engine, ps, lens: list[int]) -> float:
    eng.generate(ps[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lens]
    return timed(lambda: eng.generate(ps, params))


def hf_rate(ref, ps, new: int, device: str) -> float:
    ids = torch.tensor(ps, device=device)  # equal lengths: no padding
    mask = torch.ones_like(ids)
    ref.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=4, do_sample=False)  # warm-up
    return timed(lambda: ref.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                      do_sample=False))


def speed(model, tok, ref, device: str, tokens: int, batches: list[int], tail: list[int]) -> None:
    arms = ["graphs", "eager"] if device.startswith("cuda") else ["eager"]
    engines = {a: engine(model, tok, a == "graphs") for a in arms}
    print(f"\nDecode tokens/s, greedy, {tokens} tokens per sequence, prompts of 48 random tokens\n")
    print("| batch | " + " | ".join(f"tailrl {a} tok/s" for a in arms) + " | transformers tok/s | "
          + " | ".join(f"{a} / transformers" for a in arms) + " |")
    print("|---" * (2 + 2 * len(arms)) + "|")
    for B in batches:
        ps = prompts(None, model.config.vocab_size, B)
        rates = {a: B * (tokens - 1) / (tailrl_rate(e, ps, [tokens] * B) - tailrl_rate(e, ps, [1] * B))
                 for a, e in engines.items()}
        hf = B * (tokens - 1) / (hf_rate(ref, ps, tokens, device) - hf_rate(ref, ps, 1, device))
        print(f"| {B} | " + " | ".join(f"{rates[a]:.0f}" for a in arms) + f" | {hf:.0f} | "
              + " | ".join(f"{rates[a] / hf:.2f}x" for a in arms) + " |")
    lens = [tail[1] if i % 8 == 7 else tail[0] for i in range(32)]  # benchmarks/engine.py's tail_lengths
    ps = prompts(None, model.config.vocab_size, 32)
    useful = sum(lens)
    rates = {a: useful / tailrl_rate(e, ps, lens) for a, e in engines.items()}
    hf = useful / hf_rate(ref, ps, max(lens), device)
    print(f"| long tail 28x{tail[0]} + 4x{tail[1]} | " + " | ".join(f"{rates[a]:.0f}" for a in arms) + f" | {hf:.0f} | "
          + " | ".join(f"{rates[a] / hf:.2f}x" for a in arms) + " |")
    if "graphs" in engines:
        print(f"\ngraph pool after the runs: {engines['graphs'].runner.graphs.summary()}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["parity", "speed", "all"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--tail", type=int, nargs=2, default=[32, 256], help="short and long lengths of the tail batch")
    ap.add_argument("--tie", type=float, default=0.125, help="greedy tie tolerance in logits (bf16: ~1/8)")
    args = ap.parse_args()
    dtype = args.dtype or default_dtype(args.device)
    if args.device == "cpu":
        torch.set_num_threads(2)
    model, tok, ref = load_pair(args.model, args.device, dtype)
    print(describe(args.model, args.device, dtype))
    with torch.inference_mode():
        if args.what in ("parity", "all"):
            parity(model, tok, ref, args.device, args.tokens, args.tie)
        if args.what in ("speed", "all"):
            speed(model, tok, ref, args.device, args.tokens, args.batches, args.tail)


if __name__ == "__main__":
    main()
