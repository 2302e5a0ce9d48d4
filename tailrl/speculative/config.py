"""Speculative decoding settings, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("off", "auto", "history", "ngram", "learned", "self")
SELF_QUANT = ("int8", "int4")


@dataclass
class SpecConfig:
    # off | auto (selector decides per batch) | history | ngram | learned | self (always that drafter)
    mode: str = "auto"
    budgets: tuple[int, ...] = (1, 2, 4, 8, 16)  # draft tokens per sequence the selector chooses (caps with allocate)
    max_depth: int = 16  # per-request adaptive draft depth: doubles on full acceptance, halves on rejection
    init_depth: int = 4
    min_depth: int = 2
    min_prob: float = 0.1  # stop drafting where the estimated probability of a path falls below this
    # verify only the drafted nodes whose calibrated odds pay for their rows (speculative/allocate.py); off by default: on
    # this CPU it won where the policy repeats itself and lost where it does not (benchmarks/RESULTS.md)
    allocate: bool = False
    # a batch-invariant verifier runs its products on whole tiles of rows (model/chunked.py ROW_TILE): the rows a step
    # leaves free in its last tile verify the likeliest next draft nodes, at no cost but their sampling
    # (speculative/allocate.py fill_tile)
    fill_tiles: bool = True
    # DAS: requests predicted to run longest get deeper trees; share = out of the rows the batch verifies anyway
    # (or for at most a quarter of it, or one request), extend = every long request gets twice the arm's budget
    # (speculative/budgets.py)
    das: str = "share"
    # sampled requests: the n-gram drafter drafts with the verifier's own noise from a backoff estimate of what
    # follows (speculative/backoff.py coupled_chain), not the most frequent continuation
    coupled: bool = True
    min_match: int = 2  # history: shortest suffix match worth drafting from
    match_factor: float = 2.0  # history: draft budget = match_factor * match length + match_offset
    match_offset: int = 1
    max_match: int = 32
    history_epochs: int = 4  # keep the responses of the last K epochs per prompt
    max_prompts: int = 100_000  # history index: least recently used prompts beyond this are evicted
    # the self-speculative drafter (speculative/self_draft.py): the policy's own layers with weight-only quantized
    # products. self_draft offers it to auto's selector (mode=self: always it); off by default, as measured in
    # benchmarks/RESULTS.md section 26
    self_draft: bool = False
    # int4 | int8 (torch's CPU weight-only kernels, model/quant.py): int4 drafts a level at 0.36x of a plain step at
    # one sequence on a 2-core Zen 4, int8 at 0.42x, at about the same acceptance (RESULTS section 26)
    self_quant: str = "int4"
    self_vocab: int = 0  # its LM head's rows: the N most frequent tokens seen (0: the full vocabulary)
    epsilon: float = 0.02  # selector exploration per batch-size bucket, among arms within 15% of the best
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown spec mode {self.mode!r}; choose one of {', '.join(MODES)}")
        self.budgets = tuple(self.budgets)
        if not self.budgets or any(not isinstance(b, int) or b < 1 for b in self.budgets):
            raise ValueError(f"spec budgets={self.budgets!r}: each draft budget must be an integer >= 1")
        if not 1 <= self.min_depth <= self.init_depth <= self.max_depth:
            raise ValueError(f"spec depths must satisfy 1 <= min_depth ({self.min_depth}) <= init_depth "
                             f"({self.init_depth}) <= max_depth ({self.max_depth})")
        if not 0 <= self.min_prob < 1:
            raise ValueError(f"spec min_prob={self.min_prob} must be in [0, 1)")
        if self.min_match < 1 or self.max_match < self.min_match:
            raise ValueError(f"spec min_match={self.min_match} must be >= 1 and <= max_match={self.max_match}")
        if self.history_epochs < 1:
            raise ValueError(f"spec history_epochs={self.history_epochs} must be >= 1")
        if self.das not in ("share", "extend"):
            raise ValueError(f"spec das={self.das!r}: choose share or extend")
        if self.self_quant not in SELF_QUANT:
            raise ValueError(f"spec self_quant={self.self_quant!r}: choose one of {', '.join(SELF_QUANT)}")
        if not isinstance(self.self_vocab, int) or self.self_vocab < 0:
            raise ValueError(f"spec self_vocab={self.self_vocab!r} must be an integer >= 0 (0 = full vocabulary)")
        if not 0 <= self.epsilon <= 1:
            raise ValueError(f"spec epsilon={self.epsilon} must be in [0, 1]")

    @property
    def drafters(self) -> tuple[str, ...]:
        """The drafters of the mode the speculator builds itself (the caller adds the learned one when it has it):
        the model-free ones, and the self drafter (which the engine binds to its model)."""
        auto = ("history", "ngram") + (("self",) if self.self_draft else ())
        return {"off": (), "auto": auto, "history": ("history",), "ngram": ("ngram",), "learned": (),
                "self": ("self",)}[self.mode]
