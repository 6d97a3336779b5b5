"""The check-back round's I/O on one shard: read the half queue, re-put, expire, ask.

The decisions are ``half_logic.plan_round`` (pure); this reads the halves a
window at a time, has the shard append the copies and op records the plan
calls for, then updates the half index and the durable half progress.
"""
from __future__ import annotations

import threading
from typing import Callable

from raymq.actors.rocketmq_tx.logic import Action, CheckPolicy, HalfState, HalfView, plan_round
from raymq.actors.rocketmq_tx.records import check_copy, listener_view, op_record
from raymq.actors.rocketmq_tx.halves import HALF_PROGRESS, HalfIndex, parsed
from raymq.actors.protocol import CHECK_EXPIRED_TOPIC, HALF_TOPIC, CheckRequest, Prop
from raymq.storage import MessageStore
from raymq.storage.records import Record, StoredMessage

#: Most half-queue entries one round reads per shard (resolved ones cost little).
ROUND_SCAN_MAX = 200_000


class CheckRounds:
    """Check-back rounds over one shard's half queue (called by a checker)."""

    def __init__(self, shard: int, store: MessageStore, halves: HalfIndex,
                 append: Callable[[list[Record]], object], lock: threading.RLock, config,
                 metrics):
        self.shard = shard
        self.store = store
        self.halves = halves
        self._append = append   # the shard's put of records: returns the put's result
        self._lock = lock       # the shard's transaction lock
        self.config = config
        self.metrics = metrics
        #: a replicated shard's confirmed offset (None: every record is): halves past it
        #: are not checked yet
        self.confirmed: Callable[[], int | None] = lambda: None

    def run(self, live_groups: list[str], *, now_ms: int, window: int,
            max_checks_per_group: int, checks_used: dict[str, int] | None) -> list[CheckRequest]:
        """One check-back round over this shard's halves; returns the checks to ask.

        Re-puts what it checks (check count + 1) or defers, moves halves past
        the maximum number of checks to the check-expired topic, and advances
        the durable half and op progress.  Safe to repeat after a crash: a
        repeated re-put only makes a second copy of a half with the same
        origin, which resolves with it.

        The round reads the half queue ``window`` entries at a time (sends go
        on between windows) up to the first half not yet due, or to the end the
        queue had when the round began (the copies it re-puts wait for the next
        round), at most ``ROUND_SCAN_MAX`` entries.  ``max_checks_per_group``
        bounds a group's checks in the round; ``checks_used`` are those the
        round already sent it from other shards.
        """
        policy = CheckPolicy(max_checks=self.config.txn_max_checks,
                             check_backoff_max_ms=self.config.txn_check_backoff_max_ms,
                             max_checks_per_group=max_checks_per_group,
                             base_timeout_ms=self.config.txn_timeout_ms)
        used = dict(checks_used or {})
        end = self.store.max_queue_offset(HALF_TOPIC, 0)
        out: list[CheckRequest] = []
        waiting: set[str] = set()
        waits = scanned = 0
        while True:
            checks, more, plan = self._window(live_groups, policy, now_ms, window, end, used)
            out += checks
            waiting |= plan.waiting_groups
            waits += sum(1 for _v, a in plan.actions if a is Action.WAIT)
            used = plan.checks_per_group
            scanned += window
            if not more or scanned >= ROUND_SCAN_MAX:
                break
        with self._lock:  # groups stay "waiting" until a producer of theirs is live again
            self.halves.waiting_groups = (self.halves.waiting_groups - set(live_groups)) | waiting
            # once a round, with where the windows got to
            self.halves.advance_op_progress(max(0, self.store.offsets.get(HALF_PROGRESS, 0)))
        self.metrics.set("halves_waiting_for_producer", float(waits))
        self.metrics.inc("transaction_checks", len(out))
        return out

    def _views(self, halves: list[StoredMessage]) -> tuple[list[HalfView], set[int]]:
        """The planner's view of each half, and the origins of those it cannot parse
        (skipped, like resolved ones: logged, never stopping the round)."""
        views, unparsable = [], set()
        for m in halves:
            if m.phys_offset in self.halves.resolved:  # a first copy, resolved: skip undecoded
                views.append(HalfView(m.queue_offset, m.phys_offset, "", 0, 0, 0))
                continue
            view = parsed(self.shard, m, self._view, None, whole=True)
            if view is None:
                view = HalfView(m.queue_offset, m.phys_offset, "", 0, 0, 0)
                unparsable.add(m.phys_offset)
            views.append(view)
        return views, unparsable

    def _view(self, m: StoredMessage) -> HalfView:
        p = m.properties
        return HalfView(m.queue_offset, int(p.get(Prop.ORIGIN_HALF, m.phys_offset)),
                        p.get(Prop.PRODUCER_GROUP, ""), int(p.get(Prop.CHECK_BASE_MS, m.store_ms)),
                        int(p.get(Prop.CHECK_TIMES, 0)),
                        int(p.get(Prop.TXN_TIMEOUT_MS, self.config.txn_timeout_ms)))

    def _window(self, live_groups: list[str], policy: CheckPolicy, now: int, window: int,
                end: int, used: dict[str, int]):
        """One window of a round: (checks, whether the round goes on, the plan)."""
        with self._lock:
            start = max(0, self.store.offsets.get(HALF_PROGRESS, 0))
            halves = self.store.read_queue(HALF_TOPIC, 0, start, max(0, min(window, end - start)))
            confirmed = self.confirmed()
            if confirmed is not None:  # (a replicated shard: a half no in-sync replica has
                # yet may be gone after a failover; the producer is asked of it later)
                halves = [m for m in halves if m.phys_offset < confirmed]
            views, unparsable = self._views(halves)
            skipped = _Either(self.halves.resolved, unparsable) if unparsable \
                else self.halves.resolved
            plan = plan_round(views, skipped, set(live_groups), now, policy, used)
            writes, checks, progress, stopped = self._act(plan, halves, now, start)
            if writes:
                res = self._append([w[2] for w in writes])
                for (kind, view, _rec), qoff in zip(writes, res.queue_offsets):
                    if kind == "half":
                        self.halves.moved(view.origin, qoff)
                    elif kind == "op":
                        self.halves.settle(view.origin, HalfState.EXPIRED)
            # the progress may pass halves resolved by puts not flushed yet (ends are
            # resolved when written, before their fsync): save_offsets makes them durable
            if progress != start:
                self.store.save_offsets({HALF_PROGRESS: progress})
        more = not stopped and bool(halves) and progress < end
        return ([CheckRequest(self.shard, v.group, v.origin, count,
                              m.properties.get(Prop.TRANSACTION_ID),
                              listener_view(m, self.shard, v.origin))
                 for v, m, count in checks], more, plan)

    def _act(self, plan, halves: list[StoredMessage], now: int, start: int):
        """The records a window's plan writes: (writes, checks, progress, stopped)."""
        by_offset = {m.queue_offset: m for m in halves}
        writes, checks, progress = [], [], start
        for view, action in plan.actions:
            if action is Action.STOP:
                return writes, checks, progress, True
            progress = view.queue_offset + 1
            if action is Action.SKIP:
                continue
            if self.halves.latest_copy.get(view.origin, view.queue_offset) != view.queue_offset:
                continue  # a stale copy (a round repeated after a crash): the newer one counts
            m = by_offset[view.queue_offset]
            if action is Action.EXPIRE:
                writes.append(("expire", view, check_copy(m, view.origin, view.checks,
                                                          CHECK_EXPIRED_TOPIC, view.store_ms)))
                writes.append(("op", view, op_record(view.origin, HalfState.EXPIRED,
                                                     m.properties)))
                continue
            count = view.checks + (1 if action is Action.CHECK else 0)
            # the back-off runs from the last check; a deferred copy keeps its clock
            base = now if action is Action.CHECK else view.store_ms
            writes.append(("half", view, check_copy(m, view.origin, count, HALF_TOPIC, base)))
            if action is Action.CHECK:
                checks.append((view, m, count))
        return writes, checks, progress, False

    def uncount(self, checks: list[tuple[int, int]]) -> int:
        """Take back checks that never reached a producer: ``[(origin, count)]``.

        The checker calls this when the group's registry could not take the
        checks a round planned: such a check does not count (a half is never
        expired for checks nobody was asked).  Each half's latest copy is put
        again with its check count back to ``count - 1``, keeping the time of
        the failed check as the base of its back-off.  Idempotent: a half
        resolved, checked again or already taken back meanwhile is left alone.
        Returns how many were taken back.
        """
        with self._lock:
            writes = []
            for origin, count in checks:
                qoff = self.halves.latest_copy.get(origin)
                if qoff is None or origin not in self.halves.pending:
                    continue
                copies = self.store.read_queue(HALF_TOPIC, 0, qoff, 1)
                if not copies:
                    continue
                m = copies[0]
                view = parsed(self.shard, m, self._view, None, whole=True)
                if view is None or view.checks != count or count <= 0:
                    continue
                writes.append((origin, check_copy(m, origin, count - 1, HALF_TOPIC,
                                                  view.store_ms)))
            if writes:
                res = self._append([w for _o, w in writes])
                for (origin, _w), qoff in zip(writes, res.queue_offsets):
                    self.halves.moved(origin, qoff)
        self.metrics.inc("transaction_checks_taken_back", len(writes))
        return len(writes)


class _Either:
    """``x in`` either of two containers (resolved origins, or ones that cannot be parsed)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __contains__(self, x) -> bool:
        return x in self.first or x in self.second
