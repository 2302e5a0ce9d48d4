"""tailrl command line: train | generate | report | data | drafter."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path

DEFAULT_PROMPTS = [
    "What is 17 + 25? Answer with the number after ####.",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about speculative decoding.",
    "A train travels 60 km in 45 minutes. What is its speed in km/h? Answer after ####.",
]


def read_prompts(path: str) -> list[tuple[object, str | None]]:
    """Rows of a prompts JSONL: {"prompt": text | chat messages} or {"messages": [...]} or {"prompt_ids": [...]}.
    Returns (prompt, None) per good row and (None, error) per malformed row, so one bad row fails alone."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompts file {path!r} not found")
    rows = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            rows.append((None, f"{path}:{lineno}: not valid JSON ({e.msg})"))
            continue
        if isinstance(row, str):
            row = {"prompt": row}
        prompt = row.get("prompt", row.get("messages", row.get("prompt_ids"))) if isinstance(row, dict) else None
        if prompt is None:
            rows.append((None, f"{path}:{lineno}: a row needs a 'prompt', 'messages' or 'prompt_ids' key"))
        else:
            rows.append((prompt, None))
    return rows


def check_writable(path: str) -> Path:
    """Fails (OSError naming the path) before any work when the output cannot be written there."""
    out = Path(path)
    if out.is_dir():
        raise IsADirectoryError(f"--out {path!r} is a directory; give a file path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.with_name(f".{out.name}.tmp")
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise OSError(f"--out {path!r} cannot be written: {e.strerror or e}") from e
    return out


def cmd_generate(args) -> int:
    from .engine import Engine, EngineConfig, SamplingParams
    from .model import load_model
    from .spec.config import SpecConfig

    try:
        sampling = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop or [])
        config = EngineConfig(kv_cache_gb=args.kv_cache_gb, max_num_seqs=args.max_num_seqs, seed=args.seed or 0,
                              spec=SpecConfig(mode=args.spec, seed=args.seed or 0),
                              batch_invariant={"true": True, "false": False}.get(args.batch_invariant, "auto"))
        out = check_writable(args.out)
        rows = read_prompts(args.prompts) if args.prompts else [(p, None) for p in DEFAULT_PROMPTS]
        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
        learned = None
        if args.drafter:
            from .drafter import load_drafter
            from .drafter.propose import LearnedDrafter

            learned = LearnedDrafter(load_drafter(args.drafter, model))
        elif args.spec == "learned":
            raise ValueError("--spec learned needs --drafter DIR (from `tailrl drafter train`)")
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    chat = not args.no_chat and tokenizer is not None and getattr(tokenizer, "chat_template", None)
    prompts = [[{"role": "user", "content": p}] if chat and isinstance(p, str) and p else p for p, err in rows if err is None]
    from .drafter.compose import make_speculator

    try:
        engine = Engine(model, tokenizer, config, make_speculator(config.spec, learned))
    except RuntimeError as e:  # batch_invariant=true where the start-up probe found the kernels vary
        print(f"error: {e}", file=sys.stderr)
        return 2
    v = engine.invariance
    print(f"batch invariance: {'on' if engine.runner.invariant else 'off'}"
          + (f" (probe {v.summary()}, {v.seconds:.2f} s)" if v is not None else " (not probed: fp32 or CUDA with auto)"))
    for epoch in range(args.epochs - 1):  # earlier epochs feed the history drafter, as in RL
        engine.generate(prompts, sampling, progress=not args.quiet)
        print(f"epoch {epoch}: {json.dumps(engine.last_stats.summary())}")
    completions = iter(engine.generate(prompts, sampling, progress=not args.quiet))
    counts: dict[str, int] = {}
    tmp = out.with_name(f".{out.name}.tmp")
    with tmp.open("w") as f:
        for index, (prompt, err) in enumerate(rows):
            for j in range(sampling.n):
                if err is not None:
                    rec = {"index": index, "sample": j, "finish_reason": "error", "error": err}
                else:
                    c = next(completions)
                    rec = {"index": index, "sample": j, "prompt": prompt, "text": c.text, "token_ids": c.token_ids,
                           "logprobs": c.logprobs, "finish_reason": c.finish_reason, "error": c.error, "timing": c.timing,
                           "spec": c.stats}
                if rec["error"] and j == 0:
                    print(f"warning: row {index}: {rec['error']}", file=sys.stderr)
                counts[rec["finish_reason"]] = counts.get(rec["finish_reason"], 0) + 1
                f.write(json.dumps(rec) + "\n")
    os.replace(tmp, out)  # readers never see half a file
    st = engine.last_stats
    print(f"{sum(counts.values())} completions ({', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))}), "
          f"{st.generated_tokens} tokens in {st.total_s:.1f}s = {st.tokens_per_s:.1f} tok/s -> {out}")
    if args.spec != "off":
        print(f"speculation: {json.dumps(st.summary())}")
    return 0


