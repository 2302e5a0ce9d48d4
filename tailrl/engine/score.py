"""Our model as the audit's target scorer (speculative/impossible.py): the warped log p of every emitted token.

The distribution is the one our engine samples from (engine/sampler.warped_logprobs: temperature, then top-k, then
top-p; -inf outside the support) and the trainer scores under (rl/actor/logprobs.py, through the same
`warp_mask`), so an engine's reported logprobs are checked against what the trainer's importance weights compare
them with.

A prompt's responses are scored in one forward over the prompt once and every response after it
(`CausalLM.forward_shared`, the trainer's layout, rl/actor/packing.py): each response reads the prompt's keys and
values (computed once) and then its own, causally, at the positions its own sequence has, so each token's log p is
that of its own sequence, the same products summed in another order than one forward per response (fp32: within
2e-5 on the tiny models of tests/engine/test_score.py, 4e-5 on SmolLM2 for random tokens; the audit's logprob bound is
0.05). The prompt's last row predicts every response's first token. Responses go in pieces whose logit rows stay
near 128 MB; each piece computes the prompt once. SmolLM2, one audit prompt (58 tokens) with 16 responses of 8-64
tokens, 1 thread of a Zen 3: 5.3 s against 11.5 s with one forward per response (benchmarks/audit_scorer.py)."""

from __future__ import annotations

import torch

from ..model.llama import SharedPrompts
from ..speculative.impossible import TargetScorer
from .sampler import warped_logprobs

LOGIT_BUDGET = 1 << 25  # floats of logits per forward


def pieces(lengths: list[int], rows: int) -> list[list[int]]:
    """Consecutive response indices in pieces of at most `rows` tokens (a longer response is a piece alone)."""
    out, used = [[]], 0
    for i, n in enumerate(lengths):
        if out[-1] and used + n > rows:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


def shared_prompt(prompt: list[int], responses: list[list[int]], device):
    """(tokens, positions, SharedPrompts, rows, targets) of one prompt and its responses: the prompt's tokens, then
    each response's inputs (all its tokens but the last); rows: the packed row whose hidden state predicts each
    response token, in response order."""
    P, M = len(prompt), len(responses)
    R = max(1, max((len(r) - 1 for r in responses), default=1))
    toks, pos, r_idx, rows = list(prompt), list(range(P)), [], []
    for m, r in enumerate(responses):
        if not r:
            continue
        rows += [P - 1] + list(range(len(toks), len(toks) + len(r) - 1))
        toks += r[:-1]
        pos += range(P, P + len(r) - 1)
        r_idx += range(m * R, m * R + len(r) - 1)
    causal = torch.ones(R, R, dtype=torch.bool).tril()
    mask = torch.cat([torch.ones(R, P, dtype=torch.bool), causal], dim=1).expand(M, 1, R, P + R)

    def t(xs):
        return torch.tensor(xs, dtype=torch.long, device=device)

    lay = SharedPrompts(1, P, M, R, t(range(P)), t(r_idx), t([0] * M), mask.to(device))
    return t(toks), t(pos), lay, t(rows), t([x for r in responses for x in r])


def model_scorer(model, top_k: int = 0, top_p: float = 1.0) -> TargetScorer:
    vocab = model.lm_head.weight.shape[0]
    device = model.lm_head.weight.device

    @torch.no_grad()
    def score(prompt: list[int], responses: list[list[int]], temperature: float) -> list[list[float]]:
        out: list[list[float]] = [[] for _ in responses]
        for piece in pieces([len(r) for r in responses], max(1, LOGIT_BUDGET // vocab)):
            chunk = [list(responses[i]) for i in piece]
            if not any(chunk):
                continue
            toks, pos, lay, rows, targets = shared_prompt(prompt, chunk, device)
            hidden = model.forward_shared(toks, pos, lay)
            logits = model.lm_head(hidden[rows])
            n = len(logits)
            logp = warped_logprobs(logits, torch.full((n,), float(temperature), device=device),
                                   torch.full((n,), top_k, device=device) if top_k > 0 else None,
                                   torch.full((n,), top_p, device=device) if top_p < 1 else None)
            got = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double().tolist()
            k = 0
            for i, r in zip(piece, chunk):
                out[i] = got[k : k + len(r)]
                k += len(r)
        return out

    return TargetScorer(score, vocab)


@torch.no_grad()
def per_response(model, prompt: list[int], responses: list[list[int]], temperature: float, top_k: int = 0,
                 top_p: float = 1.0) -> list[list[float]]:
    """One forward per response over its own sequence (prompt + response): the computation `model_scorer` replaced,
    kept as its reference (tests/engine/test_score.py, benchmarks/audit_scorer.py)."""
    out = []
    for r in responses:
        if not r:
            out.append([])
            continue
        logits = model.forward_full(torch.tensor([prompt + r]), logits_start=len(prompt) - 1)[0][0, :-1]
        n = len(logits)
        logp = warped_logprobs(logits, torch.full((n,), temperature), torch.full((n,), top_k) if top_k else None,
                               torch.full((n,), top_p) if top_p < 1 else None)
        out.append(logp.gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1).double().tolist())
    return out


@torch.no_grad()
def sequence_logprobs(model, seq: list[int]) -> torch.Tensor:
    """log p(seq[t] | seq[:t]) for t >= 1 under our model (T 1, no warping; the softmax in float64): what another
    engine's prompt logprobs are checked against (tests/rollout/vllm_checks.py, benchmarks/vllm_impossible.py)."""
    logits = model.forward_full(torch.tensor([seq]))[0][0].double()
    return torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1)
