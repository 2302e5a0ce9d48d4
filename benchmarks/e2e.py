"""End to end: `tailrl train` on its default task and model with SD auto vs SD off (several seeds, side by
side, interleaved), and TRL's GRPOTrainer on the same model, data, group size, lengths and steps.

    .venv/bin/python benchmarks/e2e.py [--steps 6] [--seeds 0 1] [--trl]   # --trl needs: pip install -e .[bench]

Reward curves: with position-keyed sampling noise and model-free (deterministic) drafts, SD on and off sample
the very same rollouts for a seed, so their curves must coincide step for step; the seed-to-seed spread is
printed beside them as the scale of noise."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

PHASES = ["gen", "reward", "old_log_prob", "update", "sync", "eval"]


def run_tailrl(out: Path, seed: int, mode: str, steps: int, extra: list[str]) -> list[dict]:
    from tailrl.config import load_config
    from tailrl.rl.run import train

    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(None, [f"trainer.out_dir={out}", f"trainer.seed={seed}", f"trainer.steps={steps}",
                             f"rollout.spec.mode={mode}", "trainer.eval_every=0", "trainer.save_every=0",
                             "trainer.report=false", *extra])
    train(cfg)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def run_trl(steps: int, seed: int) -> float:
    """Seconds per step of TRL GRPOTrainer with HF generation, same model/data/group/lengths."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tailrl.config import Config
    from tailrl.model import load_model, save_pretrained
    from tailrl.rl.rewards import format_reward, math_partial_reward
    from tailrl.rl.tasks import make_rows

    cfg = Config()
    model, tok = load_model(cfg.model.path, device="cpu")
    folder = Path(tempfile.mkdtemp(prefix="tailrl-trl-"))
    save_pretrained(model, folder / "model", tok)
    rows = make_rows(cfg.data.task, cfg.trainer.prompts_per_step * steps, seed=0)
    sys_msg = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else []
    ds = Dataset.from_list([{"prompt": sys_msg + [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows])

    def acc(prompts, completions, answer, **_):
        return [math_partial_reward(c[-1]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    def fmt(prompts, completions, **_):
        return [0.2 * format_reward(c[-1]["content"] if isinstance(c, list) else c) for c in completions]

    n = cfg.rollout.n
    args = GRPOConfig(output_dir=str(folder / "out"), per_device_train_batch_size=cfg.trainer.prompts_per_step * n,
                      num_generations=n, max_completion_length=cfg.rollout.max_tokens, max_steps=steps,
                      learning_rate=cfg.algo.lr, temperature=cfg.rollout.temperature, use_cpu=True, bf16=False,
                      logging_steps=1, report_to="none", save_strategy="no", seed=seed, epsilon_high=cfg.algo.clip_high)
    torch.set_num_threads(2)
    trainer = GRPOTrainer(model=str(folder / "model"), reward_funcs=[acc, fmt], args=args, train_dataset=ds,
                          processing_class=tok)
    t = time.perf_counter()
    trainer.train()
    return (time.perf_counter() - t) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--trl", action="store_true")
    ap.add_argument("--extra", nargs="*", default=[], help="config overrides for both arms")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tailrl-e2e-"))
    runs: dict[tuple[str, int], list[dict]] = {}
    for seed in args.seeds:
        for mode in ("auto", "off"):  # interleaved: machine noise hits both arms alike
            runs[(mode, seed)] = run_tailrl(root / f"{mode}-{seed}", seed, mode, args.steps, args.extra)
    print(f"\n`tailrl train` default task/model, {args.steps} steps, seeds {args.seeds}\n")
    print("| arm | step s | " + " | ".join(f"{p} s" for p in PHASES) + " | accept len | rollout speedup est |")
    print("|---|---|" + "---|" * len(PHASES) + "---|---|")
    mean_step = {}
    for mode in ("auto", "off"):
        rows = [r for s in args.seeds for r in runs[(mode, s)] if "timing_s/step" in r]
        avg = lambda k: sum(r.get(k, 0.0) for r in rows) / len(rows)  # noqa: E731
        mean_step[mode] = avg("timing_s/step")
        print(f"| SD {mode} | {avg('timing_s/step'):.1f} | " + " | ".join(f"{avg(f'timing_s/{p}'):.1f}" for p in PHASES)
              + f" | {avg('spec/accept_length'):.2f} | {avg('spec/speedup_est'):.2f}x |")
    print(f"\nend-to-end speedup (mean step time off / auto): {mean_step['off'] / mean_step['auto']:.2f}x")
    gen = {m: sum(r["timing_s/gen"] for s in args.seeds for r in runs[(m, s)] if "timing_s/gen" in r) for m in ("auto", "off")}
    print(f"rollout speedup (total gen time off / auto): {gen['off'] / gen['auto']:.2f}x\n")
    print("reward/mean per step:\n")
    print("| step | " + " | ".join(f"auto s{s} | off s{s}" for s in args.seeds) + " | max abs diff auto vs off | seed spread (off) |")
    print("|---|" + "---|---|" * len(args.seeds) + "---|---|")
    for i in range(args.steps):
        vals = {(m, s): [r for r in runs[(m, s)] if "reward/mean" in r][i]["reward/mean"] for m in ("auto", "off") for s in args.seeds}
        diff = max(abs(vals[("auto", s)] - vals[("off", s)]) for s in args.seeds)
        spread = max(vals[("off", s)] for s in args.seeds) - min(vals[("off", s)] for s in args.seeds)
        print(f"| {i + 1} | " + " | ".join(f"{vals[('auto', s)]:.3f} | {vals[('off', s)]:.3f}" for s in args.seeds)
              + f" | {diff:.4f} | {spread:.3f} |")
    if args.trl:
        trl_step = run_trl(args.steps, args.seeds[0])
        print(f"\nTRL GRPOTrainer (HF generate, same model/data/group/lengths): {trl_step:.1f} s/step; "
              f"tailrl SD auto {mean_step['auto']:.1f} s/step: {trl_step / mean_step['auto']:.2f}x faster than TRL")


if __name__ == "__main__":
    main()
