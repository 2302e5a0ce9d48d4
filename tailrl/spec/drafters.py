"""Model-free drafters: history (earlier epochs' and sibling responses to the same prompt) and prompt lookup.

A drafter keeps its per-sequence state in `seq.spec`; the engine calls `start` when a sequence is admitted,
`propose` before a verification step, `accept` with the tokens each step emitted, and `end_step` when a
generate call (an RL step) ends."""

from __future__ import annotations

from collections import OrderedDict, deque

from .config import SpecConfig
from .suffix import TokenIndex, TreeShape, build_tree
from .tree import DraftTree

PROMPT_TAIL = 4  # responses are stored after the prompt's last tokens so that their first tokens can match


class PromptHistory:
    def __init__(self, prompt: list[int], max_n: int):
        self.prompt = list(prompt)
        self.epochs: deque[list[list[int]]] = deque()
        self.live: list[int] = []  # streams of this step's samples, growing as they decode
        self.max_n = max_n
        self.rebuild()

    def rebuild(self) -> None:
        self.index = TokenIndex(self.max_n)
        self.index.add_stream(self.prompt)
        tail = self.prompt[-PROMPT_TAIL:]
        for epoch in self.epochs:
            for resp in epoch:
                self.index.add_stream(tail + resp)
        self.live = []

    def start_live(self) -> int:
        sid = self.index.add_stream(self.prompt[-PROMPT_TAIL:])
        self.live.append(sid)
        return sid

    def commit(self, keep: int) -> None:
        if not self.live:
            return
        cut = len(self.prompt[-PROMPT_TAIL:])
        self.epochs.append([self.index.streams[sid][cut:] for sid in self.live])
        self.live = []
        if len(self.epochs) > keep:
            while len(self.epochs) > keep:
                self.epochs.popleft()
            self.rebuild()


class HistoryDrafter:
    name = "history"

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.prompts: OrderedDict[tuple[int, ...], PromptHistory] = OrderedDict()
        self.touched: set[tuple[int, ...]] = set()

    def _entry(self, prompt: list[int]) -> PromptHistory:
        key = tuple(prompt)
        ph = self.prompts.get(key)
        if ph is None:
            ph = self.prompts[key] = PromptHistory(prompt, 3)
            while len(self.prompts) > self.cfg.max_prompts:
                self.prompts.popitem(last=False)
        self.prompts.move_to_end(key)
        return ph

    def start(self, seq) -> None:
        ph = self._entry(seq.prompt_ids)
        self.touched.add(tuple(seq.prompt_ids))
        sid = ph.start_live()
        ph.index.extend(sid, seq.output_ids)
        seq.spec["history"] = (ph, sid)

    def propose(self, seq, budget: int, depth: int) -> DraftTree | None:
        ph, _ = seq.spec["history"]
        ctx = (seq.prompt_ids[-self.cfg.max_match :] + seq.output_ids)[-self.cfg.max_match - 1 :]
        m, occ = ph.index.match(ctx, self.cfg.max_match)
        if m < self.cfg.min_match:
            return None
        budget = min(budget, int(self.cfg.match_factor * m + self.cfg.match_offset))
        return build_tree(ph.index.streams, occ, TreeShape(budget, depth, self.cfg.min_prob), self.name)

    def accept(self, seq, tokens: list[int]) -> None:
        ph, sid = seq.spec["history"]
        ph.index.extend(sid, tokens)

    def end_step(self) -> None:
        for key in self.touched:
            ph = self.prompts.get(key)
            if ph is not None:
                ph.commit(self.cfg.history_epochs)
        self.touched.clear()

    def state_dict(self) -> dict:
        return {"prompts": [{"prompt": ph.prompt, "epochs": [list(e) for e in ph.epochs]} for ph in self.prompts.values()]}

    def load_state_dict(self, state: dict) -> None:
        self.prompts.clear()
        for item in state["prompts"]:
            ph = PromptHistory(item["prompt"], 3)
            ph.epochs = deque(item["epochs"][-self.cfg.history_epochs :])
            ph.rebuild()
            self.prompts[tuple(item["prompt"])] = ph


class NgramDrafter:
    """Prompt lookup: the continuation of the longest n-gram match in the sequence's own prompt and output."""

    name = "ngram"

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg

    def start(self, seq) -> None:
        index = TokenIndex(max_n=3, max_occurrences=16)
        index.add_stream(seq.prompt_ids + seq.output_ids)
        seq.spec["ngram"] = index

    def propose(self, seq, budget: int, depth: int) -> DraftTree | None:
        index: TokenIndex = seq.spec["ngram"]
        m, occ = index.match(index.streams[0][-self.cfg.max_match - 1 :], self.cfg.max_match)
        if m < 1:
            return None
        shape = TreeShape(min(budget, depth), depth, 0.0, chain=True)
        return build_tree(index.streams, occ[-1:], shape, self.name)  # the most recent occurrence

    def accept(self, seq, tokens: list[int]) -> None:
        seq.spec["ngram"].extend(0, tokens)

    def end_step(self) -> None:
        pass


def make_drafters(cfg: SpecConfig) -> dict:
    return {name: {"history": HistoryDrafter, "ngram": NgramDrafter}[name](cfg) for name in cfg.drafters}
