from .engine import Completions, Engine, EngineConfig, GenerateStats
from .sampling import SamplingParams
from .sequence import Completion

__all__ = ["Completion", "Completions", "Engine", "EngineConfig", "GenerateStats", "SamplingParams"]
