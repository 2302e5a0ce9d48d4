"""`tailrl generate`: sample completions for a prompts JSONL with the rollout engine."""

from __future__ import annotations

import json
import os
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
    from .speculative.config import SpecConfig

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


def add_parser(sub) -> None:
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
