"""Half messages and transaction ends: the shard's half index, its recovery, the end plan.

A plain class over the shard's store, called under the shard's transaction
lock.  It never writes: ``plan_ends`` returns the records an end writes, the
shard appends them in one put, then ``apply`` marks the halves resolved
(prepare -> durable append -> apply).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from raymq.actors.rocketmq_tx.logic import (EndConflict, HalfState, IllegalTransition, check_conflict,
                                     next_state, op_progress)
from raymq.actors.rocketmq_tx.records import (first_copy_offset, op_entries, op_progress_origin,
                                       ops_record, real_from_half)
from raymq.actors.protocol import (CHECK_EXPIRED_TOPIC, HALF_TOPIC, OP_TOPIC, EndOutcome,
                                   EndRequest, EndResult, Prop, make_msg_id)
from raymq.actors.front.reads import stored_message
from raymq.storage import MessageStore, RecordBatch
from raymq.storage.errors import CorruptLogError, InvalidMessageError
from raymq.storage.records import Record, StoredMessage

log = logging.getLogger("raymq.shard")

#: Pending halves whose content is kept in memory for their end (the rest are read back).
HALF_CACHE_MAX = 100_000
#: Durable progress keys (in the store's offsets) of the half and op queues.
HALF_PROGRESS = "txn-half-progress"
OP_PROGRESS = "txn-op-progress"

#: What an end's state asks for (None: nothing, the check-back asks later).
WANTED = {"COMMIT_MESSAGE": HalfState.COMMITTED, "COMMIT": HalfState.COMMITTED,
          "ROLLBACK_MESSAGE": HalfState.ROLLED_BACK, "ROLLBACK": HalfState.ROLLED_BACK,
          "UNKNOW": None, "UNKNOWN": None}
_OUTCOME = {HalfState.COMMITTED: EndOutcome.COMMITTED,
            HalfState.ROLLED_BACK: EndOutcome.ROLLED_BACK}


def parsed(shard: int, m: StoredMessage, parse, default, *, whole: bool = False):
    """``parse(m.properties)`` (or ``parse(m)`` when ``whole``), or ``default`` -- logged --
    for a record the shard cannot parse: recovery and rounds skip it instead of dying."""
    try:
        return parse(m if whole else m.properties)
    except (ValueError, KeyError, TypeError, CorruptLogError) as err:
        log.warning("shard-%d: cannot parse %s record at %d (%s: %s); skipped", shard, m.topic,
                    m.phys_offset, type(err).__name__, err)
        return default


class CachedHalf(NamedTuple):
    """What an end needs of a half, as it was sent (the fields of ``StoredMessage`` used)."""

    topic: str
    properties: dict
    phys_offset: int
    body: bytes
    key: str | None
    tags: str | None
    born_ms: int
    headers: list | None = None


@dataclass
class EndPlan:
    """Ends checked and turned into records: outcomes in order, records to write, halves
    they resolve (origin -> new state)."""

    outcomes: list[EndResult] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    resolved: dict[int, HalfState] = field(default_factory=dict)


def carries_halves(batch: RecordBatch, res) -> bool:
    """Whether a put stored halves (a duplicate stored nothing)."""
    return not res.duplicate and batch.properties is not None and (
        batch.topics == HALF_TOPIC or (isinstance(batch.topics, list)
                                       and HALF_TOPIC in batch.topics))


class HalfIndex:
    """Which halves are pending, which resolved, and where their latest copies are."""

    def __init__(self, shard: int, store: MessageStore, expired_keep_ms: int | None = None):
        """``expired_keep_ms``: how long an expired half stays resolvable by operators
        (the retention of the check-expired topic; None: for good)."""
        self.shard = shard
        self.store = store
        self.expired_keep_ms = expired_keep_ms
        self.pending: dict[int, int] = {}        # unresolved origin -> its latest copy
        self.latest_copy: dict[int, int] = {}    # origin -> queue offset of its latest copy
        self.sizes: dict[int, int] = {}          # pending origin -> its record size
        self.cache: dict[int, CachedHalf] = {}   # pending origin -> the half as sent
        self.resolved: dict[int, HalfState] = {}  # origin -> COMMITTED/ROLLED_BACK/EXPIRED
        self.waiting_groups: set[str] = set()    # groups with due halves and no live producer

    # ------------------------------------------------------------ recovery
    def load(self) -> None:
        """Rebuild the index: ops from the op progress, halves from the half progress."""
        store = self.store
        for m in store.scan_queue(OP_TOPIC, 0, store.offsets.get(OP_PROGRESS, 0)):
            for origin, state in parsed(self.shard, m, op_entries, []):
                self.resolved[origin] = state
        for m in store.scan_queue(HALF_TOPIC, 0, store.offsets.get(HALF_PROGRESS, 0)):
            origin = parsed(self.shard, m, first_copy_offset, None, whole=True)
            if origin is None:
                continue
            self.latest_copy[origin] = m.queue_offset
            if origin not in self.resolved:
                self.pending[origin] = m.queue_offset

    def note_new(self, batch: RecordBatch, res) -> None:
        """Track the halves just stored; keep what their end needs, so it reads nothing.

        A duplicate (a resend) stored nothing: its halves were tracked when the
        first copy was, and may be resolved and forgotten since -- tracking them
        again would make a rolled-back half pending, and committable, again.
        """
        if not carries_halves(batch, res):
            return
        props, bodies = batch.column("properties"), batch.bodies
        keys, tags, born = batch.column("keys"), batch.column("tags"), batch.column("born_ms")
        headers = batch.column("headers")
        room = HALF_CACHE_MAX - len(self.cache)
        for i, (t, phys, qoff, size) in enumerate(zip(batch.column("topics"), res.phys_offsets,
                                                      res.queue_offsets, res.sizes)):
            if t == HALF_TOPIC and phys not in self.resolved:
                self.pending.setdefault(phys, qoff)
                self.latest_copy.setdefault(phys, qoff)
                self.sizes[phys] = size
                if room > 0 and phys not in self.cache:
                    self.cache[phys] = CachedHalf(HALF_TOPIC, props[i], phys, bodies[i],
                                                  keys[i], tags[i], born[i], headers[i])
                    room -= 1

    def state_of(self, origin: int) -> HalfState | None:
        if origin in self.resolved:
            return self.resolved[origin]
        if origin in self.pending:
            return HalfState.PREPARED
        return None  # resolved long ago (passed by the checker), or not a half

    def moved(self, origin: int, queue_offset: int) -> None:
        """A half was re-put: its latest copy is now at ``queue_offset``."""
        self.pending[origin] = queue_offset
        self.latest_copy[origin] = queue_offset

    # ---------------------------------------------------------------- ends
    def plan_ends(self, requests: list) -> EndPlan:
        """Check producers' ends and build their records; a bad end is refused alone."""
        ends = [EndRequest.of(r) for r in requests]
        halves = self.read_halves([o for e in ends for o in e.origins])
        plan, ops = EndPlan(), []
        for end in ends:
            try:
                outcome, real, resolved = self.plan_end(end, operator=False,
                                                        also_done=plan.resolved, halves=halves)
            except (InvalidMessageError, IllegalTransition) as err:
                plan.outcomes.append(EndResult(EndOutcome.REFUSED, str(err)))
                continue
            except Exception as err:  # one bad request must not lose the others' ends
                log.warning("shard-%d: end of %s failed: %s", self.shard, end.transaction_id, err)
                plan.outcomes.append(EndResult(EndOutcome.FAILED, f"{type(err).__name__}: {err}"))
                continue
            plan.outcomes.append(EndResult(outcome))
            plan.records += real
            ops += resolved.items()
            plan.resolved.update(resolved)
        if ops:  # one op record for all the ends of the call
            plan.records.append(ops_record(ops))
        return plan

    def plan_end(self, end: EndRequest, *, operator: bool, also_done: dict | None = None,
                 halves: dict | None = None) -> tuple[EndOutcome, list[Record], dict]:
        """Check one end: (outcome, real records, resolved halves).

        A producer's end for a half already final is a NOOP (duplicate or
        late); an operator asking a final half for the other state is told
        what it became (``InvalidMessageError``).
        """
        if end.state not in WANTED:
            raise InvalidMessageError(f"unknown transaction state {end.state!r}")
        target = WANTED[end.state]
        if target is None:
            return EndOutcome.UNKNOW, [], {}
        real, done = [], {}
        for origin in end.origins:
            half = (halves or {}).get(origin) or self.aged_copy(origin) or \
                stored_message(self.store, self.shard, origin)
            self._check_end_matches(end, origin, half, operator=operator)
            # (an origin named twice in one end is resolved once)
            current = done.get(origin) or (also_done or {}).get(origin) \
                or self.state_of(origin)
            if current is None and operator:  # resolved and forgotten: look it up
                current = self.find_resolution(origin)
            if current is None:
                continue
            if operator:
                self._check_operator_conflict(origin, current, target)
            new = next_state(current, target)
            if new is None:
                continue
            if new == HalfState.COMMITTED:
                real.append(real_from_half(self.shard, half))
            done[origin] = new
        return (_OUTCOME[target] if done else EndOutcome.NOOP), real, done

    #: Most op records an operator's end reads back to find a forgotten resolution.
    RESOLUTION_SCAN_MAX = 1_000_000

    def find_resolution(self, origin: int) -> HalfState | None:
        """What a half was resolved to, read back from the op records (newest first): for
        an operator's end on a half whose resolution the index no longer keeps."""
        end = self.store.max_queue_offset(OP_TOPIC, 0)
        for hi in range(end, max(0, end - self.RESOLUTION_SCAN_MAX), -1000):
            lo = max(0, hi - 1000)
            for m in reversed(self.store.read_queue(OP_TOPIC, 0, lo, hi - lo)):
                for o, state in parsed(self.shard, m, op_entries, []):
                    if o == origin:
                        return state
        return None

    def _check_end_matches(self, end: EndRequest, origin: int, half, *, operator: bool) -> None:
        props = half.properties
        if half.topic != HALF_TOPIC or props.get(Prop.TRAN_MSG) != "true":
            raise InvalidMessageError(f"{make_msg_id(self.shard, origin)} is not a half message")
        if not operator and (props.get(Prop.PRODUCER_GROUP) != end.group
                             or props.get(Prop.TRANSACTION_ID) != end.transaction_id):
            raise InvalidMessageError(
                f"end of transaction {end.transaction_id!r} from group {end.group!r} does not "
                f"match half {make_msg_id(self.shard, origin)} (group "
                f"{props.get(Prop.PRODUCER_GROUP)!r}, transaction "
                f"{props.get(Prop.TRANSACTION_ID)!r})")

    def _check_operator_conflict(self, origin: int, current: HalfState,
                                 target: HalfState) -> None:
        try:
            check_conflict(current, target)
        except EndConflict as err:
            raise InvalidMessageError(f"half {make_msg_id(self.shard, origin)}: {err}") from None

    def read_halves(self, origins: list[int]) -> dict[int, StoredMessage | CachedHalf]:
        """The halves of many ends: kept from their send, else in one read where their sizes
        are known."""
        found = {o: self.cache[o] for o in origins if o in self.cache}
        for o in origins:
            if o not in found and (copy := self.aged_copy(o)) is not None:
                found[o] = copy
        known = sorted({o for o in origins if o in self.sizes and o not in found})
        if not known:
            return found
        entries = np.empty(len(known), dtype=[("phys", "<i8"), ("size", "<i4"), ("tag", "<i8")])
        entries["phys"] = known
        entries["size"] = [self.sizes[o] for o in known]
        entries["tag"] = 0
        try:
            found.update((m.phys_offset, m) for m in self.store.messages_at(entries).messages())
        except Exception as err:  # fall back to reading them one by one
            log.warning("shard-%d: batched half read failed: %s", self.shard, err)
        return found

    def aged_copy(self, origin: int) -> StoredMessage | None:
        """The latest copy of a pending half whose first copy aged out (None: its first
        is still there, or no copy is known).  Every check round re-puts the halves it
        passes at the head of the log, so a half outlives the segment it was sent in:
        its end reads this copy (same origin, same contents)."""
        if origin >= self.store.min_phys_offset:
            return None
        qoff = self.pending.get(origin)
        got = self.store.read_queue(HALF_TOPIC, 0, qoff, 1) if qoff is not None else []
        return got[0] if got else None

    def apply(self, resolved: dict[int, HalfState]) -> None:
        """The records of these resolutions are written: the halves are resolved."""
        for origin, state in resolved.items():
            self.settle(origin, state)

    def settle(self, origin: int, state: HalfState) -> None:
        """A half is resolved (or expired): no longer pending, nothing of it kept."""
        self.resolved[origin] = state
        self.pending.pop(origin, None)
        self.sizes.pop(origin, None)
        self.cache.pop(origin, None)

    # ---------------------------------------------------------- op progress
    def advance_op_progress(self, half_progress: int) -> None:
        """Pass the ops (and forget the resolutions) whose halves can no longer come up.

        A resolution is needed as long as any copy of its half lies at or past
        the half progress; the smallest origin among those bounds what may go.
        """
        for origin in [o for o, q in self.latest_copy.items() if q < half_progress]:
            del self.latest_copy[origin]
        min_live = min(self.latest_copy) if self.latest_copy else None
        start = max(0, self.store.offsets.get(OP_PROGRESS, 0))
        # an op whose half is still EXPIRED is kept (operators and late ends may still
        # resolve it, and a restart must find it): it counts as not matched yet
        blocked = min_live if min_live is not None else float("inf")
        # ... until it is older than an expired half is kept: then it ages out, as the
        # check-expired topic's copy does (else one expired half held the log for good)
        aged_before = -1 if self.expired_keep_ms is None else \
            self.store.clock.now_ms() - self.expired_keep_ms
        passed, aged = start, set()
        for _ in range(40):  # up to 200,000 ops a call, 5,000 at a time
            ops = self.store.read_queue(OP_TOPIC, 0, passed, 5000)
            # (with no half pending an EXPIRED op still stops it: ``blocked``, not None)
            n = op_progress([parsed(self.shard, m, lambda p: op_progress_origin(
                p, self.resolved, blocked, aged=m.store_ms < aged_before), -1)
                for m in ops], blocked)
            aged.update(o for m in ops[:n] if m.store_ms < aged_before
                        for o, _st in parsed(self.shard, m, op_entries, []))
            passed += n
            if n < 5000:
                break
        if passed != start:
            self.store.save_offsets({OP_PROGRESS: passed})
        for origin in aged:  # (aged out: no longer listed or resolvable)
            if self.resolved.get(origin) is HalfState.EXPIRED:
                del self.resolved[origin]
        # forget what can no longer come up (expired halves stay: operators resolve them)
        for origin in [o for o, st in self.resolved.items() if st is not HalfState.EXPIRED
                       and o not in self.latest_copy
                       and (min_live is None or o < min_live)]:
            del self.resolved[origin]

    # ------------------------------------------------------- operator views
    def list_halves(self, now_ms: int, *, expired: bool, limit: int) -> list[dict]:
        """Pending halves (or expired ones): id, group, transaction, age, checks, topic."""
        out = []
        for origin, m in self._listed(expired=expired, limit=limit):
            p = m.properties
            checks = parsed(self.shard, m, lambda q: int(q.get(Prop.CHECK_TIMES, 0)), -1)
            first = self.store.get_message(origin)
            out.append({"id": make_msg_id(self.shard, origin), "shard": self.shard,
                        "origin": origin, "group": p.get(Prop.PRODUCER_GROUP),
                        "transaction_id": p.get(Prop.TRANSACTION_ID),
                        "topic": p.get(Prop.REAL_TOPIC),
                        "checks": checks,
                        "age_ms": now_ms - first.store_ms,
                        "state": "EXPIRED" if expired else "PREPARED",
                        "waiting_for_producer": p.get(Prop.PRODUCER_GROUP) in self.waiting_groups})
        return out

    def _listed(self, *, expired: bool, limit: int) -> list[tuple[int, StoredMessage]]:
        """(origin, latest copy) of the pending halves, or of the expired ones."""
        store = self.store
        if not expired:
            found = [(o, store.read_queue(HALF_TOPIC, 0, q, 1))
                     for o, q in sorted(self.pending.items())[:limit]]
            return [(o, copies[0]) for o, copies in found if copies]
        origins = {o for o, st in self.resolved.items() if st is HalfState.EXPIRED}
        out = []
        for m in store.scan_queue(CHECK_EXPIRED_TOPIC, 0):
            origin = parsed(self.shard, m, lambda p: int(p.get(Prop.ORIGIN_HALF, -1)), -1)
            if origin in origins:
                out.append((origin, m))
        return out

    def status(self) -> dict:
        return {"pending_halves": len(self.pending),
                "expired_halves": sum(1 for s in self.resolved.values() if s is HalfState.EXPIRED),
                "groups_without_live_producer": sorted(self.waiting_groups)}
