"""Pure transaction logic: the half state machine and the check-round planner (no Ray)."""
from __future__ import annotations

import pytest

from raymq.actors.rocketmq_tx.logic import (TRANSITIONS, Action, CheckPolicy, HalfState, HalfView,
                                 IllegalTransition, next_state, op_progress, plan_round)


def test_every_state_and_transition():
    assert set(TRANSITIONS) == set(HalfState)
    for state in HalfState:
        for wanted in HalfState:
            if wanted == state or state.final:
                assert next_state(state, wanted) is None  # duplicate / late: harmless
            elif wanted in TRANSITIONS[state]:
                assert next_state(state, wanted) == wanted
            else:
                with pytest.raises(IllegalTransition):
                    next_state(state, wanted)
    assert next_state(HalfState.EXPIRED, HalfState.COMMITTED) == HalfState.COMMITTED
    with pytest.raises(IllegalTransition):
        next_state(HalfState.EXPIRED, HalfState.PREPARED)
    assert [s.value for s in HalfState] == [0, 1, 2, 3]  # ids on disk never change


def h(off, origin=None, group="g", store=0, checks=0, timeout=6000):
    return HalfView(off, off if origin is None else origin, group, store, checks, timeout)


def test_round_stops_at_the_first_young_half():
    halves = [h(0, store=0), h(1, store=1000), h(2, store=9000), h(3, store=9500)]
    plan = plan_round(halves, set(), {"g"}, now_ms=8000, policy=CheckPolicy())
    assert [a for _, a in plan.actions] == [Action.CHECK, Action.CHECK, Action.STOP]


def test_resolved_skipped_no_producer_waits_uncounted_max_checks_expire():
    halves = [h(0), h(1, group="gone"), h(2, checks=15, store=0), h(3, origin=0, checks=2)]
    plan = plan_round(halves, {0}, {"g"}, now_ms=10 ** 9, policy=CheckPolicy(max_checks=15))
    assert [a for _, a in plan.actions] == [Action.SKIP, Action.WAIT, Action.EXPIRE, Action.SKIP]
    assert plan.waiting_groups == {"gone"}


def test_backoff_between_checks_of_the_same_half_and_storm_bound():
    pol = CheckPolicy(max_checks_per_group=2, check_backoff_max_ms=60_000)
    assert pol.due_ms(h(0, store=0, checks=0)) == 6000
    assert pol.due_ms(h(0, store=0, checks=3)) == 24_000
    assert pol.due_ms(h(0, store=0, checks=12)) == 60_000
    recheck = h(5, store=1000, checks=3)  # re-put copy, back-off not over: deferred
    halves = [recheck] + [h(i, store=0) for i in range(6, 10)]
    plan = plan_round(halves, set(), {"g"}, now_ms=10_000, policy=pol)
    assert [a for _, a in plan.actions] == [Action.DEFER, Action.CHECK, Action.CHECK,
                                            Action.DEFER, Action.DEFER]
    assert plan.checks_per_group == {"g": 2}


def test_op_progress_stops_at_first_unmatched_op():
    assert op_progress([1, 2, 10, 3], min_pending_origin=5) == 2
    assert op_progress([1, 2, 3], min_pending_origin=None) == 3
    assert op_progress([], min_pending_origin=1) == 0


def test_a_long_custom_timeout_does_not_block_later_halves():
    pol = CheckPolicy(base_timeout_ms=6000)
    long_one = h(0, store=0, timeout=3_600_000)
    later = h(1, store=100)
    plan = plan_round([long_one, later], set(), {"g"}, now_ms=10_000, policy=pol)
    assert [a for _, a in plan.actions] == [Action.DEFER, Action.CHECK]
