"""Our model as the audit's target scorer (speculative/impossible.py): the warped log p of every emitted token.

The distribution is the one our engine samples from and the trainer recomputes (engine/sampler.warped_logprobs:
temperature, then top-k, then top-p; -inf outside the support), so an engine's reported logprobs are checked
against what the trainer's importance weights compare them with. Responses are scored in right-padded batches
(harmless under a causal mask), small enough that a batch's logits stay near 128 MB."""

from __future__ import annotations

import torch

from ..speculative.impossible import TargetScorer
from .sampler import warped_logprobs

LOGIT_BUDGET = 1 << 25  # floats of logits per forward


def model_scorer(model, top_k: int = 0, top_p: float = 1.0) -> TargetScorer:
    vocab = model.lm_head.weight.shape[0]
    device = model.lm_head.weight.device

    @torch.no_grad()
    def score(prompt: list[int], responses: list[list[int]], temperature: float) -> list[list[float]]:
        out = []
        longest = max(len(r) for r in responses)
        per = max(1, LOGIT_BUDGET // (max(longest, 1) * vocab))
        for i in range(0, len(responses), per):
            chunk = responses[i : i + per]
            width = len(prompt) + max(len(r) for r in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            for j, r in enumerate(chunk):
                ids[j, : len(prompt) + len(r)] = torch.tensor(prompt + r)
            logits = model.forward_full(ids.to(device), logits_start=len(prompt) - 1)[0][:, :-1]
            rows = logits.reshape(-1, vocab)
            n = len(rows)
            logp = warped_logprobs(rows, torch.full((n,), float(temperature), device=device),
                                   torch.full((n,), top_k, device=device) if top_k > 0 else None,
                                   torch.full((n,), top_p, device=device) if top_p < 1 else None)
            logp = logp.reshape(len(chunk), -1, vocab)
            for j, r in enumerate(chunk):
                tgt = torch.tensor(r, device=device).unsqueeze(-1)
                out.append(logp[j, : len(r)].gather(-1, tgt).squeeze(-1).double().tolist())
        return out

    return TargetScorer(score, vocab)
