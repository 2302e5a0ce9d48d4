"""The run's configuration (every section's dataclass, YAML + dotted overrides, did-you-mean, `tailrl config show`):
sections.py (the sections), load.py (load_config), actor.py (`actor:`, LoRA), agent.py (`agent:`, tools),
keys.py (dotted keys), values.py (YAML and values), help.py (help and `config show`). `from tailrl.config import X`
is the way in."""

from .actor import PROJECTIONS, ActorCfg, LoraCfg
from .agent import AgentConfig
from .load import load_config, to_dict, valid_keys
from .sections import (PARTIAL_TIS_CAP, SYSTEM_PROMPT, AlgoCfg, Config, DataCfg, ModelCfg, RewardCfg, RolloutCfg,
                       TrainerCfg)
from .values import ConfigError, parse_yaml

__all__ = ["PARTIAL_TIS_CAP", "PROJECTIONS", "SYSTEM_PROMPT", "ActorCfg", "AgentConfig", "AlgoCfg", "Config",
           "ConfigError", "DataCfg", "LoraCfg", "ModelCfg", "RewardCfg", "RolloutCfg", "TrainerCfg",
           "load_config", "parse_yaml", "to_dict", "valid_keys"]
