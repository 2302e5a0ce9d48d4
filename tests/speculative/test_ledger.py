"""The rollout ledger (tailrl/speculative/ledger.py) on the selector's fake clock (tests/speculative/selector_helpers.py):
rollouts whose own SD-off estimate reads a loss rest the next ones, with a bounded back-off."""

from __future__ import annotations

from tailrl.speculative.selector import OFF
from tests.speculative.selector_helpers import TAIL_ONLY, run, trained


def test_rollouts_estimated_slower_than_sd_off_rest_the_next_ones_with_a_bounded_back_off():
    """The ledger (speculative/ledger.py): where a rollout's own SD-off estimate says it lost, the next rollouts decode
    plainly in every step even where each step's prices say drafts pay (the tail of TAIL_ONLY), 1 after a first
    loss, 2 after a second in a row, up to REST_MAX; so over 40 rollouts that would all lose, at most
    1 + 1 + 1 + 1 + ceil(36 / (REST_MAX + 1)) speculate; a rollout that does not lose ends the streak. It must fail
    for a selector that decides by steps alone (every rollout would speculate)."""
    from tailrl.speculative.ledger import REST_MAX

    sel = trained(TAIL_ONLY, sizes=(4, 4, 1), steps=80)
    contexts = [200 + 7 * i for i in range(4)]
    assert sel.choose(4, contexts) != OFF  # the steps' prices say speculate

    def rollout(estimate: float) -> bool:
        """A rollout of 20 steps at 4 sequences; whether any speculated. It is then estimated at `estimate`."""
        spec = any(d for d, _, _ in run(sel, TAIL_ONLY, 4, 20, seed=len(tried)))
        sel.end_rollout(estimate if spec else 1.0)
        return spec

    tried = []
    for _ in range(40):
        tried.append(rollout(0.8))
    assert tried[:8] == [True, False, True, False, False, True, False, False]  # rests of 1, 2, then 4
    assert sum(tried) <= 4 + -(-36 // (REST_MAX + 1))
    assert sel.ledger.rest <= REST_MAX
    while sel.ledger.resting:
        tried.append(rollout(0.8))
    assert rollout(1.05) and sel.ledger.streak == 0 and not sel.ledger.resting
    assert rollout(0.95) and rollout(1.05)  # no loss beyond the estimate's error: no rest
    assert rollout(0.8) and not rollout(0.8) and rollout(0.8)  # a new streak starts at a rest of 1
