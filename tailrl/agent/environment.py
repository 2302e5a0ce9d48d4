"""Environments: a class with state, one instance per trajectory, whose public methods are its tools.

The field's interface (TRL `environment_factory`, verifiers' `ToolEnv`): `reset(row) -> str | None` gets the
dataset row before the first turn and may return text that is appended to the first user message; each public
method (type hints + Google docstring, as any tool) is a tool bound to this instance, so calls of one trajectory
share state and two trajectories never do; an optional `reward() -> float` is read at the end of the trajectory.
Invariant: `env_tools` exposes exactly the public methods other than `reset` and `reward`, each with a schema,
or fails when the environment is loaded.
"""

from __future__ import annotations

import inspect
import math
from typing import Protocol, runtime_checkable

from ..user_code import load_object
from .tool import Tool, make_tool

RESERVED = ("reset", "reward")


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict) -> str | None: ...


def load_environment(spec: str) -> type:
    """The environment class named by "module:Class" (or "path/file.py:Class"); ValueError naming `spec`."""
    cls = load_object(spec, "environment")
    if not inspect.isclass(cls):
        raise ValueError(f"environment spec {spec!r} names a {type(cls).__name__}, not a class")
    try:
        instance = cls()
    except TypeError as e:
        raise ValueError(f"environment spec {spec!r}: {cls.__name__}() must take no arguments "
                         f"(one instance per trajectory; the row comes through reset(row)): {e}") from e
    tools = env_tools(instance)
    if not tools:
        raise ValueError(f"environment spec {spec!r}: {cls.__name__} has no public methods to call as tools")
    return cls


def _public_methods(cls: type) -> list[str]:
    names: list[str] = []
    for klass in reversed(cls.__mro__[:-1]):  # base classes first, each in definition order; `object` left out
        for name, attr in vars(klass).items():
            if name.startswith("_") or name in RESERVED or name in names:
                continue
            if isinstance(attr, (staticmethod, classmethod)) or inspect.isfunction(attr):
                names.append(name)
    return names


def env_tools(instance) -> dict[str, Tool]:
    """The instance's public methods (except reset/reward) as tools bound to it, in definition order."""
    return {name: make_tool(getattr(instance, name), name=name) for name in _public_methods(type(instance))}


def env_reset(instance, row: dict) -> str | None:
    """Call `instance.reset(row)` where it exists; its text (or None) is appended to the first user message."""
    reset = getattr(type(instance), "reset", None)
    if reset is None:
        return None
    text = instance.reset(row)
    if text is not None and not isinstance(text, str):
        raise TypeError(f"{type(instance).__name__}.reset returned {type(text).__name__}; it must return str or None")
    return text


def env_reward(instance) -> float | None:
    """`instance.reward()` as a finite float, or None where the environment has no `reward` method."""
    reward = getattr(type(instance), "reward", None)
    if reward is None:
        return None
    value = float(instance.reward())
    if not math.isfinite(value):
        raise ValueError(f"{type(instance).__name__}.reward returned {value}; a reward must be finite")
    return value
