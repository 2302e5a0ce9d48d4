"""The Drafter protocol, and the model-free drafters: history (earlier epochs' and sibling responses to the same
prompt) and prompt lookup.

A drafter keeps its per-sequence state itself, keyed by `seq.seq_id`; the speculator calls `start` when a
sequence is prefilled, `propose` for a batch before a verification step, `accept` with the tokens each step
emitted, `release` when the sequence finishes or leaves the engine, and `end_rollout` when a rollout (an RL
step) ends."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from typing import Protocol

from .config import SpecConfig
from .backoff import BackoffModel, coupled_chain
from .self_draft import SelfDrafter
from .suffix import TokenIndex, TreeShape, build_tree
from .tree import DraftTree

PROMPT_TAIL = 4  # responses are stored after the prompt's last tokens so that their first tokens can match


class Drafter(Protocol):
    name: str
    costly: bool  # proposals cost model forwards: shadow drafts run rarely, at the initial depth
    needs_hidden: bool  # reads the target's captured hidden states (seq.hidden)
    # drafts from what an earlier policy wrote or taught it (history, a learned head): it can go stale after a weight
    # sync, so the watchdog warns; a drawn-from-the-text drafter (ngram) only changes with the text it is given
    policy_bound: bool
    # set by the speculator: draft single paths. A batch-invariant verifier (engine/invariant.py) keeps an accepted
    # path only up to its first node off the first-child path, so side branches there cost rows and gain nothing
    chains: bool

    def attach(self, kv) -> None:
        """The target's KV cache, for drafters that keep a cache in the same slots (kv.mirror)."""

    def start(self, seq) -> None: ...

    def propose(self, seqs: list, budgets: list[int], depths: list[int]) -> list[DraftTree | None]:
        """One tree (or None) per sequence, at most budgets[i] nodes and depths[i] deep."""

    def accept(self, seq, tokens: list[int]) -> None: ...

    def release(self, seq_id: int) -> None:
        """The sequence finished or left the engine: drop its state (a no-op for one never started here)."""

    def end_rollout(self) -> None: ...


class ModelFreeDrafter(ABC):
    """Cheap drafters that propose one sequence at a time (subclasses give propose_one, start and accept)."""

    name = ""
    costly = False
    needs_hidden = False
    policy_bound = False
    chains = False

    def attach(self, kv) -> None:
        pass

    def propose(self, seqs, budgets, depths):
        return [self.propose_one(s, b, d) if b > 0 and d > 0 else None for s, b, d in zip(seqs, budgets, depths)]

    @abstractmethod
    def propose_one(self, seq, budget: int, depth: int) -> DraftTree | None:
        """One tree of at most `budget` nodes and `depth` levels for this sequence, or None."""

    def release(self, seq_id: int) -> None:
        pass  # stateless per sequence; drafters that keep state drop it here

    def end_rollout(self) -> None:
        pass


class PromptHistory:
    def __init__(self, prompt: list[int], max_n: int):
        self.prompt = list(prompt)
        self.epochs: deque[list[list[int]]] = deque()
        self.live: list[int] = []  # streams of this step's samples, growing as they decode
        self.remote: dict[tuple[int, int], int] = {}  # siblings decoding on other workers -> their live stream
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
        self.remote = {}

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
        self.remote = {}
        if len(self.epochs) > keep:
            while len(self.epochs) > keep:
                self.epochs.popleft()
            self.rebuild()


