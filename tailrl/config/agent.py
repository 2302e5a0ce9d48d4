"""The `agent` config group: multi-turn tool rollouts (docs/agents.md). Empty `tools` is the single-turn run, unchanged.

Invariant: a config that validates can run: each key is checked here on construction (the one combination with tools
not built, partial rollouts on vLLM, is refused with or without them: config/sections.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

FORMATS = ("tags", "hermes")
TRUNCATE_SIDES = ("left", "right", "middle")


@dataclass
class AgentConfig:
    # tools the model may call: built-ins (calculator, python) or module:function (type hints + docstring). Empty:
    # one prompt -> one answer, the single-turn run
    tools: list[str] = field(default_factory=list)
    max_turns: int = 4  # model turns per trajectory at most (a turn ends at a tool call or at the end)
    max_tool_tokens: int = 256  # an observation longer than this many tokens is cut (truncate_side), marker included
    truncate_side: str = "right"  # right (keep the start) | left (keep the end) | middle (keep both ends)
    tool_timeout_s: float = 10.0  # a tool call that runs longer returns a timeout text to the model
    max_parallel_calls: int = 8  # tool calls running at once (a pool beside the engine: decoding goes on)
    # how the model calls a tool: tags (<calc>12*34</calc> -> a user turn <result>408</result>: what SmolLM2-135M
    # follows after two few-shot turns) | hermes (<tool_call>{"name": .., "arguments": ..}</tool_call> -> a tool
    # turn, as Qwen2.5/Qwen3 templates render it; the tools' schemas go into the prompt's chat template)
    format: str = "tags"
    # compare every trajectory's ids with a full re-tokenization of its conversation (verl's sanity check); the
    # share that differ is agent/token_drift, and the first difference is logged once
    strict_tokens: bool = True
    # on our engine, a trajectory waiting on its tool keeps its KV blocks (parked, the first thing memory takes back),
    # and its next turn prefills only the observation and template tokens, not the whole trajectory again; the
    # tokens are the same either way on the batch-invariant engine. Off: every turn re-prefills all its ids
    keep_kv: bool = True

    def __post_init__(self):
        checks = [
            (isinstance(self.tools, list) and all(isinstance(t, str) and t.strip() for t in self.tools), "tools",
             "a list of tool names (calculator, python or module:function)"),
            (self.max_turns >= 1, "max_turns", ">= 1"),
            (self.max_tool_tokens >= 8, "max_tool_tokens", ">= 8 (room for the truncation marker)"),
            (self.truncate_side in TRUNCATE_SIDES, "truncate_side", f"one of {', '.join(TRUNCATE_SIDES)}"),
            (self.tool_timeout_s > 0, "tool_timeout_s", "> 0"),
            (self.max_parallel_calls >= 1, "max_parallel_calls", ">= 1"),
            (self.format in FORMATS, "format", f"one of {', '.join(FORMATS)}"),
        ]
        for ok, key, what in checks:
            if not ok:
                raise ValueError(f"agent.{key}={getattr(self, key)!r} must be {what}")

    @property
    def enabled(self) -> bool:
        return bool(self.tools)
