"""What goes into and out of one vllm.LLM, for the rollout in process (rollout.py) and in each Ray actor
(ray.py) alike: prompts sampled into plain `Drawn` records (what an actor sends back), with our proposer told
the prompts first and given the samples as history after; the policy's weights streamed in by name.

Weights: a stream of (name, tensor) pairs into `collective_rpc("reload_weights")`, which runs vLLM's own checkpoint
loader on them, so its packed CPU linears are re-packed (a raw `model.load_weights` fails on CPU)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch


@dataclass
class Drawn:
    """One sample as vLLM returned it, in plain types (what a Ray actor sends back)."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None


def draw(llm, prompts: list[list[int]], params: dict, proposer: bool) -> tuple[list[list[Drawn]], dict | None]:
    """prompts sampled with SamplingParams(**params): per prompt its samples in sample order, and our proposer's
    counters of this rollout (None without it). The proposer is told the prompts first (it matches rows to them
    by token prefix), and its samples become history at the end."""
    from vllm import SamplingParams

    from .proposer import end_rollout, push_prompts

    if proposer:
        llm.collective_rpc(push_prompts, args=(prompts,))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**params), use_tqdm=False)
    drawn = [[Drawn(list(o.token_ids), o.text,
                    [float(d[t].logprob) for t, d in zip(o.token_ids, o.logprobs)] if o.logprobs else [],
                    o.finish_reason) for o in sorted(out.outputs, key=lambda o: o.index)] for out in outs]
    return drawn, llm.collective_rpc(end_rollout)[0] if proposer else None


def history_counts(spec: dict, generated: int) -> dict:
    """Our proposer's counters of a rollout (proposer.fresh_stats) as GenerateStats.drafters["history"]: each
    sequence-step emits one token plus the drafts it accepted, so spec/accept_length/history reads as on our engine;
    later_drafted / later_accepted: those of an agent's turns k >= 1 (summed over Ray actors as the rest)."""
    return {"seq_steps": max(generated - spec["accepted"], 1), "proposals": spec["spec_steps"],
            "drafted": spec["drafted"], "accepted": spec["accepted"], "later_drafted": spec.get("later_drafted", 0),
            "later_accepted": spec.get("later_accepted", 0)}


def stream_weights(llm, named, dtype: torch.dtype, tied: bool) -> int:
    """(name, tensor) pairs into vLLM's model through its checkpoint loader (`reload_weights`), one at a time;
    returns the bytes sent. A tied LM head is skipped: vLLM ties it to the embedding itself."""
    sent = [0]

    def stream():
        for name, t in named:
            if tied and name == "lm_head.weight":
                continue
            t = t.detach().to(device="cpu", dtype=dtype)
            sent[0] += t.numel() * t.element_size()
            yield name, t

    llm.collective_rpc(quiet_expected_reload_warnings)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream(), "is_checkpoint_format": True})
    if tied:
        llm.collective_rpc(retie_lm_head)
    return sent[0]


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
# modules vLLM's layerwise reload warns about at every weight sync although nothing is wrong: a tied LM head (skipped
# on purpose, retied below) and the rotary embedding (no weights in a checkpoint, its cache restored by vLLM)
EXPECTED_UNLOADED = ("ParallelLMHead", "RotaryEmbedding")


class ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's "<module>: Failed to load weights" for the modules a weight sync leaves unloaded by design, so a
    run's log keeps WARNING for what a user should act on; any other module's stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.endswith(": Failed to load weights") and msg.split(":")[0] in EXPECTED_UNLOADED)


def quiet_expected_reload_warnings(worker=None) -> None:
    """Installs ExpectedReloadWarnings on vLLM's reload logger in the process it runs in (collective_rpc: the
    worker's), once."""
    log = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, ExpectedReloadWarnings) for f in log.filters):
        log.addFilter(ExpectedReloadWarnings())


def retie_lm_head(worker) -> None:
    """vLLM 0.32's layerwise reload restores a tied LM head's old tensors (nothing was loaded into it by name: its
    loader skips lm_head.weight when tied), so it would keep the first checkpoint's head; on CPU its prepacked
    GEMM also holds the old weight. Tie it to the new embedding again and, on CPU, pack it again."""
    m = worker.model_runner.get_model()
    lm, emb = m.lm_head, m.model.embed_tokens
    if lm.weight is not emb.weight:
        lm.weight = emb.weight
    if hasattr(lm, "cpu_linear"):
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(lm, remove_weight=False)
