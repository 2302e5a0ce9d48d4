"""The toolbox: the built-in tools (calculator, python) and tools loaded by name (`agent.tools=[...]`: a built-in
or `module:function`), above the tool interface (tool.py) and the built-ins themselves."""

from __future__ import annotations

import inspect
from typing import Callable

from ..user_code import load_object
from .tool import Tool, make_tool

BUILTIN_TOOLS = ("calculator", "python")


def _builtin(spec: str) -> Callable:
    if spec == "calculator":
        from .calculator import calculator
        return calculator
    from .sandbox import python
    return python


def load_tools(specs: list[str]) -> dict[str, Tool]:
    """Tools by name from specs: "calculator" and "python" are built in, anything else is "module:function".

    ValueError naming the spec for a module that does not import, a missing attribute, an object that is not
    callable, a function without hints or docstring, and two tools with one name.
    """
    tools: dict[str, Tool] = {}
    for spec in specs:
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"tool spec {spec!r} is not a non-empty string")
        spec = spec.strip()
        if spec in BUILTIN_TOOLS:
            tool = make_tool(_builtin(spec), name=spec)
        elif ":" in spec:
            obj = load_object(spec, "tool")
            if isinstance(obj, Tool):
                tool = obj
            elif not callable(obj) or inspect.isclass(obj):
                raise ValueError(f"tool spec {spec!r} names a {type(obj).__name__}, not a function")
            else:
                tool = make_tool(obj)
        else:
            raise ValueError(f"unknown tool {spec!r}: use one of {', '.join(BUILTIN_TOOLS)} or module:function")
        if tool.name in tools:
            raise ValueError(f"tool spec {spec!r}: a tool named {tool.name!r} is already loaded")
        tools[tool.name] = tool
    return tools
