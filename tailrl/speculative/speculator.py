"""The speculator: which drafter drafts how much for this decode step, and what was learned from the result.

`plan(running) -> (arm, trees)` asks the selector for an arm at this batch size and the arm's drafter for one
tree per sequence; `observe(record, running, verdicts)` feeds the outcome back: the selector's cost and
acceptance tables, each sequence's adaptive draft depth (doubles on full acceptance, halves on rejection),
the drafters' view of the emitted tokens, and shadow drafts that measure the drafters not chosen.

Per-sequence state lives here and in the drafters, keyed by the engine's seq_id: `start` makes it when a
sequence is prefilled (again after a preemption: the depth and shadows stay), `release` drops it when the
sequence finishes or leaves the engine (an export carries its depth: `depth`, then `resume` in the importer).

Failure isolation is a rule here: a drafter that raises on a batch is retried one sequence at a time, and a
sequence whose drafter raises or returns an invalid tree simply decodes without a draft this step."""

from __future__ import annotations

import logging

from dataclasses import dataclass, field

from .allocate import AcceptanceModel, allocate, fill_tile
from .budgets import LengthTracker, block_budget, block_end, das_budgets
from .config import SpecConfig
from .drafters import Drafter, model_free_drafters
from .rates import SeqAccept
from .selector import OFF, Arm, Selector
from .shadow import shadow_step
from .step_cost import Geometry, Shape
from .tree import DraftTree
from .verify import Verdict
from .watchdog import Watchdog

log = logging.getLogger(__name__)


@dataclass
class SeqDraft:
    """The speculator's state for one sequence."""

    depth: int = 0  # adaptive draft depth (0: not started)
    accept: SeqAccept = field(default_factory=SeqAccept)  # its share of the drafters' acceptance
    shadow: dict = field(default_factory=dict)  # drafter name -> (output position, pending shadow path, features)


