"""Per-step cost model of one engine forward, shared by the migration rule and the cluster simulation.

A forward over `tokens` new tokens that attend to `attn` (query, key) pairs costs
    base_s + per_token_s * tokens + per_attn_s * attn
(launch/Python overhead, the GEMMs, attention). A decode step of B sequences with total context C is
(tokens = B, attn = C); a verification step with q tokens per sequence is (B*q, C*q); a prefill of P tokens is
(P, P*P/2). Fitted by least squares to measured forwards (`fit`), as RLHFSpec profiles verify cost against
batch size and token count (seed notes, section 2)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepCost:
    base_s: float = 0.030
    per_token_s: float = 0.0035
    per_attn_s: float = 0.0

    def forward(self, tokens: float, attn: float = 0.0) -> float:
        return self.base_s + self.per_token_s * tokens + self.per_attn_s * attn

    def decode(self, batch: float, context: float = 0.0, q: float = 1.0) -> float:
        """One decode (q = 1) or verification (q = 1 + draft nodes) step of `batch` sequences, total context."""
        return self.forward(batch * q, context * q) if batch > 0 else 0.0

    def prefill(self, tokens: float) -> float:
        return self.forward(tokens, tokens * tokens / 2) if tokens > 0 else 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def fit(cls, samples: list[tuple[float, float, float]]) -> StepCost:
        """samples: (tokens, attn, seconds) per measured forward; coefficients are clamped at >= 0."""
        import numpy as np

        a = np.array([[1.0, t, c] for t, c, _ in samples])
        y = np.array([s for _, _, s in samples])
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        if coef[2] < 0:  # attention too small to resolve: refit without it
            coef2, *_ = np.linalg.lstsq(a[:, :2], y, rcond=None)
            coef = [*coef2, 0.0]
        return cls(*(max(float(c), 0.0) for c in coef))