def cmd_train(args) -> int:
    from .config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .report import make_report
    from .rl.checkpoint import CheckpointError
    from .rl.guards import RunStalledError
    from .rl.reward_runner import RewardError
    from .rl.run import train
    from .rl.run_dir import RunDirError
    from .rl.stop import Interrupted

    try:
        run_dir = train(cfg)
    except Interrupted as e:
        ckpts = Path(cfg.trainer.out_dir) / "checkpoints"
        where = f"{ckpts / e.latest}" if e.latest else "none yet (a resumed run starts fresh)"
        cmd = ["tailrl", "train", *([args.config] if args.config else []),
               *(o for o in args.overrides if not o.split("=")[0].strip() in ("trainer.resume", "trainer.overwrite")),
               "trainer.resume=true"]
        print(f"\nstopped by {e} after step {e.step if e.step is not None else 0}; latest checkpoint: {where}\n"
              f"resume with: {shlex.join(cmd)}", file=sys.stderr)
        return e.exit_code
    except (ValueError, OSError, RunDirError, CheckpointError, RunStalledError, RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.trainer.report:
        print(f"report: {make_report(run_dir)} (plots: {run_dir / 'report.png'})")
    print(f"metrics: {run_dir / 'metrics.jsonl'}; tensorboard --logdir {run_dir / 'tensorboard'}")
    return 0


def cmd_report(args) -> int:
    from .report import make_report

    try:
        print(f"report: {make_report(args.run_dir)}")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_data(args) -> int:
    from .rl.tasks import make_rows, write_rows

    try:
        rows = make_rows(args.task, args.n, args.seed, args.levels)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_rows(rows, args.out)
    print(f"{len(rows)} {args.task} rows -> {args.out}")
    return 0


def _prompt_set(data: str, limit: int, seed: int) -> list:
    """Chat prompts from a dataset file (JSONL/Parquet with 'prompt') or a built-in task name."""
    from .rl.data import chat_prompt, read_table
    from .rl.tasks import make_rows

    if Path(data).suffix in (".jsonl", ".json", ".parquet") or Path(data).exists():
        rows = [r for _, r in read_table(data) if isinstance(r, dict) and r.get("prompt")]
    else:
        rows = make_rows(data, limit, seed)
    prompts = [chat_prompt(r["prompt"]) for r in rows[:limit]]
    if not prompts:
        raise ValueError(f"no prompts in {data!r} (rows need a 'prompt')")
    return prompts


def cmd_drafter_train(args) -> int:
    from .drafter import DrafterConfig, save_drafter
    from .drafter.offline import train_offline
    from .model import load_model

    try:
        cfg = DrafterConfig(draft_vocab=args.draft_vocab, lr=args.lr, batch_tokens=args.batch_tokens)
        prompts = _prompt_set(args.data, args.limit, args.seed)
        model, tokenizer = load_model(args.model, device=args.device)
        if tokenizer is None:
            raise ValueError(f"model {args.model!r} has no tokenizer; the prompts need one")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"generating {args.n} x {len(prompts)} answers with {args.model}, then {args.epochs} epochs of drafter training")
    head, metrics = train_offline(model, tokenizer, prompts, cfg, n=args.n, max_tokens=args.max_tokens,
                                  temperature=args.temperature, epochs=args.epochs, seed=args.seed, progress=not args.quiet)
    save_drafter(head, args.out, meta={"offline": {k: v for k, v in metrics.items() if k != "final_train"}})
    print(json.dumps(metrics, indent=2))
    print(f"drafter -> {args.out}")
    return 0


