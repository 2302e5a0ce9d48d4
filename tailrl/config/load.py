"""Training configuration, loaded: defaults < a preset < YAML < dotted `key.sub=value` overrides. An unknown key is a
one-line error with the nearest valid keys ("did you mean algo.lr?"); a value of the wrong type or outside a key's
choices names the key (and the choices)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..cluster.config import ClusterConfig
from ..drafter.config import DrafterConfig
from ..presets import preset_file, preset_names
from ..speculative.config import SpecConfig
from . import keys as config_keys
from .actor import ActorCfg
from .agent import AgentConfig
from .help import choice_problem, did_you_mean, or_list
from .sections import Config
from .values import ConfigError, override_value, parse_yaml


def valid_keys(cls=Config, prefix: str = "") -> list[str]:
    return config_keys.valid_keys(cls, prefix)


def _set(obj, parts: list[str], value, full: str) -> None:
    config_keys.set_key(obj, parts, value, full, Config)


def load_config(path: str | None = None, overrides: list[str] = (), preset: str = "") -> Config:
    """defaults < the preset's YAML (tailrl/presets/) < the YAML at path < overrides."""
    cfg = Config()
    if preset and preset_file(preset) is None:
        near = did_you_mean(preset, preset_names())
        raise ConfigError(f"unknown preset {preset!r}; {f'did you mean {or_list(near)}? ' if near else ''}"
                          f"(presets: {', '.join(preset_names())})")
    for path in ([str(preset_file(preset))] if preset else []) + ([path] if path else []):
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path!r} not found")
        data = parse_yaml(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping of sections")
        for k, v in data.items():
            _set(cfg, [k], v, k)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value (`tailrl config show` lists the keys)")
        key, raw = item.split("=", 1)
        _set(cfg, key.strip().split("."), override_value(raw), key.strip())
    if why := choice_problem(cfg):
        raise ConfigError(why)
    for owner, name, cls in ((cfg.rollout, "spec", SpecConfig), (cfg, "drafter", DrafterConfig),
                             (cfg, "cluster", ClusterConfig), (cfg, "actor", ActorCfg),
                             (cfg, "agent", AgentConfig)):  # nested settings validate themselves on construction
        try:
            setattr(owner, name, cls(**dataclasses.asdict(getattr(owner, name))))
        except ValueError as e:
            raise ConfigError(f"bad {'rollout.' if owner is cfg.rollout else ''}{name} setting: {e}") from e
    if cfg.rollout.spec.mode == "learned" and not (cfg.drafter.enabled or cfg.drafter.path):
        raise ConfigError("rollout.spec.mode=learned needs drafter.enabled=true or a drafter.path")
    cfg.validate()
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
