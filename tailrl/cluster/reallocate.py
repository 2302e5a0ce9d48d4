"""Sample reallocation on the workers, the driver's side (RLHFSpec, Seer): in a round where a worker is idle, it
takes tail work from the worker with the most predicted time left, as much as the cost rule (`migrate.plan_moves`)
says pays; a move exports the running sequences with their tokens and imports them on the receiver, which
re-prefills them. `cr` is the `ClusterRollout` (cluster/rollout.py) whose state these read and update.

Invariant: a moved sequence keeps its seed and sample index, so it emits the tokens it would have where it was."""

from __future__ import annotations

from .migrate import Candidate, plan_moves
from .pool import WorkerFailed


def migrate_tail(cr) -> None:
    """Idle workers take tail work: each from the donor with the most predicted time left, what the cost
    rule (migrate.plan_moves) says pays, shared among the idle workers."""
    for recv in [w for w in cr._live() if not cr.held[w]]:
        live = cr._live()
        donors = [w for w in live if len(cr.held[w]) >= cr.cfg.migrate_min_running]
        if recv not in live or cr.held[recv] or not donors:
            continue
        rem = {w: [remaining(cr, k) for k in cr.held[w].values()] for w in donors}
        donor = max(donors, key=lambda w: (cr.cost.base_s * max(rem[w]) + cr.cost.per_token_s * sum(rem[w]), -w))
        cands = [Candidate(i, len(cr.prompt_ids.get(k[0], [])), len(cr.samples[k].tokens), r)
                 for (i, k), r in zip(cr.held[donor].items(), rem[donor])]
        n_idle = sum(1 for w in live if not cr.held[w])
        moves = plan_moves(cands, 0, cr.cost, cr.cfg.migrate_min_running, cr.cfg.migrate_margin,
                           max_moves=max(len(cands) // n_idle, 1))
        if moves:
            move(cr, donor, recv, [c.key for c in moves])


def remaining(cr, key: tuple[int, int]) -> float:
    """The predicted tokens a running sample has left (placement.LengthPredictor)."""
    p = cr.params[key[0]]
    return cr.predictor.remaining(cr.prompts[key[0]], cr.tasks[key[0]], len(cr.samples[key].tokens), p.max_tokens)


def move(cr, donor: int, recv: int, ids: list[int]) -> None:
    """Moves the donor's sequences `ids` to `recv`: exported there with their tokens, imported here (re-prefilled),
    held and forwarded from where the donor's history already holds them. A worker failing on either side is
    handled as any failure (its work re-run)."""
    try:
        states = cr.pool.call(donor, "export", ids, timeout=cr.cfg.step_timeout_s)
    except WorkerFailed as e:
        cr._fail(donor, str(e))
        return
    keys = [cr.held[donor].pop(i) for i in ids]
    for key, st in zip(keys, states):
        cr._check_label(donor, key, st.prompt_index, st.prompt_ids, st.seed)
    try:
        new_ids = cr.pool.call(recv, "import_", states, timeout=cr.cfg.step_timeout_s)
    except WorkerFailed as e:
        cr._fail(recv, str(e))
        cr._requeue(keys)
        return
    for i, key, st in zip(new_ids, keys, states):
        cr._hold(recv, i, key)
        s = cr.samples[key]
        s.tokens = list(st.output_ids)
        s.sent.pop(recv, None)
        s.sent[donor] = len(s.tokens)  # the donor's history already holds these tokens
        if st.output_ids:
            cr.counts["cluster/reprefill_tokens"] += len(st.prompt_ids) + len(st.output_ids)
    cr.counts["cluster/migrated"] += len(ids)