class Speculator:
    def __init__(self, cfg: SpecConfig, drafters: list[Drafter] | None = None):
        """drafters: composed by the caller (default: the mode's model-free drafters)."""
        self.cfg = cfg
        drafters = model_free_drafters(cfg) if drafters is None else drafters
        self.drafters: dict[str, Drafter] = {d.name: d for d in drafters}
        if not self.drafters:
            raise ValueError(f"spec mode {cfg.mode!r} has no drafter to speculate with")
        self.selector = Selector(cfg, list(self.drafters))
        # drafters whose proposal is one batched pass per draft level: priced per level and batch size (selector.py)
        self.selector.draft.leveled = {n for n, d in self.drafters.items() if getattr(d, "per_level", False)}
        self.needs_hidden = any(d.needs_hidden for d in drafters)
        self._trees: list[DraftTree | None] = []
        self._arm = OFF
        self.shadow_cursor = 0  # where the next step's shadow sequences start (shadow.py)
        self.vocab_size = 0
        self.lengths = LengthTracker()
        self.watchdog = Watchdog()
        self.odds = AcceptanceModel()
        self.row_block = 0
        self.row_tile = 0
        self._contexts: list[int] = []
        self._planned: list[int] = []  # per sequence, the draft nodes of its arm (before fill_tile's)
        self._filled = 0  # nodes fill_tile added this step
        self.seqs: dict[int, SeqDraft] = {}  # seq_id -> its state, from start to release
        self._expected = 1.0  # accepted tokens per sequence the selector expected of the last verified arm
        self.shadow_credit = 0.0  # seconds shadow proposals may spend (shadow.py SHADOW_SHARE)
        self.queued = False  # requests wait for room (the engine sets it before each plan): finished ones make room

    def attach(self, kv, chains: bool = False, row_block: int = 0, key_chunk: int = 256,
               classes: dict[int, int] | None = None, digits: dict[int, int] | None = None, row_tile: int = 0,
               weight_calls: list[tuple[int, float]] | None = None, model=None) -> None:
        """The target's KV cache: its model config bounds draft tokens, and drafters may mirror its slots.
        chains: the verifier is batch-invariant (engine/invariant.py), so drafters draft single paths.
        row_block: the rows of one sequence the verifier's attention takes at a time (QUERY_BLOCK in invariant
        passes; 0: all at once): drafts are cut to whole blocks (block_budget), and so are the selector's budgets.
        key_chunk: the keys it reads at a time (CHUNK on the chunked route; unused by the step-time model, which
        prices keys one by one).
        classes, digits: token classes and single-digit tokens of the tokenizer (speculative/backoff.py number_classes,
        digit_values) for drafters that model text.
        row_tile: the verifier runs its matrix products on whole tiles of this many rows (ROW_TILE in invariant
        passes; 0: none): the rows a step leaves free in its last tile verify more draft nodes (allocate.fill_tile).
        weight_calls: (rows per product call, share of the weights' bytes) per product of the verifier's passes
        (engine/runner.py weight_calls): the step-time model counts the weight streams a pass's rows cost.
        model: the target model, for drafters that run its own layers (bind_target: the self drafter)."""
        self.vocab_size = kv.cfg.vocab_size
        self.row_block = row_block
        self.row_tile = row_tile
        budgets = tuple(sorted({block_budget(b, row_block) for b in self.cfg.budgets}))
        if budgets != self.selector.budgets:  # before any step: nothing measured is lost
            self.selector = Selector(self.cfg, list(self.drafters), budgets=budgets)
            self.selector.draft.leveled = {n for n, d in self.drafters.items() if getattr(d, "per_level", False)}
        self.selector.geometry = Geometry(row_block, weight_calls or [(0, 1.0)], row_tile)
        for d in self.drafters.values():
            d.chains = chains
            if classes is not None and hasattr(d, "classes"):
                d.classes = classes
            if digits is not None and hasattr(d, "digits"):
                d.digits = digits
            if model is not None and hasattr(d, "bind_target"):
                d.bind_target(model)
            d.attach(kv)

    def start(self, seqs: list) -> None:
        for s in seqs:
            st = self.seqs.setdefault(s.seq_id, SeqDraft())
            st.depth = st.depth or self.cfg.init_depth
            for d in self.drafters.values():
                d.start(s)

    def release(self, seq_ids: list[int]) -> None:
        """These sequences finished or left the engine: their state here and in the drafters goes."""
        for i in seq_ids:
            if self.seqs.pop(i, None) is not None:
                for d in self.drafters.values():
                    d.release(i)

    def depth(self, seq_id: int) -> int:
        """The sequence's adaptive draft depth (0: never started), for an export to carry."""
        st = self.seqs.get(seq_id)
        return st.depth if st is not None else 0

    def resume(self, seq_id: int, depth: int) -> None:
        """An imported sequence drafts on at the depth it had where it ran (`start` follows at its prefill)."""
        if depth:
            self.seqs[seq_id] = SeqDraft(depth)

    def end_rollout(self, speedup: float | None = None) -> dict[str, float]:
        """Ends a rollout for every drafter (speedup: the rollout's SD-off estimate, for the selector's ledger);
        returns {drafter: 1.0 if its acceptance collapsed in it, else 0.0}."""
        for d in self.drafters.values():
            d.end_rollout()
        self.odds.end_rollout()
        self.selector.end_rollout(speedup)
        return self.watchdog.end_rollout(list(self.drafters))

    def watch(self, drafter: str, source: str, accepted: float, drafted: float, running: list) -> None:
        # acceptance depends on the sampling regime (greedy evaluation vs sampled rollouts): compare like with like
        temps = [s.params.temperature for s in running]
        regime = f"{source}@T{round(sum(temps) / len(temps), 1)}"
        stale = self.watchdog.observe(drafter, regime, accepted, drafted)
        if stale is not None:
            # expected after a weight sync (the policy moved, the drafter's history did not): the watchdog doing its
            # job is counted (spec/stale/<drafter>, one run summary line: rl/run.py), never a WARNING per step
            if self.drafters[drafter].policy_bound:
                log.info("drafter %s went stale: acceptance %.2f -> %.2f of drafted tokens (after a weight sync?); "
                         "reported as spec/stale/%s, the selector re-measures it", drafter, *stale, drafter)
            else:  # its drafts come from the text itself: the policy now writes text it matches less
                log.debug("drafter %s: acceptance %.2f -> %.2f of drafted tokens (the policy's outputs changed); "
                          "the selector re-measures it", drafter, *stale)
            self.selector.forget(drafter)

    # ---- drafting -------------------------------------------------------------------------------------------

    def plan(self, running: list, kv_rooms: list[int] | None = None) -> tuple[Arm, list[DraftTree | None] | None]:
        """kv_rooms: per sequence, the draft rows its KV blocks hold (none asked: no bound but max_tokens)."""
        self._contexts = [len(s.prompt_ids) + len(s.output_ids) - 1 for s in running]  # cached before the pass
        mean = self._expected
        factors = [self.seqs[s.seq_id].accept.factor(mean) if s.seq_id in self.seqs else 1.0 for s in running]
        remaining = [self._remaining(s) for s in running]
        arm = self._arm = self.selector.choose(len(running), self._contexts, factors, remaining, self.queued)
        self._trees = []
        if arm == OFF:
            return arm, None
        rooms = [s.max_tokens - len(s.output_ids) - 1 for s in running]  # never draft past max_tokens or the KV
        if kv_rooms is not None:
            rooms = [min(r, k) for r, k in zip(rooms, kv_rooms)]
        left = [self.lengths.remaining(s.prompt_ids, len(s.output_ids)) for s in running]
        wanted = das_budgets(arm.budget, left, max(self.cfg.budgets), share=self.cfg.das == "share")
        budgets = [max(min(b, r), 0) for b, r in zip(wanted, rooms)]
        # the adaptive depth trims drafts where verify rows cost; in the tail a pass costs about a plain step up to
        # some depth, and down to that depth a rejection costs nothing, so no request drafts less
        B = len(running)
        floor = self.selector.free_depth(self._contexts)
        depths = [max(min(max(self.seqs[s.seq_id].depth, floor), r), 0) for s, r in zip(running, rooms)]
        if self.row_block > 1:  # chains (an invariant verifier): nodes = depth, cut to whole query blocks
            budgets = depths = [block_budget(min(b, d), self.row_block) for b, d in zip(budgets, depths)]
        fill = self.cfg.fill_tiles and self.row_tile > 1 and self.row_block > 1
        # to fill free rows (fill_tile), chains drafted on to the end of their last query block
        wide = [min(block_end(b, self.row_block), r) if b > 0 else 0
                for b, r in zip(budgets, rooms)] if fill else budgets
        trees = self._propose(self.drafters[arm.drafter], running, wide, wide if fill else depths)
        V = self.vocab_size
        for i, tree in enumerate(trees):
            if tree is not None:
                try:
                    if len(tree) > wide[i]:
                        raise ValueError(f"{len(tree)} nodes over the budget of {wide[i]}")
                    tree.validate(V)
                except Exception as e:
                    log.warning("drafter %s gave request %d a bad tree: %s", arm.drafter, running[i].prompt_index, e)
                    trees[i] = None
        trees = [t.preorder() if t else None for t in trees]
        if fill:  # the arm's own drafts: a prefix of each (preorder: every node's parent comes before it)
            wide, trees = trees, [t if t is None or len(t) <= b else t.subset(list(range(b))) if b else None
                                  for t, b in zip(trees, budgets)]
        if self.cfg.allocate:
            trees = allocate(trees, self.odds, B, self._seconds_of_rows())
        self._planned = [len(t) if t else 0 for t in trees]
        self._filled = 0
        if fill:
            trees, self._filled = fill_tile(trees, wide, self.odds, self.row_tile, self.row_block,
                                            *self._free_rows(trees))
        self._trees = trees
        return arm, self._trees

    def _remaining(self, s) -> int | None:
        """Tokens the sequence has left, predicted from its prompt's earlier responses (at most to max_tokens);
        None: its prompt has none (a first visit)."""
        left = self.lengths.remaining(s.prompt_ids, len(s.output_ids))
        return None if left is None else min(left, s.max_tokens - len(s.output_ids))

    def _propose(self, drafter: Drafter, seqs: list, budgets: list[int], depths: list[int]) -> list:
        try:
            return list(drafter.propose(seqs, budgets, depths))
        except Exception as e:
            log.warning("drafter %s failed on a batch of %d: %s", drafter.name, len(seqs), e)
        out = []
        for s, b, d in zip(seqs, budgets, depths):  # find the sequence it fails on: that one alone drafts nothing
            try:
                out.append(drafter.propose([s], [b], [d])[0] if len(seqs) > 1 else None)
            except Exception as e:
                log.warning("drafter %s failed on request %d: %s", drafter.name, s.prompt_index, e)
                out.append(None)
        return out

    def _free_rows(self, trees: list) -> tuple[int | None, float]:
        """(rows to fill, the odds a node needs there): the rows up to the end of the pass's last product call (within
        a call a row costs only its arithmetic and sampling) and the odds at which a row pays for that at the step's
        goodput, from the step-time model; (None, 0): the last tile's rows, before the model has priced a row."""
        cost = self._seconds_of_rows()
        if cost is None or not self.selector.time.measured(len(trees)):
            return None, 0.0
        B, drafts = len(trees), sum(len(t) for t in trees if t is not None)
        geo = self.selector.geometry
        rows = end = B + drafts
        while geo.passes(end + 1) == geo.passes(rows) and end - rows < 256:
            end += 1
        free = end - rows
        if not free:
            return 0, 0.0
        t0 = cost(drafts)
        price = (cost(drafts + free) - t0) / free  # seconds a filled row adds
        goodput = self.selector.decision.predicted or B / t0
        return free, price * goodput

    def _seconds_of_rows(self):
        """rows -> the step-time model's seconds of this step verifying that many draft rows (None: not measured)."""
        sel, contexts = self.selector, self._contexts
        if sel.plain_step_s(contexts) is None:
            return None
        plain = sel.geometry.shape(contexts, [0] * len(contexts))
        B, ctx = plain.seqs, plain.plain_keys * 1e3 / max(plain.seqs, 1)
        return lambda rows: sel.time.seconds(Shape(B, rows, sel.geometry.passes(B + rows), plain.plain_passes,
                                                   plain.keys, rows * (ctx + rows / B) / 1e3, plain.plain_keys))

    # ---- feedback -------------------------------------------------------------------------------------------

    def observe(self, record, running: list, verdicts: list[Verdict]) -> list[tuple[str, int, int] | None]:
        """record: the decode step's StepRecord (its plain-decoding estimate is filled in here); verdicts: per
        running sequence, the accepted nodes and the tokens actually emitted. Returns per running sequence
        (drafter, draft nodes verified, of them emitted), or None where it had no draft: the engine counts them."""
        B = len(running)
        cfg = self.cfg
        contexts = self._contexts if len(self._contexts) == B else [x.cache_len for x in running]  # not planned
        trees = self._trees or [None] * B
        sel = self.selector
        arm = self._arm
        shape = sel.geometry.shape(contexts, [len(t) if t else 0 for t in trees])
        if arm == OFF:
            record.plain_est_s = record.total_s
        else:
            plain = sel.plain_step_s(contexts)
            record.plain_est_s = (record.emitted / B) * plain if plain else record.total_s
        predicted = sel.time.seconds(shape)
        record.pred_s = predicted + record.draft_s if predicted else 0.0
        decision = sel.decision
        if decision.arm == arm:
            record.probe, record.pred_tps, record.off_tps = decision.probe, decision.predicted or 0.0, decision.off or 0.0
        if arm != OFF:  # what the selector expected of the arm, before this step moves it
            est = sel.acceptance(arm)
            self._expected = max(est[0], 0.0) if est is not None else self._expected
        # the arm's rows and drafts as the pass ran them (fill_tile's among them): the arm is priced by what it runs
        levels = getattr(self.drafters[arm.drafter], "last_levels", 0) if arm != OFF else 0
        sel.record(arm, shape, record.total_s, record.emitted, record.drafted, record.draft_s, levels)
        planned = self._planned if len(self._planned) == B else [len(t) if t else 0 for t in trees]
        if record.drafted - self._filled:  # the arm's own nodes: the filled ones are the less likely by design
            own = record.accepted if not self._filled else sum(min(len(v.accepted_nodes), n)
                                                               for v, n in zip(verdicts, planned))
            self.watch(arm.drafter, "verified", own, record.drafted - self._filled, running)
        counts: list[tuple[str, int, int] | None] = [None] * B
        for i, (s, tree, v, n) in enumerate(zip(running, trees, verdicts, planned)):
            if tree is not None:
                if cfg.allocate or (cfg.fill_tiles and self.row_tile > 1):
                    self.odds.observe(tree, v.accepted_nodes)
                # accepted to a leaf; of a filled chain, through the arm's own nodes (a filled node's rejection says
                # nothing of the depth the arm should draft)
                full = bool(v.accepted_nodes) and (len(v.accepted_nodes) >= n if len(tree) > n
                                                   else not tree.children(v.accepted_nodes[-1]))
                st = self.seqs[s.seq_id]
                st.depth = min(2 * st.depth, cfg.max_depth) if full else max(st.depth // 2, cfg.min_depth)
                used = min(len(v.accepted_nodes), len(v.tokens) - 1)  # accepted tokens after a stop are not emitted
                if arm != OFF and n:
                    st.accept.add(used, self._expected)
                counts[i] = (tree.drafter or "?", len(tree), used)
            for d in self.drafters.values():
                d.accept(s, v.tokens)
            if s.finished:
                self.lengths.add(s.prompt_ids, len(s.output_ids))
        shadow_step(self, running, arm.drafter, record.total_s)
        return counts
