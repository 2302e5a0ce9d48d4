from .engine import Engine, EngineConfig, GenerateStats
from .sampling import SamplingParams
from .sequence import Completion

__all__ = ["Completion", "Engine", "EngineConfig", "GenerateStats", "SamplingParams"]
