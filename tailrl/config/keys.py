"""Dotted config keys over nested dataclasses: the valid keys under a class, setting one from YAML or an override
(`algo.lr=3e-5`), and the one-line error for a key that does not exist, with the nearest valid ones."""

from __future__ import annotations

import dataclasses
import typing

from .help import REMOVED, did_you_mean, or_list
from .values import ConfigError, coerce


def valid_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        t = field_type(cls, f.name)
        if dataclasses.is_dataclass(t):
            keys += valid_keys(t, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def field_type(cls, name: str):
    return typing.get_type_hints(cls)[name]


def unknown_key(full: str, root) -> ConfigError:
    """One line: the key and the nearest valid ones of the root config class."""
    if full in REMOVED:
        return ConfigError(f"key {full!r} was removed: {REMOVED[full]}")
    near = did_you_mean(full, valid_keys(root))
    hint = f"did you mean {or_list(near)}?" if near else "`tailrl config show` lists the valid keys"
    return ConfigError(f"unknown key {full!r}; {hint}")


def set_key(obj, parts: list[str], value, full: str, root) -> None:
    """obj.<parts> = value (coerced to the field's type); a section takes a mapping of its keys."""
    name = parts[0]
    names = [f.name for f in dataclasses.fields(obj)]
    if name not in names:
        raise unknown_key(full, root)
    t = field_type(type(obj), name)
    if len(parts) > 1:
        if not dataclasses.is_dataclass(t):
            raise unknown_key(full, root)
        set_key(getattr(obj, name), parts[1:], value, full, root)
    elif dataclasses.is_dataclass(t):
        if not isinstance(value, dict):
            raise ConfigError(f"config key {full!r} is a section; give its keys ({', '.join(valid_keys(t, full + '.'))})")
        for k, v in value.items():
            set_key(getattr(obj, name), [k], v, f"{full}.{k}", root)
    else:
        setattr(obj, name, coerce(value, t, full))
