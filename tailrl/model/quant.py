"""Weight-only quantized copies of linear products: what the self-speculative drafter (speculative/self_draft.py)
runs the policy's own layers with.

A decode pass on a CPU at a few rows is bound by the bytes of weights it streams, so a copy of the weights in 8 or
4 bits drafts at a fraction of a target pass. torch's CPU kernels for weight-only products:

- int8: `aten._weight_int8pack_mm(x, w_int8 [N, K], scales [N])`, one scale per output row (symmetric);
- int4: `aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros [K / group, N, 2])`, asymmetric per
  group of `group` inner columns, w = (q - 8) * scale + zero (tinygemm's layout).

Neither kernel reuses a weight across rows as oneDNN's bf16 product does, so from some rows on (`quant_rows`, per
shape, measured on a 2-core Zen 4: benchmarks/RESULTS.md section 26) the drafter runs a product on the target's own
weights instead: a draft needs no particular weights to be lossless, only the verifier does."""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("int8", "int4")
INT4_GROUP = 32


@dataclass
class QLinear:
    """One quantized product: y = x @ dequant(w).T + bias, in the kernel of `kind`."""

    kind: str
    weight: torch.Tensor  # int8 [N, K], or the int4 kernel's packed layout
    scales: torch.Tensor  # int8: [N]; int4: [K / group, N, 2] scales and zeros
    bias: torch.Tensor | None
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2.to(self.scales.dtype).contiguous(), self.weight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), self.weight,
                                                          INT4_GROUP, self.scales)
        y = y.to(dtype)
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        return y.view(*lead, self.out_features)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scales.numel() * self.scales.element_size()


def quant_rows(out_features: int, in_features: int, kind: str) -> int:
    """The most rows a product of this shape runs in the quantized kernel; more run on the target's bf16 weights.
    Measured on SmolLM2-135M, 2-core Zen 4, against oneDNN's packed bf16 product (benchmarks/RESULTS.md section 26):
    a layer's products (at most 1536 x 576) in a whole pass, their weights streamed from memory, run faster
    quantized up to 16 rows (a draft level at 4 and 16 sequences: 0.55x / 0.71x of a plain step against 0.65x /
    0.97x with only single rows quantized), though with a weight in cache int8 loses from 4 rows; the LM head
    (49152 x 576), streamed either way, wins in int4 at 1 and 4 rows (0.84 / 1.7 ms against 2.5 / 2.0) and in int8
    at 1 row only (2.05 ms; 3.1 at 4 rows)."""
    if out_features * in_features >= 4 * 2**20:  # an LM head
        return 4 if kind == "int4" else 1
    return 16


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: (q [N, K] int8, scales [N] float32), w ~ q * scales[:, None]."""
    wf = w.detach().float()
    scales = wf.abs().amax(1).clamp_min(1e-12) / 127.0
    q = torch.round(wf / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group` inner columns: (q [N, K] int32 in 0..15, scales [N, K / group],
    zeros [N, K / group]) with w ~ (q - 8) * scale + zero."""
    N, K = w.shape
    wf = w.detach().float().view(N, K // group, group)
    lo, hi = wf.amin(-1), wf.amax(-1)
    scales = ((hi - lo) / 15.0).clamp_min(1e-12)
    q = torch.round((wf - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32).view(N, K)
    return q, scales, lo + 8 * scales


def dequantize(ql: QLinear, q: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weights [N, K] a QLinear multiplies by (its int8 weights, or the int4 codes `q` it was packed
    from)."""
    if ql.kind == "int8":
        return ql.weight.float() * ql.scales.float()[:, None]
    sz = ql.scales.float()  # [K / group, N, 2]
    scale, zero = sz[..., 0].t(), sz[..., 1].t()  # [N, K / group]
    codes = q.float().view(q.shape[0], -1, INT4_GROUP)
    return ((codes - 8) * scale[..., None] + zero[..., None]).view(q.shape)


def int4_fits(w: torch.Tensor) -> bool:
    N, K = w.shape
    return K % (2 * 16 * 2) == 0 and K % INT4_GROUP == 0 and N % 8 == 0  # two inner k-tiles of 16 (packed pairs)


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, kind: str) -> QLinear:
    """A quantized copy of one product's weight [N, K] (kind int8 or int4; int4 where the shape fits the kernel,
    else int8); the bias stays in its dtype."""
    if kind not in KINDS:
        raise ValueError(f"quantization kind {kind!r}: choose one of {', '.join(KINDS)}")
    b = None if bias is None else bias.detach().clone()
    w = weight.detach().to("cpu")
    if kind == "int4" and int4_fits(w):
        q, scales, zeros = quantize_int4(w)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        sz = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return QLinear("int4", packed, sz, b, w.shape[0])
    q, scales = quantize_int8(w)
    sdt = torch.bfloat16 if weight.dtype == torch.bfloat16 else torch.float32
    return QLinear("int8", q, scales.to(sdt), b, w.shape[0])
