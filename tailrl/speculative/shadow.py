"""Shadow drafts: the acceptance of drafters the selector did not choose, measured on the tokens the sequences go on
to emit. For a deterministic draft its matched length is distributed as its accepted length would have been, so a
shadow measures a drafter as a verified step would, at the cost of its proposal only (host time, no pass)."""

from __future__ import annotations

import time

from .selector import Arm

SHADOW_SEQS = 8  # sequences per step that keep a pending shadow draft per unchosen drafter
# of a step's seconds, what shadow proposals may spend (a credit carried across steps): at a rollout's first visit
# the n-gram drafters' shadow proposals took 15 ms of every 100 ms plain step at 24-32 sequences (RESULTS 25)
SHADOW_SHARE = 0.015
# above this batch a third of it: a draft row costs there (it is not free as in the tail), the choice rarely turns on
# a drafter's acceptance, and on a first visit (most steps plain) the shadows were most of SD auto's host work
SHADOW_BODY = 16
# no shadow drafts above this batch: acceptance is a property of the drafter, not the batch size, and the tail
# of every rollout measures it; above it, shadows made the drafters index every token (TokenIndex is lazy)
SHADOW_MAX_BATCH = 32


def shadow_step(sp, running: list, chosen: str, step_s: float = 0.0) -> None:
    """Measures, for the speculator `sp`, the acceptance of drafters not chosen this step: a few sequences per
    step keep a pending draft path per drafter that is scored against the tokens they emit next; new proposals
    spend at most SHADOW_SHARE of the steps' seconds (step_s: this step's). None while the ledger rests (ledger.py)."""
    others = [d for name, d in sp.drafters.items() if name != chosen]
    if not others or not running or len(running) > SHADOW_MAX_BATCH or sp.selector.ledger.resting:
        return
    body = len(running) > SHADOW_BODY
    share = SHADOW_SHARE / 3 if body else SHADOW_SHARE
    # above SHADOW_BODY, while the step decodes plainly with every drafter far below (or the guard vetoing the
    # bucket), what a shadow measures cannot flip the choice: pending shadows are scored, no new ones proposed
    # (on a first visit at 32 sequences they were a third of SD auto's host work on a plain step)
    quiet = body and sp.selector.decision.far
    sp.shadow_credit = min(sp.shadow_credit + share * step_s, share * step_s * SHADOW_SEQS)
    start = sp.shadow_cursor % len(running)
    sp.shadow_cursor += SHADOW_SEQS
    tick = sp.shadow_cursor // SHADOW_SEQS
    for i, s in enumerate((running[start:] + running[:start])[:SHADOW_SEQS]):
        if s.finished:
            continue
        shadow = sp.seqs[s.seq_id].shadow
        for d in others:  # drafters whose proposals cost forwards shadow on one sequence every 4th step
            if d.costly and (i >= 1 or tick % 4):
                continue
            pending = shadow.get(d.name)
            if pending is not None:
                at, path, features = pending
                got = s.output_ids[at:]
                m = 0
                while m < min(len(path), len(got)) and path[m] == got[m]:
                    m += 1
                if m < min(len(path), len(got)) or len(got) >= len(path):
                    sp.selector.record_shadow(d.name, m, len(path))
                    # the sequence's own share of acceptance (SeqAccept): on a first visit most steps are plain,
                    # and the rollout waits for the sequences its drafts miss (Selector.worth)
                    est = sp.selector.acceptance(Arm(d.name, max(sp.selector.budgets)))
                    if est is not None and est[0] > 0 and s.seq_id in sp.seqs:
                        sp.seqs[s.seq_id].accept.add(m, est[0])
                    if features is not None:
                        sp.odds.observe_path(*features, m)
                    sp.watch(d.name, "shadow", m, len(path), [s])
                    pending = None
                    shadow.pop(d.name, None)
            if pending is None:
                if quiet or (step_s and sp.shadow_credit <= 0):
                    continue
                depth = sp.cfg.init_depth if d.costly else sp.cfg.max_depth
                t0 = time.perf_counter()
                try:
                    tree = d.propose([s], [max(sp.selector.budgets)], [depth])[0]
                except Exception:
                    tree = None
                sp.shadow_credit -= time.perf_counter() - t0
                path = tree.top_path() if tree else []
                if path:
                    features = (tree.drafter, sp.odds.path_features(tree)) if sp.cfg.allocate else None
                    shadow[d.name] = (len(s.output_ids), path, features)
                else:
                    shadow.pop(d.name, None)
                    sp.selector.record_shadow(d.name, 0, 0)
