"""A leader's side of one epoch (``LeaderState``): its in-sync set and confirmed offset
(``raymq.actors.replication.in_sync``), the writes waiting for the followers, and the
followers' fetches it serves -- each checked against the leader's epochs, so that a
position this log does not hold is answered as diverging, never counted.  Pure Python:
no Ray.
"""
from __future__ import annotations

import threading
from typing import Callable

from raymq.actors.replication.assignment import Assignment
from raymq.actors.replication.in_sync import Ack, ReplicaSet
from raymq.actors.replication.parts import Part, Shipper
from raymq.storage import MessageStore
from raymq.storage.clock import Clock
from raymq.storage.commitlog import SEGMENT_HEADER_BYTES
from raymq.storage.epochs import EpochCache
from raymq.storage.errors import InvalidMessageError, NotLeaderError
from raymq.storage.store import PutStatus

#: The sends of this thread ask for the leader's write only (``ShardReplica.call``).
_ACKS = threading.local()


class LeaderState:
    """A leader's side of one epoch: its ``ReplicaSet``, the writes waiting for it, and
    the followers' fetches it serves."""

    def __init__(self, shard: int, name: str, a: Assignment, store: MessageStore,
                 epochs: EpochCache, *, min_insync: int, lag_max_ms: int, timeout_ms: int,
                 confirmed: int, clock: Clock, wake_readers: Callable[[], None],
                 parts: list[Part] = ()):
        self.name, self.store, self.epochs, self.clock = name, store, epochs, clock
        self.timeout_ms = timeout_ms
        self.rs = ReplicaSet(shard, list(a.replicas), name, a.epoch, min_insync, lag_max_ms,
                             in_sync=set(a.in_sync) | {name})
        now = clock.monotonic_ms()
        for f in self.rs.followers.values():
            f.caught_up_ms = now  # (in sync as of the election)
        self.rs.took_over(store.max_phys_offset)  # (alone in sync: all of its log confirmed)
        self.rs.confirmed = max(self.rs.confirmed, min(confirmed, store.max_phys_offset))
        self._wake_readers = wake_readers
        self._cond = threading.Lock()  # one lock, two conditions: who waits for what
        self._acks = threading.Condition(self._cond)  # writes waiting for the confirmed offset
        self._data = threading.Condition(self._cond)  # fetches waiting for new records
        self._answered_end: dict[str, int] = {}  # the leader's end when a fetch was answered
        self.shipper = Shipper(list(parts), clock)  # what it keeps beside the log
        self.deposed = False

    @property
    def epoch(self) -> int:
        return self.rs.epoch

    def confirmed(self) -> int:
        return self.rs.confirmed

    def _moved(self, before: int) -> None:
        """(under the lock) wake what a new confirmed offset lets go on."""
        if self.rs.confirmed != before:
            self._acks.notify_all()
            self._wake_readers()

    # --------------------------------------------------------------- writes
    def refuse_if_short(self) -> None:
        if self.deposed:
            raise NotLeaderError(f"shard-{self.rs.shard}: {self.name} no longer leads")
        self.rs.refuse_if_short()

    def wait_replicated(self, end: int) -> PutStatus:
        """The store's replication hook: wait until every in-sync replica holds the log up
        to ``end``.  ``FLUSH_SLAVE_TIMEOUT`` when they did not within the timeout (the
        write stays; a resend waits again); ``NotEnoughReplicasError`` when too few are
        in sync; ``NotLeaderError`` once this replica was deposed."""
        deadline = self.clock.monotonic_ms() + self.timeout_ms
        with self._cond:
            before = self.rs.confirmed
            self.rs.appended(self.store.max_phys_offset)
            self._moved(before)
            if getattr(_ACKS, "leader", False):  # (acks of the leader only: written here)
                if self.deposed:
                    raise NotLeaderError(f"shard-{self.rs.shard}: {self.name} was deposed")
                return PutStatus.PUT_OK
            while True:
                if self.deposed:
                    raise NotLeaderError(f"shard-{self.rs.shard}: {self.name} was deposed "
                                         f"before the write was replicated (not acknowledged)")
                ack = self.rs.ack(end)
                if ack is Ack.OK:
                    return PutStatus.PUT_OK
                if ack is Ack.NOT_ENOUGH:
                    self.rs.refuse_if_short()
                left = deadline - self.clock.monotonic_ms()
                if left <= 0:
                    return PutStatus.FLUSH_SLAVE_TIMEOUT
                self._acks.wait(left / 1000.0)

    # -------------------------------------------------------------- fetches
    def serve_fetch(self, follower: str, epoch: int, from_phys: int, wait_ms: int,
                    max_bytes: int, offsets_version: int, held: dict | None = None,
                    last_epoch: int | None = None) -> dict:
        """A follower holding the log up to ``from_phys`` (group offsets of
        ``offsets_version``, the parts ``held``: ``raymq.actors.replication.parts``), whose
        latest leader epoch is ``last_epoch``, asks for what follows.

        A position this leader's log does not hold -- past its end, or after where the
        follower's last epoch ends here -- is not counted: the reply is ``{"diverging":
        (epoch, end)}`` (Kafka's diverging epoch, KIP-320/595) and the follower cuts its
        log and asks again, as many rounds as it takes (KIP-279)."""
        if follower not in self.rs.followers:
            raise InvalidMessageError(f"shard-{self.rs.shard}: {follower!r} is not a replica")
        deadline = self.clock.monotonic_ms() + max(0, min(wait_ms, 5000))
        with self._cond:
            self._check(epoch)
            diverging = self._diverging(from_phys, last_epoch)
            if diverging is not None:
                return {"diverging": diverging, "epochs": self.epochs.entries()}
            log_start = self.store.min_phys_offset
            if from_phys < log_start and from_phys < self.store.max_phys_offset:
                # what the follower would copy next aged out here: it starts again from
                # this log's first segment (Kafka: a fetch below the log start offset)
                return {"restart_at": log_start - SEGMENT_HEADER_BYTES,
                        "epochs": self.epochs.entries()}
            before = self.rs.confirmed
            self.rs.appended(self.store.max_phys_offset)
            self.rs.fetched(follower, from_phys, self._answered_end.get(follower, 1 << 62),
                            self.clock.monotonic_ms())
            self._moved(before)
            while self.store.max_phys_offset <= from_phys and not self.deposed and \
                    self.store.offsets.version == offsets_version:
                left = deadline - self.clock.monotonic_ms()
                if left <= 0:
                    break
                self._data.wait(left / 1000.0)
            self._check(epoch)
            end_then = self.store.max_phys_offset
            self._answered_end[follower] = end_then
            confirmed = self.rs.confirmed
        # the parts and offsets are read before the frames, and go only with every record
        # written before they were read, so that they never pass what the follower holds
        parts = self.shipper.due(follower, held) if held is not None and \
            from_phys + max_bytes >= end_then else {}
        version, table = self.store.offsets.version, None
        if version != offsets_version:  # (a copy of the whole table only when it changed)
            version, table = self.store.offsets.versioned()
        covered = self.store.max_phys_offset  # (>= end_then: a leader's log only grows)
        start, data = self.store.read_frames(from_phys, max_bytes)
        caught_up = start + len(data) >= covered
        if caught_up and parts:
            self.shipper.sent(follower, parts)
        return {"start": start, "data": data, "leader_end": end_then, "confirmed": confirmed,
                "log_start": self.store.min_phys_offset,
                "epochs": self.epochs.entries(), "offsets_version": version,
                "offsets": table if caught_up and version != offsets_version else None,
                "parts": parts if caught_up else {}}

    def _diverging(self, from_phys: int, last_epoch: int | None):
        """(under the lock) ``(epoch, end)`` when a follower at ``from_phys`` with latest
        epoch ``last_epoch`` holds what this log does not; None when its log is a prefix."""
        empty = from_phys <= SEGMENT_HEADER_BYTES  # (an empty log: its first header)
        return None if empty else self.epochs.diverging(self.store.max_phys_offset,
                                                        last_epoch, from_phys)

    def _check(self, epoch: int) -> None:
        if self.deposed or epoch != self.rs.epoch:
            raise NotLeaderError(f"shard-{self.rs.shard}: {self.name} leads epoch "
                                 f"{self.rs.epoch}{' no more' if self.deposed else ''}, "
                                 f"not epoch {epoch}")

    def wake(self) -> None:
        """New records (the store's written hook): long-polling fetches answer; alone in
        sync (a group of one), the leader confirms them at once -- also a write that
        does not wait (a Kafka-style transactional write's, made durable by its commit)."""
        with self._cond:
            if len(self.rs.in_sync) == 1:  # (alone in sync: nobody's fetch moves it)
                before = self.rs.confirmed
                self.rs.appended(self.store.max_phys_offset)
                self._moved(before)
            self._data.notify_all()

    # ------------------------------------------------------------ in-sync set
    def shrink_candidates(self) -> list[str]:
        """Followers not caught up within the lag limit (to ask the controller about)."""
        now = self.clock.monotonic_ms()
        with self._cond:
            return self.rs.lagging(now)

    def in_sync(self) -> list[str]:
        with self._cond:
            return sorted(self.rs.in_sync)

    def set_in_sync(self, in_sync: set[str]) -> None:
        """The controller agreed: the in-sync set is now ``in_sync``."""
        with self._cond:
            before = self.rs.confirmed
            self.rs.set_in_sync(set(in_sync) | {self.name})
            self._moved(before)
            self._acks.notify_all()

    def depose(self) -> None:
        with self._cond:
            self.deposed = True
            self._acks.notify_all()
            self._data.notify_all()

    def status(self) -> dict:
        with self._cond:
            end = self.store.max_phys_offset
            return {"confirmed": self.rs.confirmed, "in_sync": sorted(self.rs.in_sync),
                    "lag_bytes": {r: max(0, end - f.log_end)
                                  for r, f in self.rs.followers.items()}}
