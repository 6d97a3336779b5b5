"""A follower's copying from its leader (``Follower``): one fetch at a time, applied only
while still current, cutting its log by leader epoch when the leader answers that it
diverges.  Pure Python: no Ray.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from raymq.actors.replication import parts
from raymq.storage.commitlog import SEGMENT_HEADER_BYTES
from raymq.storage.errors import RayMQError

if TYPE_CHECKING:
    from raymq.actors.replication.replica import ShardReplica

log = logging.getLogger("raymq.replica")

#: Most bytes of log one fetch carries; how long a fetch waits for new records.
FETCH_MAX_BYTES = 8 << 20
FETCH_WAIT_MS = 200


class Follower:
    """A follower's copying from the leader of assignment ``a`` (a thread, or ``step``
    driven by a test).

    A reply is applied only while this follower still copies from that leader and the
    log still ends where the fetch was asked from (Kafka's fetch state: leader, epoch,
    offset); ``stop`` takes the same lock, so once it returns nothing more of this
    follower's is written, even from a fetch still in flight."""

    def __init__(self, replica: "ShardReplica", a: Assignment, *, thread: bool = True):
        self.replica, self.a = replica, a
        self._stop = threading.Event()
        self._apply = threading.Lock()
        self._offsets_version = -1
        self._held: dict = {}  # the versions of the leader's parts this replica holds
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"raymq-{replica.name}-fetch") if thread else None

    def start(self) -> None:
        if self._thread is not None:
            self._thread.start()

    def stop(self) -> None:
        with self._apply:  # (a reply being applied finishes first; none after)
            self._stop.set()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(2.0)  # (a fetch in flight may outlive this: it applies nothing)

    def _run(self) -> None:
        r = self.replica
        while not self._stop.is_set():
            try:
                self.step(FETCH_WAIT_MS)
            except Exception as err:  # the leader gone or deposed: the heartbeat says whom next
                if not isinstance(err, RayMQError):
                    log.warning("shard-%d: %s fetching from %s: %s: %s", r.index, r.name,
                                self.a.leader, type(err).__name__, err)
                self._stop.wait(0.1)

    def step(self, wait_ms: int = 0) -> bool:
        """One fetch from the leader, applied if still current; whether it was."""
        r = self.replica
        store = r.store
        if self._stop.is_set() or store is None:
            return False
        from_phys, last_epoch = store.max_phys_offset, r.epochs.latest_epoch()
        reply = r._call(self.a.leader, "replica_fetch",
                        (r.name, self.a.epoch, from_phys, wait_ms, FETCH_MAX_BYTES,
                         self._offsets_version, self._held, last_epoch), 30.0)
        with self._apply:
            if self._stop.is_set() or r.store is not store or \
                    store.max_phys_offset != from_phys or r.epochs.latest_epoch() != last_epoch:
                return False  # (asked of a leader this replica no longer follows, or stale)
            if "diverging" in reply:
                self._truncate(*reply["diverging"])
                return True
            if "restart_at" in reply:
                self._restart_at(reply["restart_at"], reply["epochs"])
                return True
            self._take(reply)
            return True

    def _truncate(self, e: int, end: int) -> None:
        """Cut the log where it diverges from the leader's (KIP-279): one round; the next
        fetch, carrying the new latest epoch, says whether another is needed."""
        r = self.replica
        log_end = r.store.max_phys_offset
        cut = max(SEGMENT_HEADER_BYTES, r.epochs.truncation_offset(e, end, log_end))
        if cut >= log_end:
            # (nothing to cut, yet the leader does not take the position: the epochs
            # past the log end go, so the next fetch asks by an epoch the log holds)
            r.epochs.truncate_from_end(log_end)
            return
        log.warning("shard-%d: %s cuts its log from %d to %d (where it diverges from leader "
                    "%s, epoch %d)", r.index, r.name, log_end, cut, self.a.leader, e)
        r.truncate(cut)

    def _restart_at(self, base: int, epochs: list) -> None:
        """What this follower would copy next aged out on the leader: its log starts again,
        empty, at the leader's first segment (``base``), in the leader's epoch there."""
        r = self.replica
        start = base + SEGMENT_HEADER_BYTES
        log.warning("shard-%d: %s is behind leader %s's log start (%d): its log starts again "
                    "there", r.index, r.name, self.a.leader, start)
        r.restart_at(base)
        r.epochs.truncate_from_end(0)
        for e, s in epochs:
            if s <= start:
                r.epochs.assign(e, s)

    def _take(self, reply: dict) -> None:
        r = self.replica
        store = r.store
        if reply.get("log_start", 0) > store.min_phys_offset:  # the leader's retention
            store.retention.drop_below(reply["log_start"])
        if reply["data"]:
            store.append_replicated(reply["start"], reply["data"])
        end = store.max_phys_offset
        for e, s in reply["epochs"]:
            if e > r.epochs.latest_epoch() and s <= end:
                r.epochs.assign(e, s)
        r._confirmed = max(r._confirmed, min(reply["confirmed"], end))
        if reply.get("kept"):
            r._keep(reply["kept"])
        if reply["offsets"] is not None:
            store.offsets.replace(reply["offsets"])
            self._offsets_version = reply["offsets_version"]
        if reply["parts"]:
            store.flush()  # (what they cover durable here first)
            parts.install(r.directory, reply["parts"])
            self._held.update({n: p["version"] for n, p in reply["parts"].items()})
