"""Importing the user's own code named on the command line (`module:function` rewards, tools, environments)."""

from __future__ import annotations

import importlib
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
