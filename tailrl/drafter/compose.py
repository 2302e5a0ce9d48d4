"""Composing the speculator with the learned drafter: the caller's job (rl, cli), so the engine never imports
a drafter."""

from __future__ import annotations

from ..speculative.config import SpecConfig
from ..speculative.drafters import FallbackDrafter, model_free_drafters
from ..speculative.speculator import Speculator
from .propose import LearnedDrafter


def make_speculator(spec: SpecConfig, learned: LearnedDrafter | None = None) -> Speculator | None:
    """The mode's model-free drafters, plus (modes auto and learned) the learned head and history+learned."""
    if spec.mode == "off":
        return None
    if spec.mode == "learned" and learned is None:
        raise ValueError("spec mode 'learned' needs a learned drafter (drafter.enabled or drafter.path)")
    drafters = model_free_drafters(spec)
    if learned is not None and spec.mode in ("auto", "learned"):
        history = next((d for d in drafters if d.name == "history"), None)
        drafters.append(learned)
        if history is not None:
            drafters.append(FallbackDrafter([history, learned]))
    return Speculator(spec, drafters)
