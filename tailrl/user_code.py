"""Importing the user's own code named on the command line (`module:function` rewards, tools, environments): the one
`module:function` loader."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys


def import_user_module(name: str):
    """importlib.import_module, tried once more from the current directory when the module's top package is not found
    there: `reward.functions=[my_rewards:f]` or `agent.tools=[mytools:lookup]` finds ./my_rewards.py however tailrl
    was started (a console script's sys.path holds no working directory)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if e.name != name.split(".")[0] or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(name)


def load_object(spec: str, what: str):
    """The object named by `module:attr` (attr may be dotted) or `path/to/file.py:attr`: a reward function, a tool,
    an environment (`what` names which in the ValueError, which names `spec` and what went wrong).

    A module that does not import from `sys.path` is tried once more from the current directory (import_user_module).
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
            raise ValueError(f"{what} spec {spec!r}: module {mod_name!r} ({getattr(module, '__file__', '?')}) has no "
                             f"attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