class HistoryDrafter(ModelFreeDrafter):
    name = "history"
    policy_bound = True

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.prompts: OrderedDict[tuple[int, ...], PromptHistory] = OrderedDict()
        self.touched: set[tuple[int, ...]] = set()
        self.streams: dict[int, tuple[PromptHistory, int]] = {}  # seq_id -> its prompt's history, its live stream

    def _entry(self, prompt: list[int], turn: int = 0) -> PromptHistory:
        key = history_key(prompt, turn)
        ph = self.prompts.get(key)
        if ph is None:
            ph = self.prompts[key] = PromptHistory(prompt, 3)
            while len(self.prompts) > self.cfg.max_prompts:
                self.prompts.popitem(last=False)
        self.prompts.move_to_end(key)
        self.touched.add(key)
        return ph

    def start(self, seq) -> None:
        """A request's tokens go under its prompt, or under turn k of the prompt its params name (a multi-turn
        trajectory's later turns: their prompt ids hold the earlier turns, which differ from epoch to epoch; the
        prompt tail that the responses are stored after is the chat template's generation prompt in both)."""
        hist = getattr(seq.params, "history", None)
        ph = self._entry(*hist) if hist is not None else self._entry(seq.prompt_ids)
        sid = ph.start_live()
        ph.index.extend(sid, seq.output_ids)
        self.streams[seq.seq_id] = (ph, sid)

    def release(self, seq_id: int) -> None:
        self.streams.pop(seq_id, None)  # its stream stays in the prompt's index: this epoch's history

    def propose_one(self, seq, budget: int, depth: int) -> DraftTree | None:
        ph, _ = self.streams[seq.seq_id]
        ctx = (seq.prompt_ids[-self.cfg.max_match :] + seq.output_ids)[-self.cfg.max_match - 1 :]
        m, occ = ph.index.match(ctx, self.cfg.max_match)
        if m < self.cfg.min_match:
            return None
        budget = min(budget, int(self.cfg.match_factor * m + self.cfg.match_offset))
        return build_tree(ph.index.streams, occ, TreeShape(budget, depth, self.cfg.min_prob, self.chains), self.name)

    def accept(self, seq, tokens: list[int]) -> None:
        ph, sid = self.streams[seq.seq_id]
        ph.index.extend(sid, tokens)

    def observe_remote(self, prompt_ids: list[int], key: tuple[int, int], tokens: list[int]) -> None:
        """New tokens of a sibling sample decoding elsewhere (another worker; key = (prompt index, sample
        index)): they join this prompt's live sibling index as if the sample ran here (Seer's group drafting)."""
        ph = self._entry(prompt_ids)
        sid = ph.remote.get(key)
        if sid is None:
            sid = ph.remote[key] = ph.index.add_stream(ph.prompt[-PROMPT_TAIL:])
        ph.index.extend(sid, tokens)

    def lengths(self, prompt_ids: list[int]) -> list[int]:
        """Lengths of this prompt's responses in the epochs kept ([] for a prompt never seen)."""
        ph = self.prompts.get(tuple(prompt_ids))
        return [len(r) for e in ph.epochs for r in e] if ph is not None else []

    def end_rollout(self) -> None:
        for key in self.touched:
            ph = self.prompts.get(key)
            if ph is not None:
                ph.commit(self.cfg.history_epochs)
        self.touched.clear()

    def state_dict(self) -> dict:
        return {"prompts": [{"prompt": ph.prompt, "epochs": [list(e) for e in ph.epochs],
                             **({"turn": key[1]} if _turn_of(key) else {})} for key, ph in self.prompts.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.prompts.clear()
        for item in state["prompts"]:
            ph = PromptHistory(item["prompt"], 3)
            ph.epochs = deque(item["epochs"][-self.cfg.history_epochs :])
            ph.rebuild()
            self.prompts[history_key(item["prompt"], item.get("turn", 0))] = ph


def history_key(prompt: list[int], turn: int = 0) -> tuple:
    """A prompt's history entry: its ids for turn 0 (single-turn runs, and an agent's first turn), (ids, turn) after."""
    return tuple(prompt) if turn == 0 else (tuple(prompt), turn)


def _turn_of(key: tuple) -> int:
    return key[1] if len(key) == 2 and isinstance(key[0], tuple) else 0


class NgramDrafter(ModelFreeDrafter):
    """Prompt lookup: the sequence's own prompt and output. Greedy requests: the continuation of the longest n-gram
    match. Sampled requests (cfg.coupled): a chain drawn from a backoff model of the text with the verifier's own
    noise (speculative/backoff.py), whose number classes and digit tokens the engine gives (`classes`, `digits`)."""

    name = "ngram"

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.classes: dict[int, int] = {}
        self.digits: dict[int, int] = {}
        self.models: dict[int, TokenIndex | BackoffModel] = {}  # seq_id -> the model of its text

    def start(self, seq) -> None:
        text = seq.prompt_ids + seq.output_ids
        if self.cfg.coupled and not seq.params.greedy:
            self.models[seq.seq_id] = BackoffModel(text, self.classes, digits=self.digits)
            return
        index = TokenIndex(max_n=3, max_occurrences=16)
        index.add_stream(text)
        self.models[seq.seq_id] = index

    def release(self, seq_id: int) -> None:
        self.models.pop(seq_id, None)

    def propose_one(self, seq, budget: int, depth: int) -> DraftTree | None:
        model = self.models[seq.seq_id]
        if isinstance(model, BackoffModel):
            return coupled_chain(model, min(budget, depth), seq.seed, len(seq.output_ids), self.name)
        m, occ = model.match(model.streams[0][-self.cfg.max_match - 1 :], self.cfg.max_match)
        if m < 1:
            return None
        shape = TreeShape(min(budget, depth), depth, 0.0, chain=True)
        return build_tree(model.streams, occ[-1:], shape, self.name)  # the most recent occurrence

    def accept(self, seq, tokens: list[int]) -> None:
        model = self.models[seq.seq_id]
        if isinstance(model, BackoffModel):
            model.extend(tokens)
        else:
            model.extend(0, tokens)


class FallbackDrafter:
    """Each sequence's tree from the first of its parts that drafts for it (at least `min_len` nodes, or its whole
    budget), else from the next: the prompt's earlier responses where they match, the sequence's own text or the
    learned head elsewhere. One tree per sequence from one source, so the verifier's lossless rules hold as they
    are. Its parts are drafters of the same speculator: they are attached, started and fed there, not here."""

    def __init__(self, parts: list, min_len: int = 2):
        self.parts, self.min_len = list(parts), min_len
        self.name = "+".join(d.name for d in self.parts)
        self.costly = any(d.costly for d in self.parts)
        self.needs_hidden = any(d.needs_hidden for d in self.parts)
        self.policy_bound = any(d.policy_bound for d in self.parts)
        self.per_level = any(getattr(d, "per_level", False) for d in self.parts)
        self.last_levels = 0  # batched passes its parts' last proposal ran (drafters priced per level)

    @property
    def chains(self) -> bool:
        return all(d.chains for d in self.parts)

    @chains.setter
    def chains(self, value: bool) -> None:
        for d in self.parts:
            d.chains = value

    def attach(self, kv) -> None:
        pass

    def start(self, seq) -> None:
        pass

    def accept(self, seq, tokens: list[int]) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass

    def end_rollout(self) -> None:
        pass

    def propose(self, seqs: list, budgets: list[int], depths: list[int]) -> list[DraftTree | None]:
        out: list[DraftTree | None] = [None] * len(seqs)
        want = list(budgets)
        self.last_levels = 0
        for d in self.parts:
            if not any(want):
                break
            trees = d.propose(seqs, want, depths)
            self.last_levels += getattr(d, "last_levels", 0)
            for i, t in enumerate(trees):
                if want[i] and t is not None and (out[i] is None or len(t) > len(out[i])):
                    out[i] = t
                if out[i] is not None and len(out[i]) >= min(self.min_len, budgets[i]):
                    want[i] = 0  # drafted enough: later parts need not draft for it
        return out


def model_free_drafters(cfg: SpecConfig) -> list:
    """The mode's drafters the speculator builds itself; auto adds history+ngram (history where the prompt's earlier
    responses match, the sequence's own n-grams elsewhere: +0.2-0.4 tokens per verify over history alone,
    benchmarks/RESULTS.md) and, with the self drafter, history+self. The self drafter (the policy's own quantized
    layers) is bound to the engine's model by Speculator.attach."""
    free = [{"history": HistoryDrafter, "ngram": NgramDrafter}[n](cfg) for n in cfg.drafters if n != "self"]
    drafters = free + ([FallbackDrafter(free)] if len(free) > 1 else [])
    if "self" in cfg.drafters:
        own = SelfDrafter(cfg)
        drafters.append(own)
        history = next((d for d in free if d.name == "history"), None)
        if history is not None:
            drafters.append(FallbackDrafter([history, own]))
    return drafters
