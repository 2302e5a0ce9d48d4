"""End to end: the default `tailrl train` with SD auto against SD off (several seeds, interleaved, each run in its own
process), and TRL's GRPOTrainer on the same model, prompts, rewards, group size, lengths and batch.

    .venv/bin/python benchmarks/e2e.py [--preset long] [--seeds 0 1] [--steps N] [--out DIR] [--side-by-side] [--trl]
                                       [--extra k=v ...]
    # --trl needs: .venv/bin/pip install trl   (pulls datasets and pandas; torch is already there)

Runs go to --out (default /tmp/tailrl-e2e); an arm whose folder already holds a finished run is read, not rerun, so
an interrupted benchmark continues where it stopped (delete the folder to measure again).

Reward curves: with deterministic drafts SD on and off sample the very same rollouts for a seed, so their curves
coincide: in fp32, and in bf16 on a CPU through batch-invariant decoding (engine/invariant.py; before it, the bf16
arms drifted apart after the first near-tie). The seed-to-seed spread is printed beside them as a scale."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PHASES = ["gen", "reward", "old_log_prob", "update", "sync", "eval"]
ARMS = {"auto": ["rollout.spec.mode=auto"], "off": ["rollout.spec.mode=off"],
        "learned": ["rollout.spec.mode=auto", "drafter.enabled=true"]}  # learned: auto plus the online EAGLE drafter


def run_tailrl(out: Path, seed: int, arm: str, extra: list[str], preset: str = "",
               threads: int = 0) -> tuple[list[dict], float]:
    """The metrics rows of `tailrl train` (default config, or the preset's) in one arm; the process's wall time.
    threads > 0: the process's OMP_NUM_THREADS (arms side by side)."""
    done = out / "done.json"
    if done.exists():
        return _rows(out), json.loads(done.read_text())["wall_s"]
    cmd = [sys.executable, "-m", "tailrl.cli", "train", *(["--preset", preset] if preset else []),
           f"trainer.out_dir={out}", f"trainer.seed={seed}",
           *ARMS[arm], "trainer.overwrite=true",
           # one checkpoint per arm on disk (1.6 GB with AdamW; resuming needs the last): a benchmark folder of
           # several arms once filled the disk with the default 2
           "trainer.keep_checkpoints=1", *extra]
    print("$", " ".join(cmd[2:]), flush=True)
    t = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - t
    done.write_text(json.dumps({"wall_s": wall}))
    return _rows(out), wall


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def run_trl(out: Path, steps: int, seed: int, bf16: bool, extra: list[str], preset: str = "") -> float:
    """Seconds per step of TRL GRPOTrainer (HF generate) on the default run's model, train prompts, rewards, group,
    lengths, temperature, learning rate and batch (prompts_per_step x n completions, micro-batches of the same size).
    Cached in `out` like the tailrl arms."""
    if out.exists():
        return json.loads(out.read_text())["s_per_step"]
    s_per_step = _trl_seconds_per_step(steps, seed, bf16, extra, preset)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"s_per_step": s_per_step, "steps": steps}))
    return s_per_step


