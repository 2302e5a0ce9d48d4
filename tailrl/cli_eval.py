"""`tailrl eval MODEL_OR_RUN`: pass@1 / pass@k / maj@k of a run, checkpoint, HF folder or GGUF on held-out prompts."""

from __future__ import annotations

import re
import sys


def _default_out(src, label: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")
    if src.ckpt is not None:
        return str((src.run_dir or src.ckpt) / "eval" / f"{src.ckpt.name}-{slug}.jsonl")
    return f"out/eval-{slug}.jsonl"


def _run_eval_accuracy(src) -> str | None:
    """The run's own eval/accuracy at the checkpoint's step, for comparison."""
    from .metrics import read_jsonl

    if src.run_dir is None or src.ckpt is None or not (src.run_dir / "metrics.jsonl").is_file():
        return None
    step = int(src.ckpt.name.removeprefix("step_"))
    rows = [r for r in read_jsonl(src.run_dir / "metrics.jsonl") if "eval/accuracy" in r and r.get("step") == step]
    return f"the run's eval/accuracy at step {step} (greedy): {rows[-1]['eval/accuracy']:.3f}" if rows else None


def cmd_eval(args) -> int:
    from .cli_generate import check_writable
    from .rl.evaluate import eval_set, resolve_source, run_eval

    try:
        src = resolve_source(args.model)
        examples, notes, label = eval_set(src.cfg, args.data, args.limit)
        temperature = args.temperature if args.temperature is not None else (
            0.0 if args.n == 1 else src.cfg.rollout.temperature)
        max_tokens = args.max_tokens or src.cfg.rollout.max_tokens
        if args.n < 1 or temperature < 0 or max_tokens < 1:
            raise ValueError("--n and --max-tokens must be >= 1 and --temperature >= 0")
        out = check_writable(args.out or _default_out(src, label))
        for note in notes:
            print(note)
        print(f"eval: {src.label}; {label}: {len(examples)} prompts x {args.n} sample{'s' if args.n > 1 else ''}, "
              f"temperature {temperature:g}, max {max_tokens} tokens, speculation {src.cfg.rollout.spec.mode}")
        seed = src.cfg.trainer.seed if args.seed is None else args.seed
        s = run_eval(src, examples, args.n, temperature, max_tokens, args.reward, seed, out, args.device,
                     progress=not args.quiet and sys.stderr.isatty())
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    scores = "  ".join(f"{k} {v:.3f}" for k, v in s.items() if k.startswith(("pass@", "maj@")))
    print(f"{scores}   (reward {s['reward']}: correct = reward >= 1)")
    print(f"mean reward {s['mean_reward']:.3f}  mean length {s['mean_length']:.1f} tokens  truncated {s['truncated']:.1%}"
          f"  prompts {s['prompts']} (rejected {s['rejected']}), reward errors {s['reward_errors']}")
    accept = f", accept length {s['accept_length']:.2f}" if s.get("accept_length") else ""
    print(f"speed: {s['tokens_per_s']:.0f} tok/s{accept}")
    if args.data is None and (ref := _run_eval_accuracy(src)) is not None:
        print(ref)
    print(f"completions: {out}")
    return 0


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="pass@1/pass@k/maj@k of a run, checkpoint, HF folder or GGUF on held-out prompts")
    e.add_argument("model", help="run folder (its latest checkpoint), checkpoint folder, HF folder, "
                   ".gguf, known name or LoRA adapter folder (PEFT's; merged onto the base its config names)")
    e.add_argument("--data", default=None, help="JSONL/Parquet (verl's format too) or a built-in task (its held-out "
                   "split); default: the run's eval set, or the built-in task's held-out prompts")
    e.add_argument("--n", type=int, default=1, help="samples per prompt (pass@1 is their mean)")
    e.add_argument("--temperature", type=float, default=None,
                   help="default: 0 (greedy) with --n 1, else the run's rollout.temperature")
    e.add_argument("--max-tokens", type=int, default=None, help="default: the run's rollout.max_tokens")
    e.add_argument("--reward", default=None, help="built-in or module:function; default: the run's accuracy verifier")
    e.add_argument("--limit", type=int, default=None, help="the first N prompts (a task: N held-out prompts)")
    e.add_argument("--seed", type=int, default=None)
    e.add_argument("--device", default=None)
    e.add_argument("--out", default=None, help="JSONL of completions with rewards (default: RUN/eval/... or out/)")
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=cmd_eval)
