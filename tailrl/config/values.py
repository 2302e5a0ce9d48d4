"""Config values: YAML parsing (1.2 booleans), a dotted override's value, and a value coerced to its key's type
(a wrong one is a ConfigError naming the key)."""

from __future__ import annotations

import re
import types
import typing

import yaml


class ConfigError(ValueError):
    pass


class _Loader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true/false, so `spec.mode: off` stays the string 'off'."""


_Loader.yaml_implicit_resolvers = {
    k: [r for r in v if r[0] != "tag:yaml.org,2002:bool"] for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def parse_yaml(text: str):
    return yaml.load(text, Loader=_Loader)


def coerce(value, t, key: str):
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if value is None:
            return None
        for a in args:
            try:
                return coerce(value, a, key)
            except ConfigError:
                continue
        raise ConfigError(f"bad value for {key}: {value!r} is not {' or '.join(a.__name__ for a in args)}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            value = [value]
        (inner, *_) = typing.get_args(t) or (object,)
        items = [coerce(v, inner, key) for v in value]
        return tuple(items) if origin is tuple else items
    if t in (int, float) and isinstance(value, str):  # YAML reads 1e-4 as a string
        try:
            value = t(value)
        except ValueError:
            raise ConfigError(f"bad value for {key}: {value!r} is not {t.__name__}") from None
    if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if t is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if t in (int, float, str, bool) and not (isinstance(value, t) and not (t is int and isinstance(value, bool))):
        raise ConfigError(f"bad value for {key}: {value!r} is not {t.__name__}")
    return value


def override_value(raw: str):
    """A `key=value` override's value, parsed as YAML, except that a '#' is text there: YAML would cut
    'data.system_prompt=answer after #### 5' at ' #' as a comment."""
    if not raw.strip():
        return ""
    value = parse_yaml(raw)
    if "#" in raw and (value is None or isinstance(value, str)) and raw.strip()[0] not in "'\"":
        return raw.strip()
    return value
