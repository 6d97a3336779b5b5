"""The rules of RocketMQ-style half messages: states, check-back planning, op progress.

Pure decision logic: no Ray, no I/O.

Vocabulary (seeds 000/001):
- a *half* message sits in the half topic, invisible to consumers, with its
  real topic/queue in properties; it is identified by its *origin*: the
  physical offset of its first stored version (a re-put copy made by a
  check keeps the origin of the half it copies);
- an *op* record (op topic) resolves an origin: committed, rolled back or
  expired.  No record is rewritten: state changes are new records.

State machine of a half (``HalfState``; the ids go to disk in op records):

    PREPARED --commit--> COMMITTED
    PREPARED --rollback--> ROLLED_BACK
    PREPARED --max checks--> EXPIRED --operator or late producer--> COMMITTED | ROLLED_BACK

COMMITTED and ROLLED_BACK are final.  A repeated end for a final half
changes nothing (a duplicate, not an error); an end asking a final half for
the other final state is a conflict (``EndConflict``): a producer's late end
is answered NOOP, an operator is told what the half became.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class HalfState(enum.Enum):
    """A half's state; the value is its stable id, written in op records."""

    PREPARED = 0
    COMMITTED = 1
    ROLLED_BACK = 2
    EXPIRED = 3

    @classmethod
    def from_stored(cls, text: str) -> "HalfState":
        """A state as an op record stores it: its id (or its name, in older records)."""
        return cls(int(text)) if text.isdigit() else cls[text]

    @property
    def final(self) -> bool:
        return self in (HalfState.COMMITTED, HalfState.ROLLED_BACK)


#: state -> the states it may move to
TRANSITIONS: dict[HalfState, frozenset[HalfState]] = {
    HalfState.PREPARED: frozenset({HalfState.COMMITTED, HalfState.ROLLED_BACK, HalfState.EXPIRED}),
    HalfState.EXPIRED: frozenset({HalfState.COMMITTED, HalfState.ROLLED_BACK}),
    HalfState.COMMITTED: frozenset(),
    HalfState.ROLLED_BACK: frozenset(),
}


class IllegalTransition(Exception):
    pass


class EndConflict(IllegalTransition):
    """A final half asked for the other final state (commit after rollback, or back)."""

    def __init__(self, current: HalfState, wanted: HalfState):
        super().__init__(f"it was already {current.name}; it cannot become {wanted.name}")
        self.current = current
        self.wanted = wanted


def next_state(current: HalfState, wanted: HalfState) -> HalfState | None:
    """The state after asking ``current`` to become ``wanted``.

    Returns None when nothing is to be done: already that state (a duplicate
    end), or already final (a late end; ``check_conflict`` tells the two
    apart for those who must know).  Raises for moves the machine forbids.
    """
    if current == wanted or current.final:
        return None
    if wanted not in TRANSITIONS[current]:
        raise IllegalTransition(f"a half in state {current.name} cannot become {wanted.name}")
    return wanted


def check_conflict(current: HalfState, wanted: HalfState) -> None:
    """Raise ``EndConflict`` when a final half is asked for the other final state."""
    if current.final and wanted != current:
        raise EndConflict(current, wanted)


@dataclass(frozen=True)
class HalfView:
    """What the planner needs to know about one half in the half queue."""

    queue_offset: int
    origin: int
    group: str
    store_ms: int    # when its clock started: stored, or last checked (re-put copies)
    checks: int
    timeout_ms: int  # the transaction timeout of this message (default or its override)


class Action(enum.Enum):
    SKIP = "skip"          # resolved: just move past it
    STOP = "stop"          # too young, and so is everything after it: end the round
    DEFER = "defer"        # re-put as is (not yet due after back-off, or rate-limited)
    WAIT = "wait"          # re-put as is: no live producer of its group (not counted)
    CHECK = "check"        # re-put with checks + 1 and ask a producer of the group
    EXPIRE = "expire"      # max checks reached: to the check-expired topic


@dataclass
class CheckPolicy:
    max_checks: int = 15
    check_backoff_max_ms: int = 300_000
    max_checks_per_group: int = 1000  # per round: a storm of checks is bounded
    base_timeout_ms: int = 6000  # the default transaction timeout (the smallest usual one)

    def due_ms(self, h: HalfView) -> int:
        """When a half may be checked: after its timeout, then with doubling back-off."""
        if h.checks == 0:
            return h.store_ms + h.timeout_ms
        backoff = min(h.timeout_ms * (2 ** min(h.checks - 1, 20)), self.check_backoff_max_ms)
        return h.store_ms + max(h.timeout_ms, backoff)


@dataclass
class RoundPlan:
    actions: list[tuple[HalfView, Action]] = field(default_factory=list)
    checks_per_group: dict[str, int] = field(default_factory=dict)
    waiting_groups: set[str] = field(default_factory=set)


def plan_round(halves: list[HalfView], resolved: set[int] | dict, live_groups: set[str],
               now_ms: int, policy: CheckPolicy, used: dict[str, int] | None = None) -> RoundPlan:
    """Decide what to do with each half, in half-queue order.

    The half queue is in store order, so the first never-checked half that
    is not yet due means every later never-checked one is younger: the round
    stops there.  Re-put copies (checks > 0) wait out their back-off by being
    re-put again (DEFER), so that one young or slow half never blocks the
    progress of the others.
    """
    plan = RoundPlan(checks_per_group=dict(used or {}))  # ``used``: earlier in the round
    for h in halves:
        if h.origin in resolved:
            plan.actions.append((h, Action.SKIP))
            continue
        if now_ms < policy.due_ms(h):
            if h.checks == 0 and now_ms < h.store_ms + policy.base_timeout_ms:
                plan.actions.append((h, Action.STOP))  # young: so is everything after it
                break
            plan.actions.append((h, Action.DEFER))  # backing off, or a long custom timeout
            continue
        if h.group not in live_groups:
            plan.waiting_groups.add(h.group)
            plan.actions.append((h, Action.WAIT))
            continue
        if h.checks >= policy.max_checks:
            plan.actions.append((h, Action.EXPIRE))
            continue
        used = plan.checks_per_group.get(h.group, 0)
        if used >= policy.max_checks_per_group:
            plan.actions.append((h, Action.DEFER))
            continue
        plan.checks_per_group[h.group] = used + 1
        plan.actions.append((h, Action.CHECK))
    return plan


def op_progress(op_origins: list[int], min_pending_origin: int | None) -> int:
    """How many op records (from the current op progress) may be passed.

    An op may be passed once its half can no longer come up in the scan: its
    origin is below the smallest origin still pending.  Progress stops at the
    first op not yet matched (seed 001), never skipping one.
    """
    n = 0
    for origin in op_origins:
        if min_pending_origin is not None and origin >= min_pending_origin:
            break
        n += 1
    return n
