from .config import ModelConfig, UnsupportedModelError
from .llama import CausalLM
from .load import load_model, resolve_model_path, save_pretrained
from .step import StepMeta, make_step

__all__ = ["CausalLM", "ModelConfig", "StepMeta", "UnsupportedModelError", "load_model", "make_step",
           "resolve_model_path", "save_pretrained"]
