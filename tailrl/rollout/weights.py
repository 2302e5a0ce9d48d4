"""Policy weights into the rollout engine's model, in process."""

from __future__ import annotations

import torch


def push_weights(policy: torch.nn.Module, engine_model: torch.nn.Module) -> None:
    """Copies every tensor of the policy's state dict into the engine model's tensor of the same name.

    Matching is by name, never by position: two modules that register the same parameters in another order
    get each tensor where it belongs, and a name present on one side only is an error naming it."""
    if policy is engine_model:
        return
    src, dst = policy.state_dict(), engine_model.state_dict()
    if src.keys() != dst.keys():
        only_src, only_dst = sorted(src.keys() - dst.keys()), sorted(dst.keys() - src.keys())
        raise ValueError(f"policy and engine model differ in parameters: only in the policy {only_src[:5]}, "
                         f"only in the engine model {only_dst[:5]}")
    with torch.no_grad():
        for name, d in dst.items():
            s = src[name]
            if s.shape != d.shape:
                raise ValueError(f"parameter {name}: policy shape {tuple(s.shape)}, engine shape {tuple(d.shape)}")
            d.copy_(s.to(dtype=d.dtype, device=d.device))
