"""The tool interface: plain Python functions the model may call, each with a JSON schema from its type hints and
docstring (`Tool`, `make_tool`), and the errors a tool raises for the model to read. The built-ins and loading by
name sit above it, in toolbox.py.

A tool is the field's interface (TRL `tools=`, verl `@function_tool`): a sync or async function with type hints on
every parameter and a Google-style docstring that describes each one; `transformers.utils.get_json_schema` turns it
into the schema a chat template shows the model. Invariant: every `Tool` that exists has a valid schema, so a bad
function fails when it is loaded (with its name and what is missing), never in the middle of a run.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable


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
