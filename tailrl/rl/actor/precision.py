"""Where the trainer's forward/backward runs, and in what precision, over fp32 master weights.

Modes (`model.train_compute`):
- float32: the master module itself, in fp32.
- autocast: the master module under torch.autocast(bf16): matrix products in bf16, weights cast per use.
- bfloat16: a bf16 copy of the weights computes (mixed precision with fp32 master weights, Micikevicius et al.
  2018): its gradients are added into the master's fp32 gradients after every micro-batch, AdamW updates the
  master, and the copy is refreshed from the master after each optimizer step (`after_step`).
On this CPU (AVX-512 BF16) the bf16 copy is the fastest of the three (benchmarks/update.py), since autocast
spends its gain re-casting weights and activations at every matrix product.

Invariants: the optimizer, its state and checkpoints only ever see the fp32 master; the compute copy is a pure
function of the master (so a resumed run computes what the original did); gradients are accumulated in fp32."""

from __future__ import annotations

import torch

MODES = ("auto", "float32", "autocast", "bfloat16")


def resolve_mode(mode: str, rollout_dtype: torch.dtype) -> str:
    """auto: bf16 compute when the rollout runs bf16 (the hardware multiplies bf16 well), else fp32."""
    if mode == "auto":
        return "bfloat16" if rollout_dtype == torch.bfloat16 else "float32"
    return mode


class Precision:
    def __init__(self, master: torch.nn.Module, mode: str, compute: torch.nn.Module | None = None):
        """compute: the bf16 module to run (the engine's bf16 model may serve: it gets the same weights after every
        update anyway); built from the master when not given."""
        self.master, self.mode = master, mode
        if mode == "bfloat16":
            if compute is None:
                compute = _bf16_copy(master)
            if compute.dtype != torch.bfloat16:
                raise ValueError(f"train_compute=bfloat16 needs a bf16 compute module, got {compute.dtype}")
            self.model = compute
            self.model.requires_grad_(True)
            names = dict(compute.named_parameters())
            self._pairs = [(p, names[n]) for n, p in master.named_parameters()]
        else:
            self.model = master
            self._pairs = []

    @property
    def autocast(self) -> bool:
        return self.mode == "autocast"

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def accumulate(self) -> None:
        """After a micro-batch's backward: its bf16 gradients into the master's fp32 gradients."""
        with torch.no_grad():
            for p, c in self._pairs:
                if c.grad is None:
                    continue
                if p.grad is None:
                    p.grad = c.grad.float()
                else:
                    p.grad.add_(c.grad)
                c.grad = None

    def zero_grad(self) -> None:
        for _, c in self._pairs:
            c.grad = None

    def after_step(self) -> None:
        """The master moved: the compute copy takes its new weights (rounded to bf16)."""
        with torch.no_grad():
            for p, c in self._pairs:
                c.copy_(p)


def make_adamw(params, **kwargs) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel where the parameters allow it (floating point, on CPU or CUDA): one pass over
    each tensor instead of a dozen elementwise ops. On this CPU a step over SmolLM2-135M's fp32 master takes 0.075 s
    fused against 0.52 s with the default (foreach) kernels (benchmarks/optimizer.py, in git at dc02aa5), and the
    default update takes 4 steps per RL step. The same algorithm; results differ from the foreach kernels by float
    rounding (tests/rl/test_update.py)."""
    params = list(params)
    if all(p.dtype.is_floating_point and p.device.type in ("cpu", "cuda") for p in params):
        try:
            return torch.optim.AdamW(params, fused=True, **kwargs)
        except (RuntimeError, TypeError):  # an older torch or an unsupported device/dtype mix
            pass
    return torch.optim.AdamW(params, **kwargs)


def _bf16_copy(master: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(master).to(torch.bfloat16)
