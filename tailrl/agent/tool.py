"""Tools: plain Python functions the model may call, each with a JSON schema from its type hints and docstring.

A tool is the field's interface (TRL `tools=`, verl `@function_tool`): a sync or async function with type hints on
every parameter and a Google-style docstring that describes each one; `transformers.utils.get_json_schema` turns it
into the schema a chat template shows the model. Invariant: every `Tool` that exists has a valid schema, so a bad
function fails when it is loaded (with its name and what is missing), never in the middle of a run.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from dataclasses import dataclass
from typing import Callable

from ..user_code import import_user_module

BUILTIN_TOOLS = ("calculator", "python")


class ToolError(Exception):
    """Raised by a tool for an error the model should read: the pool returns `error: <message>` (status "error")."""


class ToolTimeout(ToolError):
    """Raised by a tool that ran out of its own time limit: the pool returns the message as it is (status "timeout")."""


@dataclass
class Tool:
    name: str
    fn: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters": {...}}}
    is_async: bool

    @property
    def parameters(self) -> dict:
        return self.schema["function"]["parameters"]


def _label(fn) -> str:
    mod = getattr(fn, "__module__", None)
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{mod}:{qual}" if mod else qual


def _missing_hints(fn) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    missing = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.annotation is inspect.Parameter.empty:
            missing.append(p.name)
    return missing


def make_tool(fn: Callable, name: str | None = None) -> Tool:
    """A `Tool` for `fn` (a function, async function or bound method); `name` overrides the schema's name.

    Raises ValueError naming the function and what is missing: a docstring, type hints on parameters, or a
    docstring line (`Args:` section) for a parameter.
    """
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    label = _label(fn)
    if not callable(fn):
        raise ValueError(f"tool {label!r} is not callable")
    if not inspect.getdoc(fn):
        raise ValueError(f"tool function {label!r} has no docstring: a tool needs a Google-style docstring "
                         "(a description line, then `Args:` with one line per parameter)")
    missing = _missing_hints(fn)
    if missing:
        raise ValueError(f"tool function {label!r} has no type hints for parameter(s) {', '.join(missing)}: "
                         "every parameter of a tool needs one (e.g. `expression: str`)")
    try:
        schema = get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as e:
        raise ValueError(f"tool function {label!r}: {e}") from e
    name = name or schema["function"]["name"]
    schema["function"]["name"] = name
    target = fn.__func__ if inspect.ismethod(fn) else fn
    return Tool(name=name, fn=fn, schema=schema, is_async=inspect.iscoroutinefunction(target))


def _builtin(spec: str) -> Callable:
    if spec == "calculator":
        from .calculator import calculator
        return calculator
    from .sandbox import python
    return python


def import_object(spec: str, what: str = "tool"):
    """The object named by `module:attr` (attr may be dotted) or `path/to/file.py:attr`; ValueError naming `spec`.

    A module that does not import from `sys.path` is tried once more from the current directory, so
    `agent.tools=[mymodule:lookup]` finds `./mymodule.py` whether tailrl was started as `python -m` or as a script.
    """
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"{what} spec {spec!r} is not of the form module:name")
    if mod_name.endswith(".py"):
        if not os.path.isfile(mod_name):
            raise ValueError(f"{what} spec {spec!r}: file {mod_name!r} does not exist")
        modspec = importlib.util.spec_from_file_location(os.path.basename(mod_name)[:-3], mod_name)
        module = importlib.util.module_from_spec(modspec)
        try:
            modspec.loader.exec_module(module)
        except Exception as e:
            raise ValueError(f"{what} spec {spec!r}: {mod_name} fails to import: {type(e).__name__}: {e}") from e
    else:
        try:
            module = import_user_module(mod_name)
        except Exception as e:
            raise ValueError(f"{what} spec {spec!r}: module {mod_name!r} does not import: "
                             f"{type(e).__name__}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} spec {spec!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj



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
            obj = import_object(spec)
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