def _trl_seconds_per_step(steps: int, seed: int, bf16: bool, extra: list[str], preset: str) -> float:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tailrl.config import load_config
    from tailrl.model import load_model, save_pretrained
    from tailrl.rl.data import load_datasets
    from tailrl.tasks import chat_prompt
    from tailrl.rl.rewards.builtin import BUILTIN, reward_weights

    cfg = load_config(None, extra, preset)
    model, tok = load_model(cfg.model.path, device="cpu", dtype=torch.float32)
    folder = Path(tempfile.mkdtemp(prefix="tailrl-trl-"))
    save_pretrained(model, folder / "model", tok)
    train, _ = load_datasets(cfg.data)
    ds = Dataset.from_list([{"prompt": chat_prompt(e.prompt, cfg.data.system_prompt), "answer": e.answer} for e in train])

    def wrap(name):
        f = BUILTIN[name]

        def reward(prompts, completions, answer, **_):
            return [f(c[-1]["content"] if isinstance(c, list) else c, answer=a) for c, a in zip(completions, answer)]

        reward.__name__ = name
        return reward

    r, a = cfg.rollout, cfg.algo
    batch = cfg.trainer.prompts_per_step * r.n
    args = GRPOConfig(
        output_dir=str(folder / "out"), per_device_train_batch_size=a.micro_batch_size,
        gradient_accumulation_steps=max(1, batch // a.micro_batch_size), num_generations=r.n,
        max_completion_length=r.max_tokens, max_steps=steps, learning_rate=a.lr, temperature=r.temperature,
        top_p=r.top_p, beta=a.kl_coef, epsilon=a.clip_low, epsilon_high=a.clip_high, use_cpu=True, bf16=bf16,
        reward_weights=reward_weights(cfg.reward.functions, cfg.reward.weights), logging_steps=1, report_to="none",
        save_strategy="no", seed=seed)
    torch.set_num_threads(2)
    trainer = GRPOTrainer(model=str(folder / "model"), reward_funcs=[wrap(n) for n in cfg.reward.functions], args=args,
                          train_dataset=ds, processing_class=tok)
    t = time.perf_counter()
    trainer.train()
    return (time.perf_counter() - t) / steps


def print_tail(steps: dict, seeds: list[int]) -> None:
    """The long tail (at most a quarter of the sequences running, engine/tail.py) in each arm's training rollouts: its
    share of rollout time, and SD's gain there and in the body, measured (SD-off seconds over SD-auto seconds of the
    same part; the same tokens where the invariance probe holds) and as the auto arm's own SD-off estimate."""
    rows = {m: [r for s in seeds for r in steps[(m, s)]] for m in ("auto", "off")}
    if not all("rollout/tail_s" in r for rs in rows.values() for r in rs):
        print("(no rollout/tail_s in these runs: they predate the tail metrics)\n")
        return
    part = {(m, p): sum(r[f"rollout/{p}_s"] for r in rs) for m, rs in rows.items() for p in ("tail", "body")}
    ratio = lambda a, b: f"{a / b:.2f}x" if b > 0 else "n/a (no time there)"  # noqa: E731
    est = {p: ratio(sum(r[f"rollout/{p}_s"] * r[f"spec/{p}_speedup_est"] for r in rows["auto"]), part[("auto", p)])
           for p in ("tail", "body")}
    print("| arm | rollout s (engine steps) | tail s | tail share | body s |\n|---|---|---|---|---|")
    for m in ("auto", "off"):
        tail, body = part[(m, "tail")], part[(m, "body")]
        print(f"| SD {m} | {tail + body:.0f} | {tail:.1f} | {tail / max(tail + body, 1e-9):.0%} | {body:.1f} |")
    gain = {p: ratio(part[("off", p)], part[("auto", p)]) for p in ("tail", "body")}
    print(f"\nSD auto against off, measured: {gain['tail']} in the tail, {gain['body']} in the body; "
          f"the auto arm's SD-off estimate: {est['tail']} in the tail, {est['body']} in the body\n")


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--preset", default="", help="a built-in run instead of the default (long: tailrl train --preset long)")
    ap.add_argument("--steps", type=int, default=0, help="0: the default run's trainer.steps")
    ap.add_argument("--out", default="/tmp/tailrl-e2e")
    ap.add_argument("--learned-seeds", type=int, nargs="*", default=[],
                    help="also run the 'learned' arm (auto + online drafter) at these seeds")
    ap.add_argument("--trl", action="store_true")
    ap.add_argument("--trl-steps", type=int, default=3)
    ap.add_argument("--extra", nargs="*", default=[], help="config overrides for every arm (TRL too)")
    ap.add_argument("--side-by-side", action="store_true",
                    help="a seed's SD auto and off arms at once, one thread each: the same load on both arms")
    args = ap.parse_args()
    extra = list(args.extra) + ([f"trainer.steps={args.steps}"] if args.steps else [])
    root, modes = Path(args.out + (f"-{args.preset}" if args.preset else "")), ("auto", "off")
    runs, wall = {}, {}
    for seed in args.seeds:
        if args.side_by_side:  # both arms at once on their own cores: noise and memory traffic hit both alike
            with ThreadPoolExecutor(len(modes)) as pool:
                futs = {m: pool.submit(run_tailrl, root / f"{m}-{seed}", seed, m, extra, args.preset, 1) for m in modes}
            for mode, fut in futs.items():
                runs[(mode, seed)], wall[(mode, seed)] = fut.result()
            continue
        for mode in modes:  # interleaved: machine noise hits both arms alike
            runs[(mode, seed)], wall[(mode, seed)] = run_tailrl(root / f"{mode}-{seed}", seed, mode, extra, args.preset)
    for seed in args.learned_seeds:
        runs[("learned", seed)], wall[("learned", seed)] = run_tailrl(root / f"learned-{seed}", seed, "learned", extra,
                                                                      args.preset)
    steps = {k: [r for r in v if "timing_s/step" in r] for k, v in runs.items()}
    what = f"--preset {args.preset}" if args.preset else "default config"
    print(f"\n`tailrl train` ({what}{', ' + ' '.join(extra) if extra else ''}), seeds {args.seeds}\n")
    print("| arm | run wall s | step s | step s w/o eval | " + " | ".join(f"{p} s" for p in PHASES)
          + " | accept len |")
    print("|---|---|---|---|" + "---|" * len(PHASES) + "---|")
    tot = {}
    for mode in modes + (("learned",) if args.learned_seeds else ()):
        seeds = args.learned_seeds if mode == "learned" else args.seeds
        rows = [r for s in seeds for r in steps[(mode, s)]]
        avg = lambda k: mean(r.get(k, 0.0) for r in rows)  # noqa: E731
        tot[mode] = {k: sum(r.get(f"timing_s/{k}", 0.0) for r in rows) for k in ("step", "gen", "eval")}
        print(f"| SD {mode} (seeds {seeds}) | {mean(wall[(mode, s)] for s in seeds):.0f} | {avg('timing_s/step'):.1f} | "
              f"{avg('timing_s/step') - avg('timing_s/eval'):.1f} | "
              + " | ".join(f"{avg(f'timing_s/{p}'):.1f}" for p in PHASES) + f" | {avg('spec/accept_length'):.2f} |")
    toks = {m: sum(sum(r.get("response_lengths", [])) for s in args.seeds for r in steps[(m, s)]) for m in modes}
    print(f"\nrollout speedup (training rollouts, total gen time off / auto): {tot['off']['gen'] / tot['auto']['gen']:.2f}x")
    print(f"rollout tokens/s: auto {toks['auto'] / tot['auto']['gen']:.0f}, off {toks['off'] / tot['off']['gen']:.0f} "
          f"({toks['auto'] / tot['auto']['gen'] / (toks['off'] / tot['off']['gen']):.2f}x; "
          + (f"the same {toks['auto']} tokens in both arms)" if toks["auto"] == toks["off"] else
             f"the arms' rollouts differ, so their lengths do too: {toks['auto']} vs {toks['off']} tokens; batch-"
             f"invariant decoding, engine/invariant.py, makes them the same)"))
    print(f"rollout + eval generation speedup: {(tot['off']['gen'] + tot['off']['eval']) / (tot['auto']['gen'] + tot['auto']['eval']):.2f}x")
    print(f"step speedup (total step time off / auto): {tot['off']['step'] / tot['auto']['step']:.2f}x")
    print(f"whole-run speedup (process wall off / auto): "
          f"{sum(wall[('off', s)] for s in args.seeds) / sum(wall[('auto', s)] for s in args.seeds):.2f}x")
    # Amdahl: speculation speeds up only the rollout, so its share f of the SD-off step bounds the step speedup
    f = tot["off"]["gen"] / (tot["off"]["step"] - tot["off"]["eval"])
    print(f"rollout share of the SD-off step (w/o eval): {f:.0%}; the step speedup a rollout speedup s can give is "
          f"1/((1-f)+f/s): {1 / ((1 - f) + f / 1.5):.2f}x at s=1.5, {1 / (1 - f):.2f}x at s=infinity\n")
    print_tail(steps, args.seeds)
    if args.learned_seeds:
        ls = args.learned_seeds
        off = {k: sum(r.get(f"timing_s/{k}", 0.0) for s in ls for r in steps[("off", s)]) for k in ("step", "gen")}
        print(f"learned arm against off at seeds {ls}: rollout {off['gen'] / tot['learned']['gen']:.2f}x, "
              f"step {off['step'] / tot['learned']['step']:.2f}x (auto at those seeds: rollout "
              f"{off['gen'] / sum(r['timing_s/gen'] for s in ls for r in steps[('auto', s)]):.2f}x)\n")
    n_steps = min(len(steps[(m, s)]) for m in modes for s in args.seeds)
    print("reward/mean per step:\n")
    print("| step | " + " | ".join(f"auto s{s} | off s{s}" for s in args.seeds) + " | max abs diff auto vs off | seed spread (off) |")
    print("|---|" + "---|---|" * len(args.seeds) + "---|---|")
    for i in range(n_steps):
        vals = {(m, s): steps[(m, s)][i]["reward/mean"] for m in modes for s in args.seeds}
        diff = max(abs(vals[("auto", s)] - vals[("off", s)]) for s in args.seeds)
        spread = max(vals[("off", s)] for s in args.seeds) - min(vals[("off", s)] for s in args.seeds)
        print(f"| {i + 1} | " + " | ".join(f"{vals[('auto', s)]:.3f} | {vals[('off', s)]:.3f}" for s in args.seeds)
              + f" | {diff:.3f} | {spread:.3f} |")
    evals = {k: {r["step"]: r["eval/accuracy"] for r in v if "eval/accuracy" in r} for k, v in runs.items() if k[0] in modes}
    at = sorted(set.intersection(*(set(e) for e in evals.values())))
    print("\neval/accuracy (greedy, held-out prompts, strict verifier):\n")
    print("| step | " + " | ".join(f"auto s{s} | off s{s}" for s in args.seeds) + " |")
    print("|---|" + "---|---|" * len(args.seeds))
    for st in at:
        print(f"| {st} | " + " | ".join(f"{evals[('auto', s)][st]:.2f} | {evals[('off', s)][st]:.2f}" for s in args.seeds) + " |")
    if at:
        gain = mean(evals[(m, s)][at[-1]] - evals[(m, s)][at[0]] for m in modes for s in args.seeds)
        print(f"\nmean gain step {at[0]} -> {at[-1]}: {gain:+.2f}")
    if args.trl:
        # TRL runs the first --trl-steps steps, from the base policy: compare them with tailrl's same first steps
        # (responses shrink as the policy learns, so later steps are cheaper); the whole-run mean is printed too
        k = args.trl_steps
        first = mean(r["timing_s/step"] - r.get("timing_s/eval", 0.0) for s in args.seeds for r in steps[("auto", s)][:k])
        whole = mean(r["timing_s/step"] - r.get("timing_s/eval", 0.0) for s in args.seeds for r in steps[("auto", s)])
        print(f"\n| TRL GRPOTrainer (HF generate), steps 1-{k} | s/step | tailrl SD auto s/step, steps 1-{k} (w/o eval) "
              f"| tailrl speedup | tailrl s/step, whole run |")
        print("|---|---|---|---|---|")
        for bf16 in (False, True):
            trl = run_trl(root / f"trl-{'bf16' if bf16 else 'fp32'}-{k}.json", k, args.seeds[0], bf16, list(args.extra),
                          args.preset)
            print(f"| {'bf16 autocast' if bf16 else 'fp32'} | {trl:.1f} | {first:.1f} | {trl / first:.2f}x | {whole:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
