"""`tailrl audit`: is a backend's speculative decoding lossless? SD on vs off on the same prompts
(speculative/audit.py), pass or fail with the figures."""

from __future__ import annotations

import json
import os
import sys
import time

from .tasks import audit_prompts  # noqa: F401 - also what benchmarks/ import from here

def engine_sampler(engine):
    """A speculative/audit.py Sampler drawing from one of our engines (with the logprobs it reports)."""
    from .engine import SamplingParams
    from .speculative.audit import Response

    def sample(prompts, temperature, n, max_tokens, seed):
        params = [SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, seed=seed + 7919 * i)
                  for i in range(len(prompts))]
        out = [[] for _ in prompts]
        for c in engine.generate(prompts, params):
            out[c.prompt_index].append(Response(c.token_ids, c.logprobs))
        return out

    return sample


def timed(sample, arm: str):
    """The sampler, saying on stderr what each draw took (an audit samples for minutes)."""
    def run(prompts, temperature, n, max_tokens, seed):
        t0 = time.perf_counter()
        out = sample(prompts, temperature, n, max_tokens, seed)
        tokens = sum(len(r) for per_prompt in out for r in per_prompt)
        print(f"audit: {arm} at T {temperature:g}: {tokens} tokens in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
        return out

    return run


def tailrl_arms(model, tokenizer, spec_mode: str, seed: int = 0, **spec_args):
    """(off, on, encode): our engine without and with speculation of the given mode."""
    from .drafter.compose import make_speculator
    from .engine import Engine, EngineConfig
    from .speculative.config import SpecConfig

    spec = SpecConfig(mode=spec_mode, seed=seed, **spec_args)
    off = Engine(model, tokenizer, EngineConfig(seed=seed, kv_cache_gb=1.0))
    on = Engine(model, tokenizer, EngineConfig(seed=seed, kv_cache_gb=1.0, spec=spec), make_speculator(spec))
    return engine_sampler(off), engine_sampler(on), off.encode


def cmd_audit(args) -> int:
    from .engine.score import model_scorer
    from .speculative.audit import AuditConfig, audit, context_needed, tol_for
    from .speculative.impossible import TargetScorer

    note = ""  # vLLM-CPU's repair (rollout/vllm/repair.py), said where it is active
    try:
        if args.backend == "tailrl":
            from .model import load_model

            if args.spec not in ("auto", "history", "ngram"):
                raise ValueError(f"--spec {args.spec} is not a speculation of backend tailrl (auto, history, ngram)")
            model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
            off, on, encode = tailrl_arms(model, tokenizer, args.spec, args.seed)
            version, scorer, tol = "tailrl", model_scorer(model), tol_for(model.dtype)
            context = model.config.max_position_embeddings
        else:
            # vLLM logs to stdout at INFO by default: to stderr here, at WARNING unless -v, so stdout is the report
            os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if getattr(args, "verbose", False) else "WARNING")
            from .rollout.vllm.audit import model_context, vllm_arms
            from .rollout.vllm.llm import hf_folder, repair_note

            off, on, encode, version, scorer, tol = vllm_arms(args.model, args.spec, args.dtype, args.seed)
            note = repair_note()
            context = model_context(hf_folder(args.model))
        cfg = AuditConfig(temperatures=tuple(args.temperatures), n=args.n, max_tokens=args.max_tokens,
                          positions=args.positions, alpha=args.alpha, seed=args.seed, logprob_tol=tol)
        prompts = audit_prompts(encode, args.prompts, args.seed)
        context_needed(prompts, cfg.max_tokens, context)  # before any sampling: an engine would cut responses short
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    label = f"{version} {args.spec}"
    print(f"audit of {label} on {args.model}: {len(prompts)} prompts x {cfg.n} responses per arm and temperature, "
          f"T {' '.join(f'{t:g}' for t in cfg.temperatures)}, max_tokens {cfg.max_tokens}, SD off against on; "
          f"every SD token scored by our model" + (f"\n{note}" if note else "") + "\n", flush=True)
    spent = [0.0, 0]

    def score(prompt, responses, temperature):
        t0 = time.perf_counter()
        out = scorer.score(prompt, responses, temperature)
        spent[0], spent[1] = spent[0] + time.perf_counter() - t0, spent[1] + sum(map(len, out))
        return out

    res = audit(timed(off, "SD off"), timed(on, "SD on"), prompts, cfg, label=label,
                scorer=TargetScorer(score, scorer.vocab))
    print(f"audit: our model scored the SD arm's {spent[1]} tokens in {spent[0]:.0f} s", file=sys.stderr, flush=True)
    print(res.table())
    print()
    print(res.verdict())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res.to_dict(), f, indent=1)
    return 0 if res.passed else 1


def add_parser(sub) -> None:
    a = sub.add_parser("audit", help="is a backend's speculative decoding lossless? (SD on vs off, chi-square + KS)")
    a.add_argument("--backend", default="tailrl", choices=["tailrl", "vllm"])
    a.add_argument("--spec", default="auto",
                   help="the speculation to audit: tailrl: auto | history | ngram | self; vllm: ngram | suffix | tailrl (ours)")
    a.add_argument("--model", default="smollm2-135m", help="known name, HF checkpoint folder or .gguf file")
    a.add_argument("--prompts", type=int, default=4, help="arithmetic prompts (levels 2-3, chat template)")
    a.add_argument("--n", type=int, default=64, help="responses per prompt, per arm and temperature")
    a.add_argument("--max-tokens", type=int, default=64)
    a.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    a.add_argument("--positions", type=int, default=4, help="chi-square on the tokens at the first K positions")
    a.add_argument("--alpha", type=float, default=0.01, help="false-alarm rate of the audit for a lossless engine")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--device", default=None)
    a.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    a.add_argument("--out", help="write the result as JSON here")
    a.set_defaults(func=cmd_audit)
