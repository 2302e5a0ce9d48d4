from .config import EngineConfig
from .engine import Engine, StepOutput
from .requests import SeqState
from .sampling import SamplingParams
from .sequence import Completion
from .stats import Completions, GenerateStats, StepRecord

__all__ = ["Completion", "Completions", "Engine", "EngineConfig", "GenerateStats", "SamplingParams", "SeqState",
           "StepOutput", "StepRecord"]
