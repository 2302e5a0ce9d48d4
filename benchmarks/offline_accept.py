"""Drafting ideas measured offline, on a run's recorded responses, without running a model.

With deterministic drafts the verifier accepts exactly the draft's prefix that matches the token the policy draws
(the sampling noise is keyed by position), so a strategy's tokens per verify on a recorded response are what it
would have got in the run, for the same response. This replays a checkpoint's history index (the last epochs'
responses to each training prompt): each response of epoch --target is drafted, position by position, from the
epochs before it, and a verify emits the matched draft tokens plus one. Siblings of the same epoch are left out
(they decode at the same time), so the numbers are a little below the run's.

Strategies: `history` (a chain of the most frequent continuation after the longest suffix match, as HistoryDrafter
with chains), `+ngram` (the sequence's own n-grams where history has no match: FallbackDrafter), `+global` (an index
over the other prompts' responses where it matches longer), `best of w` (the best of w chains, one per distinct
next token: what verifying w paths side by side would get).

Each cell also gives the draft rows a verify spends and what that buys where a draft row costs --row-price of a
sequence's plain step (0.35 at 64 sequences in bf16 on the 2-core CPU, benchmarks/verify_cost.py, in git at 103a651;
near 0 on a GPU at these batch sizes): tokens / (1 + price * rows), the rollout speedup the strategy can give at that
batch size.

    .venv/bin/python benchmarks/offline_accept.py RUN_DIR [--target -1] [--ks 4 8]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

from tailrl.rl.checkpoint.state_io import is_pickled, read_state
from tailrl.speculative.config import SpecConfig
from tailrl.speculative.drafters import NgramDrafter
from tailrl.speculative.suffix import TokenIndex, TreeShape, build_tree

MAX_MATCH, MIN_MATCH, PROMPT_TAIL = 32, 2, 4


def index_of(streams: list[list[int]]) -> TokenIndex:
    ix = TokenIndex(3)
    for s in streams:
        ix.add_stream(s)
    return ix


def chains(ix: TokenIndex, ctx: list[int], k: int, width: int, min_match: int = MIN_MATCH) -> tuple[list[list[int]], int]:
    """Up to `width` chains of k tokens after the longest match (one per distinct next token), and the match length."""
    m, occ = ix.match(ctx[-MAX_MATCH - 1 :], MAX_MATCH)
    if m < min_match:
        return [], m
    if width == 1:
        t = build_tree(ix.streams, occ, TreeShape(min(k, 2 * m + 1), k, 0.1, chain=True), "history")
        return ([t.tokens] if t else []), m
    by_first: dict[int, list[list[int]]] = {}
    for sid, pos in occ:
        cont = ix.streams[sid][pos : pos + k]
        if cont:
            by_first.setdefault(cont[0], []).append(cont)
    out = []
    for _, conts in sorted(by_first.items(), key=lambda kv: -len(kv[1]))[:width]:
        path = []
        for d in range(k):
            counts: dict[int, int] = {}
            for c in conts:
                if len(c) > d:
                    counts[c[d]] = counts.get(c[d], 0) + 1
            if not counts:
                break
            tok = max(counts, key=counts.get)
            path.append(tok)
            conts = [c for c in conts if len(c) > d and c[d] == tok]
        out.append(path)
    return out, m


def own_ngram(prompt: list[int], out: list[int], k: int) -> list[int]:
    """What the engine's NgramDrafter drafts for a sequence with this prompt and output: a chain of up to k tokens."""
    seq = SimpleNamespace(seq_id=0, prompt_ids=prompt, output_ids=out)
    drafter = NgramDrafter(SpecConfig(mode="ngram"))
    drafter.start(seq)
    tree = drafter.propose_one(seq, k, k)
    return tree.tokens if tree else []


def replay(prompts: list[dict], target: int, k: int, width: int, ngram: bool, glob: bool, min_len: int) -> tuple[float, float, int]:
    """Tokens per verify, draft rows per verify, verify steps."""
    steps = tokens = rows = 0
    for i, p in enumerate(prompts):
        epochs = p["epochs"]
        tail = p["prompt"][-PROMPT_TAIL:]
        local = index_of([p["prompt"]] + [tail + r for e in epochs[:target] for r in e])
        other = index_of([q["prompt"][-PROMPT_TAIL:] + r for j, q in enumerate(prompts) if j != i
                          for e in (q["epochs"][:target]) for r in e]) if glob else None
        for resp in epochs[target]:
            if len(resp) < min_len:
                continue
            pos = 0
            while pos < len(resp):
                ctx = p["prompt"][-MAX_MATCH:] + resp[:pos]
                drafts, m = chains(local, ctx, k, width)
                if other is not None:
                    g, gm = chains(other, ctx, k, 1, MIN_MATCH + 1)
                    if gm > m and g and (not drafts or len(g[0]) > len(drafts[0])):
                        drafts = g
                if ngram and not drafts:
                    drafts = [own_ngram(p["prompt"], resp[:pos], k)]
                best = 0
                rows += sum(len(d) for d in drafts)
                for d in drafts:
                    a = 0
                    while a < len(d) and pos + a < len(resp) and d[a] == resp[pos + a]:
                        a += 1
                    best = max(best, a)
                pos += best + 1
                steps += 1
                tokens += best + 1
    return tokens / max(steps, 1), rows / max(steps, 1), steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path, help="a run folder (its latest checkpoint) or a checkpoint folder")
    ap.add_argument("--target", type=int, default=-1, help="the epoch drafted (index into the kept epochs)")
    ap.add_argument("--ks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--min-len", type=int, default=0, help="only responses of at least this many tokens")
    ap.add_argument("--row-price", type=float, default=0.35,
                    help="a draft row's cost as a fraction of a sequence's plain step (0.35: bf16, 64 sequences, this CPU)")
    args = ap.parse_args()
    ckpt = args.run
    if (ckpt / "checkpoints").is_dir():
        ckpt = sorted((ckpt / "checkpoints").glob("step_*"))[-1]
    if is_pickled(ckpt):  # reading it would run any code in the pickle
        raise SystemExit(f"{ckpt}: its trainer state is the old pickled format; resume the run once with "
                         "trainer.trust_pickled_state=true (if you trust it) to rewrite it")
    state = read_state(ckpt)
    prompts = [p for p in state["history"]["prompts"] if len(p["epochs"]) >= 2 and len(p["epochs"][-1]) > 1]
    if not prompts:
        raise SystemExit(f"{ckpt}: no training prompt with two kept epochs in its history index")
    print(f"{ckpt}: {len(prompts)} training prompts, epochs kept {len(prompts[0]['epochs'])}, drafting epoch "
          f"{args.target} from the ones before it; per cell: tokens per verify / draft rows per verify / the speedup "
          f"over plain decoding if a verify costs 1 + {args.row_price} * rows plain steps (verify steps)\n")
    variants = {"history": (1, False, False), "history+ngram": (1, True, False), "history+global": (1, False, True),
                "history+ngram+global": (1, True, True), "best of 2 chains": (2, False, False),
                "best of 4 chains": (4, False, False)}
    print("| strategy | " + " | ".join(f"k={k}" for k in args.ks) + " |")
    print("|---|" + "---|" * len(args.ks))
    for name, (w, ng, gl) in variants.items():
        cells = [replay(prompts, args.target, k, w, ng, gl, args.min_len) for k in args.ks]
        print(f"| {name} | " + " | ".join(f"{a:.2f} / {r:.2f} / {a / (1 + args.row_price * r):.2f}x ({n})"
                                         for a, r, n in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
