"""A multi-turn trajectory kept as token ids (token in, token out), and the template deltas that join its turns.

Invariants (verl's continuous-token builder, SkyRL's fixed-base observations, TRL PR #5242):
- the model's tokens enter `ids` exactly as sampled, never decoded and re-encoded; their logprobs are the engine's;
- an observation is tokenized as a delta against a fixed base conversation: the ids of [base + observation
  messages, generation prompt] after the ids of [base], so its tokens do not depend on what the model wrote;
  the template's end-of-turn tokens that a turn stopped at a tool call lacks are appended first;
- `mask` is 1 exactly on the model's tokens and 0 on every template and observation token (`logprobs` 0 there):
  the update multiplies its loss mask by it (rl/actor/forward.py), so no observation token enters the loss, the
  KL, the entropy or TIS.
`drift` compares the ids with a full re-tokenization of the final conversation (verl's sanity check): where they
differ, training on re-tokenized text would train on tokens the policy never sampled."""

from __future__ import annotations

from dataclasses import dataclass, field

BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
TRUNCATED = "...(truncated)"


def _ids(x) -> list[int]:
    return list(x["input_ids"] if hasattr(x, "keys") else x)


class ChatDelta:
    """The template's ids for what goes between the model's turns, computed once per observation shape."""

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        self.tok, self.kw = tokenizer, dict(template_kwargs or {})
        head = tokenizer.apply_chat_template(BASE[:-1], tokenize=False, add_generation_prompt=True, **self.kw)
        full = tokenizer.apply_chat_template(BASE, tokenize=False, **self.kw)
        rest = full[len(head):] if full.startswith(head) else ""
        if not rest.startswith("A"):
            raise ValueError("the chat template does not render an assistant message after its generation prompt "
                             "verbatim; a multi-turn trajectory cannot be kept as ids with it")
        # what closes an assistant turn (ChatML: <|im_end|>\n): appended after a turn that stopped at a tool call
        self.close_ids = tokenizer.encode(rest[1:], add_special_tokens=False)
        self._base = _ids(tokenizer.apply_chat_template(BASE, tokenize=True, **self.kw))

    def observation_ids(self, messages: list[dict]) -> list[int]:
        """The ids of observation messages and the next assistant turn's header, as a delta after the base."""
        full = _ids(self.tok.apply_chat_template(BASE + messages, tokenize=True, add_generation_prompt=True, **self.kw))
        if full[: len(self._base)] == self._base:
            return full[len(self._base):]
        text = self.tok.apply_chat_template(BASE + messages, tokenize=False, add_generation_prompt=True, **self.kw)
        base = self.tok.apply_chat_template(BASE, tokenize=False, **self.kw)
        return self.tok.encode(text[len(base):], add_special_tokens=False)

    def truncate(self, text: str, max_tokens: int, side: str) -> str:
        """`text` cut to at most max_tokens tokens, the marker included (verl's tool_response_truncate_side)."""
        ids = self.tok.encode(text, add_special_tokens=False)
        if len(ids) <= max_tokens:
            return text
        keep = max(max_tokens - len(self.tok.encode(TRUNCATED, add_special_tokens=False)), 1)
        if side == "right":
            return self.tok.decode(ids[:keep]) + TRUNCATED
        if side == "left":
            return TRUNCATED + self.tok.decode(ids[-keep:])
        head = (keep + 1) // 2
        return self.tok.decode(ids[:head]) + TRUNCATED + self.tok.decode(ids[len(ids) - (keep - head):])


@dataclass
class Turn:
    text: str  # the model's turn, decoded for reading and parsing (its ids are kept as sampled)
    calls: list = field(default_factory=list)  # ToolCall
    results: list = field(default_factory=list)  # ToolResult
    observation: list[dict] = field(default_factory=list)  # the messages the results became
    start: int = 0  # where its tokens begin in the trajectory's ids
    end: int = 0  # where they end (its observation, if any, follows)


@dataclass
class Trajectory:
    prompt_index: int
    sample_index: int
    seed: int  # the sample's seed: turn k draws from turn_seed(seed, k)
    prompt_ids: list[int]
    messages: list[dict]  # the prompt's chat messages
    ids: list[int] = field(default_factory=list)  # the response: model and observation tokens
    mask: list[int] = field(default_factory=list)  # 1 on model tokens
    logprobs: list[float] = field(default_factory=list)  # the engine's, 0.0 where mask is 0
    turns: list[Turn] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    seq_id: int = -1  # the engine's id of its first turn
    t_done: float = 0.0

    def add_model(self, ids: list[int], logprobs: list[float], text: str) -> None:
        start = len(self.ids)
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += list(logprobs) if len(logprobs) == len(ids) else [0.0] * len(ids)
        self.turns.append(Turn(text, start=start, end=len(self.ids)))

    def add_template(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    @property
    def drawn(self) -> int:
        """The tokens the policy drew (mask 1): a partial rollout's clock (rollout/partial.py)."""
        return sum(self.mask)

    @property
    def model_text(self) -> str:
        """What the model wrote, its turns joined (what `completions` holds for reward functions)."""
        return "\n".join(t.text for t in self.turns)

    def conversation(self) -> list[dict]:
        """The prompt's messages, then each model turn and the observation it got."""
        out = list(self.messages)
        for t in self.turns:
            out.append({"role": "assistant", "content": t.text})
            out += t.observation
        return out

    def tool_calls(self) -> list[dict]:
        return [{"turn": k, "name": c.name, "arguments": c.arguments, "error": c.error, "result": r.text,
                 "status": r.status, "seconds": round(r.seconds, 4)}
                for k, t in enumerate(self.turns) for c, r in zip(t.calls, t.results)]

    def record(self) -> dict:
        """What the trainer, the rewards and samples.jsonl read (Completion.trajectory)."""
        return {"conversation": self.conversation(), "tool_calls": self.tool_calls(), "turns": len(self.turns),
                "prompt_messages": len(self.messages)}


def turn_seed(seed: int, turn: int) -> int:
    """The noise key of a trajectory's turn: a function of (sample seed, turn) only, so a trajectory draws the same
    tokens whatever batch, order or timing its turns run in (the engine keys noise by (seed, position))."""
    return seed if turn == 0 else (seed * 0x9E3779B1 + turn * 0x85EBCA77) % (1 << 62)


def drift(tokenizer, traj: Trajectory, template_kwargs: dict | None = None) -> int | None:
    """The first position where prompt + response ids differ from a re-tokenization of the conversation, or None.
    The re-rendered conversation closes the last turn (and may add a newline after it); only ours is compared."""
    full = _ids(tokenizer.apply_chat_template(traj.conversation(), tokenize=True, **(template_kwargs or {})))
    ours = traj.prompt_ids + traj.ids
    for i, (a, b) in enumerate(zip(ours, full)):
        if a != b:
            return i
    return None if len(full) >= len(ours) else len(full)