def cmd_drafter_export(args) -> int:
    from .drafter import load_drafter, save_drafter

    src = Path(args.source)
    if (src / "checkpoints" / "latest").is_file():  # a run folder: its latest checkpoint
        src = src / "checkpoints" / (src / "checkpoints" / "latest").read_text().strip()
    if (src / "drafter").is_dir():  # a checkpoint folder
        src = src / "drafter"
    try:
        head = load_drafter(src)
        if args.embeddings:
            from .model import load_model

            if not args.model:
                raise ValueError("--embeddings needs --model (the target whose embedding to store)")
            head.bind(load_model(args.model, device="cpu", dtype=head.fc.weight.dtype)[0])
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    save_drafter(head, args.out, embeddings=args.embeddings)
    print(f"EAGLE drafter ({head.config.model_type}, draft vocabulary {head.draft_vocab_size}) -> {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailrl", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="sample completions for a prompts JSONL with the rollout engine")
    g.add_argument("--model", default="smollm2-135m", help="known name, HF checkpoint folder or .gguf file")
    g.add_argument("--prompts", help="JSONL with a 'prompt' (text or chat messages) per row; default: built-in prompts")
    g.add_argument("--out", default="out/generate.jsonl")
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--no-chat", action="store_true", help="feed text prompts raw instead of through the chat template")
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bf16 on CUDA and on CPUs with bf16 matrix hardware, else fp32 (as model.dtype in train)")
    g.add_argument("--kv-cache-gb", type=float, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--batch-invariant", default="auto", choices=["auto", "true", "false"],
                   help="SD on and off emit the very same tokens (engine/invariant.py); auto: bf16 on a CPU, if the probe holds")
    g.add_argument("--spec", default="auto", choices=["auto", "off", "history", "ngram", "learned"],
                   help="speculative decoding: auto = the selector decides per batch size")
    g.add_argument("--drafter", help="a learned drafter folder (tailrl drafter train) to draft with")
    g.add_argument("--epochs", type=int, default=1, help="generate the prompt set this many times (history drafts)")
    g.add_argument("--quiet", action="store_true")
    g.set_defaults(func=cmd_generate)
    t = sub.add_parser("train", help="GRPO/DAPO training with speculative rollout (built-in default: SmolLM2 on arithmetic)")
    t.add_argument("config", nargs="?", help="YAML config; omit for the built-in default")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.lr=1e-5 rollout.spec.mode=off")
    t.set_defaults(func=cmd_train)
    r = sub.add_parser("report", help="(re)build the plots and report of a run folder")
    r.add_argument("run_dir")
    r.set_defaults(func=cmd_report)
    d = sub.add_parser("data", help="generate datasets")
    dsub = d.add_subparsers(dest="data_command", required=True)
    mk = dsub.add_parser("make", help="write a built-in verifiable task as JSONL")
    mk.add_argument("task", help="arithmetic | countdown")
    mk.add_argument("--n", type=int, default=1000)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--levels", type=int, nargs="*", default=[], help="difficulty levels to keep (default: all)")
    mk.add_argument("--out", required=True)
    mk.set_defaults(func=cmd_data)
    dr = sub.add_parser("drafter", help="the learned (EAGLE) drafter: offline training and export")
    drsub = dr.add_subparsers(dest="drafter_command", required=True)
    dt = drsub.add_parser("train", help="train a drafter on the model's own answers to a prompt set")
    dt.add_argument("--model", default="smollm2-135m")
    dt.add_argument("--data", default="arithmetic", help="JSONL/Parquet with a 'prompt' per row, or a built-in task")
    dt.add_argument("--out", default="out/drafter")
    dt.add_argument("--limit", type=int, default=256, help="prompts to use")
    dt.add_argument("--n", type=int, default=4, help="answers per prompt")
    dt.add_argument("--max-tokens", type=int, default=96)
    dt.add_argument("--temperature", type=float, default=1.0)
    dt.add_argument("--epochs", type=int, default=8)
    dt.add_argument("--lr", type=float, default=3e-4)
    dt.add_argument("--batch-tokens", type=int, default=2048)
    dt.add_argument("--draft-vocab", type=int, default=4096, help="0 = the full vocabulary")
    dt.add_argument("--seed", type=int, default=0)
    dt.add_argument("--device", default=None)
    dt.add_argument("--quiet", action="store_true")
    dt.set_defaults(func=cmd_drafter_train)
    de = drsub.add_parser("export", help="write a drafter (folder, RL checkpoint or run) in the EAGLE layout SGLang/vLLM load")
    de.add_argument("source", help="drafter folder, checkpoint folder, or run folder (its latest checkpoint)")
    de.add_argument("--out", required=True)
    de.add_argument("--embeddings", action="store_true", help="also store the target's embedding (needs --model)")
    de.add_argument("--model", default=None)
    de.set_defaults(func=cmd_drafter_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if getattr(args, "config", None) and "=" in args.config:  # `tailrl train key=value ...` without a YAML
        args.overrides, args.config = [args.config, *args.overrides], None
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
