"""Learned drafter during RL: accept length per step and long-tail speed for a frozen drafter (trained once
before RL), the online drafter (spot-trained in the long tail), history only, learned + history, and SD off.

    python benchmarks/drafter.py [--steps 4] [--warm-prompts 128] [--warm-epochs 12] [--max-tokens 192] [--lr 1e-4]

1. Warm start: `train_offline` on the policy's own answers to the default task (kept in --out/warm).
2. Cost of one draft step (a head forward over B sequences' nodes) relative to one target decode forward.
3. One RL run per configuration, same seed, same data; all are lossless, so they train the same policy in
   distribution. Prints per-step tables and a summary; run it alone (two torch processes on 2 cores
   oversubscribe the CPU)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tailrl.config import load_config  # noqa: E402
from tailrl.drafter import DrafterConfig, load_drafter, make_speculator, save_drafter  # noqa: E402
from tailrl.drafter.offline import train_offline  # noqa: E402
from tailrl.drafter.propose import LearnedDrafter  # noqa: E402
from tailrl.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from tailrl.model import load_model  # noqa: E402
from tailrl.tasks import chat_prompt  # noqa: E402
from tailrl.tasks import make_rows  # noqa: E402
from tailrl.rl.trainer import Trainer  # noqa: E402
from tailrl.speculative.config import SpecConfig  # noqa: E402

CONFIGS = {  # name -> overrides
    "off": ["rollout.spec.mode=off"],
    "history": ["rollout.spec.mode=history"],
    "frozen": ["rollout.spec.mode=learned", "drafter.spot=false"],
    "online": ["rollout.spec.mode=learned", "drafter.spot=true"],
    "learned+history": ["rollout.spec.mode=auto", "drafter.spot=true"],
}


def warm_start(out: Path, prompts: int, epochs: int, seed: int, max_tokens: int) -> Path:
    folder = out / "warm"
    if (folder / "model.safetensors").is_file():
        print(f"warm-start drafter: reusing {folder}")
        return folder
    model, tok = load_model("smollm2-135m")
    rows = make_rows("arithmetic", prompts, seed + 12345)  # not the RL run's prompts
    t = time.perf_counter()
    head, m = train_offline(model, tok, [chat_prompt(r["prompt"]) for r in rows], DrafterConfig(lr=3e-4), n=4, max_tokens=max_tokens,
                            temperature=1.0, epochs=epochs, seed=seed)
    save_drafter(head, folder, meta={"offline": {k: v for k, v in m.items() if k != "final_train"}})
    print(f"warm start: {m['samples']} answers, {m['steps']} steps, {time.perf_counter() - t:.0f}s; held-out top-1 "
          f"{m['eval_before'].get('drafter/top1_acc', 0):.3f} -> {m['eval_after'].get('drafter/top1_acc', 0):.3f}")
    return folder


@torch.inference_mode()
def draft_cost(warm: Path) -> list[tuple]:
    """Seconds of one head level (B sequences x 1 node) against one target decode forward (B tokens)."""
    model, tok = load_model("smollm2-135m")
    head = load_drafter(warm, model)
    rows = []
    prompt = chat_prompt("What is 123 + 456? Think step by step.")
    for B in (1, 4, 32):
        drafter = LearnedDrafter(head, DrafterConfig(topk=1, min_prob=0.0))
        spec = SpecConfig(mode="learned", budgets=(1,), init_depth=1, min_depth=1)
        eng = Engine(model, tok, EngineConfig(kv_cache_gb=1.0, spec=spec), make_speculator(spec, drafter))
        times = {"target": [], "draft": []}
        orig_propose = drafter.propose

        def timed_propose(seqs, budgets, depths):
            t = time.perf_counter()
            out = orig_propose(seqs, budgets, depths)
            times["draft"].append(time.perf_counter() - t)
            return out

        drafter.propose = timed_propose
        eng.generate([prompt], SamplingParams(n=B, max_tokens=24, temperature=1.0, seed=0, ignore_eos=True))
        plain = Engine(model, tok, EngineConfig(kv_cache_gb=1.0))
        st = plain.generate([prompt], SamplingParams(n=B, max_tokens=24, temperature=1.0, seed=0, ignore_eos=True)).stats
        target = st.decode_s / max(st.decode_steps, 1)
        draft = statistics.median(times["draft"][2:]) if len(times["draft"]) > 2 else float("nan")
        rows.append((B, target * 1e3, draft * 1e3, draft / target))
    return rows


def replay(policy, tok, warm: Path, online_head, args) -> list[tuple]:
    """The long tail, replayed on the policy after RL: B sequences of one unseen prompt, two epochs (the first
    feeds history), the second timed. Tokens/s per configuration at B = 1 and 4."""
    from tailrl.drafter.train import clone_head

    frozen = load_drafter(warm, policy)
    online = clone_head(online_head) if online_head is not None else None
    if online is not None:
        online.bind(policy)
    setups = [("off", "off", None), ("history", "history", None), ("frozen", "learned", frozen)]
    if online is not None:
        setups += [("online", "learned", online), ("learned+history (auto)", "auto", online)]
    rows = []
    prompts = [chat_prompt(r["prompt"]) for r in make_rows("arithmetic", 4, args.seed + 999)]
    for B in (1, 4):
        for name, mode, head in setups:
            toks, secs, acc = 0, 0.0, []
            for p_i, prompt in enumerate(prompts[:2]):
                spec = SpecConfig(mode=mode)
                eng = Engine(policy, tok, EngineConfig(kv_cache_gb=1.0, spec=spec),
                             make_speculator(spec, LearnedDrafter(head, DrafterConfig()) if head is not None else None))
                for epoch in range(2):
                    params = SamplingParams(n=B, max_tokens=args.max_tokens, temperature=1.0, seed=100 * epoch + p_i)
                    st = eng.generate([prompt], params).stats
                toks += st.generated_tokens
                secs += st.total_s
                acc.append(st.mean_accept_length)
            rows.append((B, name, toks / secs, sum(acc) / len(acc)))
            print(f"  replay B={B} {name}: {toks / secs:.1f} tok/s, accept {sum(acc) / len(acc):.2f}", flush=True)
    return rows


def rl_run(name: str, warm: Path, args, keep: dict | None = None) -> list[dict]:
    out = Path(args.out) / name
    cfg = load_config(None, [f"trainer.out_dir={out}", f"trainer.steps={args.steps}", "trainer.eval_every=0",
                             "trainer.save_every=0", "trainer.report=false", f"algo.lr={args.lr}",
                             f"rollout.max_tokens={args.max_tokens}",
                             f"drafter.path={warm}" if name not in ("off", "history") else "drafter.enabled=false",
                             f"trainer.seed={args.seed}", *CONFIGS[name]])
    trainer = Trainer(cfg)
    rows = []
    try:
        for _ in range(args.steps):
            m = trainer.train_step()
            m.pop("response_lengths", None)
            rows.append(m)
            acc = {k.split("/", 2)[2]: round(v, 2) for k, v in m.items() if k.startswith("spec/accept_length/")}
            print(f"  {name} step {trainer.step}: gen {m['timing_s/gen']:.1f}s step {m['timing_s/step']:.1f}s "
                  f"tail {m['spec/tail_tokens_per_s']:.1f} tok/s accept {acc} "
                  f"drafter acc {m.get('drafter/top1_acc', float('nan')):.3f} spot {m.get('drafter/spot_s', 0):.1f}s", flush=True)
    finally:
        trainer.rewards.close()
        if trainer.spot is not None:
            trainer.spot.close()
    if keep is not None:
        keep[name] = trainer
    (out / "bench.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(rows, indent=1))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warm-prompts", type=int, default=128)
    ap.add_argument("--warm-epochs", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=192, help="rollout length cap (the default run's 96 clips so many "
                    "responses at once that there is no long tail)")
    ap.add_argument("--lr", type=float, default=1e-4, help="policy lr (higher than the default 3e-5: the policy must move)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default="out/bench_drafter")
    ap.add_argument("--summary-only", action="store_true", help="print the tables of the runs saved under --out")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    if args.summary_only:  # the tables again from the runs saved under --out
        runs = {n: json.loads((Path(args.out) / n / "bench.json").read_text()) for n in args.configs.split(",")
                if (Path(args.out) / n / "bench.json").is_file()}
        args.steps = min(len(r) for r in runs.values())
        summarize(runs, args)
        return
    warm = warm_start(Path(args.out), args.warm_prompts, args.warm_epochs, args.seed, args.max_tokens)

    print("\ncost of one draft level vs one target decode forward (SmolLM2-135M, draft vocabulary "
          f"{load_drafter(warm).draft_vocab_size})")
    print("| batch | target forward ms | draft level ms | ratio |\n|---|---|---|---|")
    for B, t, d, r in draft_cost(warm):
        print(f"| {B} | {t:.1f} | {d:.1f} | {r:.2f} |")

    runs, trainers = {}, {}
    for name in args.configs.split(","):
        print(f"\nRL run: {name}", flush=True)
        runs[name] = rl_run(name, warm, args, trainers if name == "online" else None)
    if "online" in trainers:
        print("\nlong-tail replay on the policy after the online run (tokens/s, second epoch of 2, T=1.0)", flush=True)
        tr = trainers.pop("online")
        rep_rows = replay(tr.policy, tr.tokenizer, warm, tr.head, args)
        print("| batch | config | tokens/s | vs off | accept length |\n|---|---|---|---|---|")
        for B, name, tps, acc in rep_rows:
            off = next(t for b, n, t, _ in rep_rows if b == B and n == "off")
            print(f"| {B} | {name} | {tps:.1f} | {tps / off:.2f}x | {acc:.2f} |")

    summarize(runs, args)


def summarize(runs: dict, args) -> None:
    print("\naccept length per step (tokens per sequence-step, learned drafter's own when present)")
    names = list(runs)
    print("| step | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for i in range(args.steps):
        cells = []
        for n in names:
            m = runs[n][i]
            cells.append(f"{m.get('spec/accept_length/learned', m['spec/accept_length']):.2f}")
        print(f"| {i + 1} | " + " | ".join(cells) + " |")

    print("\nsummary (means over steps; ratios against SD off in the same run of this script)")
    print("| config | accept length | rollout tok/s | vs off | gen s | step s | spot s/step | drafter top-1 | drafter accept prob |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = runs.get("off")

    def mean(rows, key, default=0.0):
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else default

    for n in names:
        rows = runs[n]
        tps = mean(rows, "perf/gen_tokens_per_s")  # per token: lossless runs with q-drafts sample other lengths
        btps = mean(base, "perf/gen_tokens_per_s") if base else float("nan")
        print(f"| {n} | {mean(rows, 'spec/accept_length'):.2f} | {tps:.1f} | {tps / btps:.2f}x | {mean(rows, 'timing_s/gen'):.1f} | "
              f"{mean(rows, 'timing_s/step'):.1f} | {mean(rows, 'drafter/spot_s'):.2f} | "
              f"{mean(rows, 'drafter/top1_acc', float('nan')):.3f} | {mean(rows, 'drafter/accept_prob', float('nan')):.3f} |")
    if "online" in runs and "frozen" in runs:
        on, fr = runs["online"], runs["frozen"]
        share = mean(on, "drafter/spot_s") / mean(on, "timing_s/step")
        print(f"\nspot training: {share:.1%} of the online run's step time spent training; step time online / frozen = "
              f"{mean(on, 'timing_s/step') / mean(fr, 'timing_s/step'):.3f}")
        for n in ("frozen", "online"):
            acc = [r.get("spec/accept_length/learned", 0.0) for r in runs[n]]
            print(f"{n}: accept length step 1 {acc[0]:.2f} -> last {acc[-1]:.2f} ({acc[-1] / acc[0] - 1:+.1%})")
        print(f"rollout tokens/s online / frozen = {mean(on, 'perf/gen_tokens_per_s') / mean(fr, 'perf/gen_tokens_per_s'):.3f}")


if __name__ == "__main__":
    main()
