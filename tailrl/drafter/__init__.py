"""The learned drafter: an EAGLE-style head over the target's hidden states, its data buffer, its offline and
online (spot) training, and its export as a standalone EAGLE checkpoint."""

from .compose import make_speculator
from .config import DrafterConfig
from .eagle import EagleDrafter, load_drafter, save_drafter
from .propose import LearnedDrafter

__all__ = ["DrafterConfig", "EagleDrafter", "LearnedDrafter", "load_drafter", "make_speculator", "save_drafter"]
