"""`tailrl drafter train | export`: the learned (EAGLE) drafter offline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

def _prompt_set(data: str, limit: int, seed: int) -> list:
    """Chat prompts from a dataset file (JSONL/Parquet with 'prompt') or a built-in task name."""
    from .rl.data import read_table
    from .tasks import chat_prompt, make_rows

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


def add_parser(sub) -> None:
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
