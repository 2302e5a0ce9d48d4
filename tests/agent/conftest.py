"""Tests of multi-turn tools (tailrl/agent/) and the tool turn loop.

Fixtures only these tests use go here; those several folders use are in tests/conftest.py."""

import pytest
import torch

from tailrl.model.tiny import TOOL_WORDS, make_tiny_chat_model


@pytest.fixture(scope="module")
def tool_chat_folder(tmp_path_factory):
    """A tiny chat model whose vocabulary has the calculator's tags: its random draws write calls, good and
    malformed (tests of tool rollouts)."""
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("toolchat"), seed=3, words=TOOL_WORDS))


@pytest.fixture(scope="module")
def tool_chat(tool_chat_folder):
    from tailrl.model import load_model

    return load_model(tool_chat_folder, device="cpu", dtype=torch.float32)
