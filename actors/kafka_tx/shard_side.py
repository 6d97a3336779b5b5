"""Kafka-style transactions on a shard (seed 002; KIP-890): which producers' transactions
are open on which queues, each queue's last stable offset (LSO) and aborted-transaction
index, the fencing of stale epochs, and the offsets a transaction commits for a group.

The coordinator registers a transaction's queues here before the producer writes to
them (``register``); a write to a queue not registered for the producer's current epoch
is refused, so a late write of a timed-out transaction never slips into the next one.
Every commit or abort ends with a control marker in each of its queues (``end``) and
the coordinator bumps the epoch, so a late marker or write of the previous transaction
is fenced.  Data records of a transaction carry ``SysFlag.TRANSACTIONAL`` and the
producer id (in the record's ``prepared_offset``); markers carry ``SysFlag.CONTROL``,
the producer id, and ``COMMIT``/``ABORT`` as body.

State is rebuilt on restart from this shard's index topic (``KTX_INDEX_TOPIC``): a
``begin`` record (the queues and where each was when registered: the LSO cannot pass
it), ``offsets`` records (a group's offsets, pending until the commit) and an ``end``
record (outcome and marker offsets), each written durably before it is answered.  The
index is folded into a snapshot of the live state (``compact``) once enough records
follow the last one, so a restart reads the snapshot and the tail.  A commit's group
offsets are saved with its producer's applied end in one atomic write: a restart applies
again exactly the commits whose offsets it lost.  A deleted topic's queues are forgotten
by a ``drop`` record put with the topic's tombstone (``drop_topic``).  ``KafkaTxns`` is
the pure state; ``KafkaTxnQueues`` does the shard's I/O for it.
"""
from __future__ import annotations

import bisect

import contextlib
import json
import logging
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from raymq.actors.groups.offsets import offset_key
from raymq.storage.faults import crash_point
from raymq.storage.snapshots import read_snapshot, write_snapshot
from raymq.storage.errors import (InvalidMessageError, InvalidTxnStateError,
                                  OutOfOrderSequenceError, ProducerFencedError,
                                  RequestTimeoutError, TransactionAbortedError)
from raymq.storage.records import Record, RecordBatch, SysFlag
from raymq.storage.store import PutStatus

log = logging.getLogger("raymq.ktx")

KTX_INDEX_TOPIC = "RMQ_SYS_KTX_INDEX"
#: The index's snapshot (``raymq.storage.snapshots``) in the shard's directory.
SNAPSHOT_FILE, SNAPSHOT_KIND = "ktx-index.snapshot", "ktx-index"
#: Store-level producer ids of Kafka-style producers: one per producer id (below the
#: broker's own, from 2**62).  Its store sequence is (epoch << SEQ_BITS) | sequence: each
#: epoch's sequences start at 1, and the table holds one entry a producer id, not one a
#: transaction.
KTX_STORE_PID_BASE = 1 << 61
SEQ_BITS = 32
MAX_SEQUENCE = (1 << SEQ_BITS) - 1
#: (a coordinator's counter of 40 bits: a trillion producer ids each, at 256 coordinators)
MAX_PRODUCER_ID = (1 << 48) - 1
MAX_EPOCH = (1 << 15) - 1
OUTCOMES = ("COMMIT", "ABORT")
#: The offsets store's key (one a producer id) of the index offset of the last ``end``
#: record of that producer whose group offsets are applied: saved in the same atomic
#: write as the offsets, so a restart re-applies exactly the commits whose offsets it lost.
APPLIED_PREFIX = "ktx-applied@"
#: The one watermark of applied ends written before the key a producer: ends up to it
#: are applied.
LEGACY_APPLIED_KEY = APPLIED_PREFIX + KTX_INDEX_TOPIC

Queue = tuple[str, int]


def _check_wait(wait_ms, max_wait_ms: int) -> None:
    if isinstance(wait_ms, bool) or not isinstance(wait_ms, int) \
            or not 0 <= wait_ms <= max_wait_ms:
        raise InvalidMessageError(f"wait_ms must be an int of 0-{max_wait_ms} ms, "
                                  f"got {wait_ms!r}")


def ktx_store_pid(producer_id: int) -> int:
    return KTX_STORE_PID_BASE + producer_id


def applied_key(producer_id: int) -> str:
    return f"{APPLIED_PREFIX}{producer_id}"


def check_producer(producer_id, epoch) -> None:
    if isinstance(producer_id, bool) or not isinstance(producer_id, int) \
            or not 0 < producer_id <= MAX_PRODUCER_ID:
        raise InvalidMessageError(f"invalid transactional producer id {producer_id!r}")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= MAX_EPOCH:
        raise InvalidMessageError(f"invalid producer epoch {epoch!r}")


def check_sequence(sequence: int) -> None:
    """A transactional write's sequence: 1..``MAX_SEQUENCE`` (per producer, epoch, shard)."""
    if not 0 < sequence <= MAX_SEQUENCE:
        raise InvalidMessageError(f"transactional sequence {sequence} is not in "
                                  f"1..{MAX_SEQUENCE}")


class AbortedRanges:
    """One producer's aborted ranges [first, last) in one queue, in offset order (its
    transactions follow each other), searched by offset."""

    __slots__ = ("_firsts", "_lasts", "_arrays")

    def __init__(self):
        self._firsts: list[int] = []
        self._lasts: list[int] = []
        self._arrays = None

    def __len__(self) -> int:
        return len(self._lasts)

    def add(self, first: int, last: int) -> None:
        self._firsts.append(first)
        self._lasts.append(last)
        self._arrays = None

    def drop_below(self, offset: int) -> int:
        """Forget the ranges that end at or below ``offset`` (what they hid aged out); how
        many."""
        k = bisect.bisect_right(self._lasts, offset)
        if k:
            del self._firsts[:k], self._lasts[:k]
            self._arrays = None
        return k

    def firsts(self) -> list[int]:
        return list(self._firsts)

    def lasts(self) -> list[int]:
        return list(self._lasts)

    def covers(self, offsets: np.ndarray) -> np.ndarray:
        """Which of ``offsets`` lie in one of the ranges (a binary search each)."""
        if self._arrays is None:
            self._arrays = (np.array(self._firsts, np.int64), np.array(self._lasts, np.int64))
        firsts, lasts = self._arrays
        i = np.searchsorted(lasts, offsets, "right")  # the first range ending after each
        inside = i < len(lasts)
        inside[inside] = firsts[i[inside]] <= offsets[inside]
        return inside


@dataclass
class OpenTxn:
    """A producer's transaction open on this shard."""

    epoch: int
    queues: dict[Queue, int] = field(default_factory=dict)    # queue -> its end at registration
    offsets: dict[str, dict[Queue, int]] = field(default_factory=dict)  # group -> offsets
    begun_ms: int = 0


class KafkaTxns:
    """The pure state: epochs, open transactions, aborted ranges.  Not thread-safe."""

    def __init__(self):
        self.epochs: dict[int, int] = {}          # producer id -> highest epoch seen
        self.open: dict[int, OpenTxn] = {}        # producer id -> its open transaction
        # queue -> producer id -> its aborted ranges [first, last) in offset order (one
        # producer's transactions follow each other: searched, not scanned)
        self._aborted: dict[Queue, dict[int, AbortedRanges]] = defaultdict(dict)
        self.ends: dict[int, tuple[int, str]] = {}  # producer id -> (fence, outcome) last
        self.seen_ms: dict[int, int] = {}  # producer id -> when it last began or ended one
        self._holding: dict[Queue, dict[int, int]] = defaultdict(dict)  # queue -> pid -> first
        self.touched: set[Queue] = set()          # queues that ever took part in one

    # ----------------------------------------------------------- checks
    def check_epoch(self, producer_id: int, epoch: int) -> None:
        known = self.epochs.get(producer_id, -1)
        if epoch < known:
            raise ProducerFencedError(f"producer {producer_id} epoch {epoch} is fenced: a newer "
                                      f"instance has epoch {known}")

    def check_send(self, producer_id: int, epoch: int, queues: set[Queue]) -> None:
        """A transactional write: the producer's current epoch, every queue registered."""
        check_producer(producer_id, epoch)
        self.check_epoch(producer_id, epoch)
        txn = self.open.get(producer_id)
        if txn is None or txn.epoch != epoch:
            raise InvalidTxnStateError(f"producer {producer_id} epoch {epoch} has no open "
                                       f"transaction here (ended or never registered)")
        missing = sorted(q for q in queues if q not in txn.queues)
        if missing:
            raise InvalidTxnStateError(f"producer {producer_id} epoch {epoch}: queue(s) "
                                       f"{', '.join(f'{t}/{q}' for t, q in missing)} not "
                                       f"registered in its transaction")

    # ------------------------------------------------------------ apply
    def apply(self, rec: dict) -> None:
        """Apply one index record (live, after it is durable, or in a replay)."""
        kind = rec["k"]
        if kind == "drop":
            self.forget_topic(rec["topic"])
            return
        pid, epoch = rec["pid"], rec["epoch"]
        if "ms" in rec:
            self.seen_ms[pid] = max(self.seen_ms.get(pid, 0), rec["ms"])
        if kind == "begin":
            self.epochs[pid] = max(self.epochs.get(pid, -1), epoch)
            txn = self.open.get(pid)
            if txn is None or txn.epoch != epoch:
                txn = self.open[pid] = OpenTxn(epoch, begun_ms=rec.get("ms", 0))
            for t, q, first in rec["queues"]:
                if (t, q) not in txn.queues:
                    txn.queues[(t, q)] = first
                    self._holding[(t, q)][pid] = first
                    self.touched.add((t, q))
            for g in rec.get("groups", ()):
                txn.offsets.setdefault(g, {})
        elif kind == "offsets":
            txn = self.open.get(pid)
            if txn is not None and txn.epoch == epoch:
                got = txn.offsets.setdefault(rec["group"], {})
                got.update({(t, q): off for t, q, off in rec["offsets"]})
        elif kind == "commit":  # a one-request transaction: never open, committed at once
            self.epochs[pid] = max(self.epochs.get(pid, -1), epoch, rec["fence"])
            self.ends[pid] = (rec["fence"], "COMMIT")
            self.touched.update((t, q) for t, q in rec["queues"])
        elif kind == "end":  # (its markers carry the epoch after it: "fence")
            fence = rec.get("fence", epoch)
            self.epochs[pid] = max(self.epochs.get(pid, -1), epoch, fence)
            txn = self.open.get(pid)
            if txn is None or txn.epoch != epoch:
                return
            self.ends[pid] = (fence, rec["outcome"])
            del self.open[pid]
            markers = {(t, q): off for t, q, off in rec["markers"]}
            for queue, first in txn.queues.items():
                self._holding[queue].pop(pid, None)
                if rec["outcome"] == "ABORT":
                    ranges = self._aborted[queue].get(pid)
                    if ranges is None:
                        ranges = self._aborted[queue][pid] = AbortedRanges()
                    ranges.add(first, markers.get(queue, 2**62))
        else:
            raise ValueError(f"unknown index record kind {kind!r}")

    def forget_topic(self, topic: str) -> None:
        """``topic`` was deleted: its queues' aborted ranges and marks go.  Created again it
        starts at offset 0, where an old range would hide the new records of a producer
        id that aborted there (a transactional id keeps its producer id across epochs).
        A queue an open transaction holds keeps its hold (the deletion refuses one)."""
        for queue in [q for q in self._aborted if q[0] == topic]:
            del self._aborted[queue]
        for queue in [q for q, held in self._holding.items() if q[0] == topic and not held]:
            del self._holding[queue]
        self.touched = {q for q in self.touched if q[0] != topic}

    # ------------------------------------------------------------ reads
    def lso(self, queue: Queue, end: int) -> int:
        """The last stable offset: the first offset of the oldest open transaction on the
        queue (registered there), else its end."""
        held = self._holding.get(queue)
        return min(min(held.values()), end) if held else end

    def visible(self, queue: Queue, headers: np.ndarray, committed: bool) -> np.ndarray:
        """Which records of ``headers`` a reader gets: never a marker; with ``committed``,
        never a record of an aborted transaction."""
        keep = (headers["flags"] & SysFlag.CONTROL) == 0
        by_pid = self._aborted.get(queue) if committed else None
        if by_pid:
            tx = np.flatnonzero((headers["flags"] & SysFlag.TRANSACTIONAL) != 0)
            pids, offs = headers["prepared_offset"][tx], headers["queue_offset"][tx]
            for pid in np.unique(pids).tolist():
                ranges = by_pid.get(pid)
                if ranges is not None:
                    mine = pids == pid
                    keep[tx[mine][ranges.covers(offs[mine])]] = False
        return keep

    def aborted_count(self) -> int:
        return sum(len(r) for by_pid in self._aborted.values() for r in by_pid.values())

    def prune_aborted(self, log_start: Callable[[Queue], int]) -> int:
        """Forget aborted ranges of records that aged out (below their queue's log start):
        the ranges a reader needs stay bounded by retention.  How many went."""
        gone = 0
        for queue in list(self._aborted):
            by_pid = self._aborted[queue]
            start = log_start(queue)
            for pid in list(by_pid):
                gone += by_pid[pid].drop_below(start)
                if not len(by_pid[pid]):
                    del by_pid[pid]
            if not by_pid:
                del self._aborted[queue]
        return gone

    # --------------------------------------------------------- snapshots
    def expire(self, now_ms: int, expiry_ms: int) -> int:
        """Forget producer ids with nothing open here and not seen for ``expiry_ms`` (their
        epochs and last ends; their aborted ranges stay, as long as the records they
        hide).  A forgotten id can write again only once its coordinator registers it, and
        its coordinator fences every id but a transactional id's current one.  How many."""
        old = [pid for pid in self.epochs if pid not in self.open
               and now_ms - self.seen_ms.get(pid, 0) > expiry_ms]
        for pid in old:
            for table in (self.epochs, self.ends, self.seen_ms):
                table.pop(pid, None)
        return len(old)

    def to_state(self) -> dict:
        """The whole state as JSON-able data (``from_state`` reads it back)."""
        return {
            "epochs": [[p, e] for p, e in self.epochs.items()],
            "ends": [[p, f, o] for p, (f, o) in self.ends.items()],
            "seen": [[p, ms] for p, ms in self.seen_ms.items()],
            "open": [[p, t.epoch, t.begun_ms, [[q[0], q[1], f] for q, f in t.queues.items()],
                      [[g, [[q[0], q[1], o] for q, o in offs.items()]]
                       for g, offs in t.offsets.items()]] for p, t in self.open.items()],
            "aborted": [[q[0], q[1], p, r.firsts(), r.lasts()]
                        for q, by_pid in self._aborted.items() for p, r in by_pid.items()],
            "touched": sorted([t, q] for t, q in self.touched)}

    @classmethod
    def from_state(cls, state: dict) -> "KafkaTxns":
        out = cls()
        out.epochs = {p: e for p, e in state["epochs"]}
        out.ends = {p: (f, o) for p, f, o in state["ends"]}
        out.seen_ms = {p: ms for p, ms in state["seen"]}
        for p, epoch, begun, queues, offsets in state["open"]:
            txn = out.open[p] = OpenTxn(epoch, begun_ms=begun)
            for t, q, first in queues:
                txn.queues[(t, q)] = first
                out._holding[(t, q)][p] = first
            txn.offsets = {g: {(t, q): o for t, q, o in offs} for g, offs in offsets}
        for t, q, p, firsts, lasts in state["aborted"]:
            ranges = out._aborted[(t, q)][p] = AbortedRanges()
            for first, last in zip(firsts, lasts):
                ranges.add(first, last)
        out.touched = {(t, q) for t, q in state["touched"]}
        return out


def encode(rec: dict) -> bytes:
    return json.dumps(rec, separators=(",", ":")).encode()


def decode(body: bytes) -> dict | None:
    """An index record, or None (logged) when it cannot be parsed."""
    try:
        rec = json.loads(body)
        if rec["k"] == "drop":
            if not isinstance(rec["topic"], str):
                raise ValueError(rec["topic"])
            return rec
        if rec["k"] not in ("begin", "offsets", "end", "commit"):
            raise ValueError(rec["k"])
        int(rec["pid"]), int(rec["epoch"])
        return rec
    except Exception as err:  # noqa: BLE001 -- skip-and-log, as the other recoveries do
        log.error("Kafka-style transaction index: skipped a record it cannot parse: %s", err)
        return None


class KeyedLocks:
    """A lock per key (a producer's, a transactional id's), held as ``with locks.of(key):``;
    a key's lock lives only while someone holds or waits for it, so the table holds the
    keys in use, not every key ever seen."""

    def __init__(self):
        self._guard = threading.Lock()
        self._locks: dict = {}  # key -> [lock, holders and waiters]

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)

    @contextlib.contextmanager
    def of(self, key):
        with self._guard:
            entry = self._locks.get(key)
            if entry is None:
                entry = self._locks[key] = [threading.Lock(), 0]
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._guard:
                entry[1] -= 1
                if not entry[1]:
                    del self._locks[key]


class KafkaTxnQueues:
    """A shard's Kafka-style transactions: ``KafkaTxns`` plus the store I/O (index
    records, markers, offsets).  ``lock`` guards the state; puts happen under it."""

    def __init__(self, store, clock, admit_group: Callable[[str], None],
                 wake: Callable[[], None], *, compact_records: int = 10_000):
        self.store = store
        self.clock = clock
        self._admit_group = admit_group  # a group whose offsets join a transaction: its quota
        self._wake = wake
        self.state = KafkaTxns()
        self.lock = threading.RLock()  # the state (short holds); producers' own locks below
        # notified when a registration or an end changes the state (writes waiting for
        # their registration look again)
        self._changed = threading.Condition(self.lock)
        # one producer's writes, registrations and markers in turn (a write checked
        # before a marker is stored before it); other producers' go on meanwhile
        self._locks = KeyedLocks()
        # producer id -> the index's end when its end began (its end record lands there
        # or later): a snapshot never passes an end whose offsets are not applied yet
        self._ending: dict[int, int] = {}
        self._snapshot_path = os.path.join(store.directory, SNAPSHOT_FILE)
        # producer ids idle this long are forgotten (as the store forgets their sequences)
        self.expiry_ms, self.compact_records = store.config.producer_expiry_ms, compact_records
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._recover()

    def _recover(self) -> None:
        """The state from the index's snapshot and the records after it; a committed end
        whose group offsets were not saved (its producer's applied key is before it) has
        them applied again, in the log's order."""
        snap = read_snapshot(self._snapshot_path, SNAPSHOT_KIND)
        self._snapshot_offset = 0 if snap is None else snap[0]
        if snap is not None:
            self.state = KafkaTxns.from_state(snap[1])
        legacy = self.store.offsets.get(LEGACY_APPLIED_KEY)  # (what older versions kept)
        redo, n = [], 0
        for m in self.store.scan_queue(KTX_INDEX_TOPIC, 0, self._snapshot_offset):
            rec = decode(m.body)
            n += 1
            if rec is None:
                continue
            if rec["k"] == "end" and rec["outcome"] == "COMMIT" and m.queue_offset > max(
                    legacy, self.store.offsets.get(applied_key(rec["pid"]))):
                txn = self.state.open.get(rec["pid"])
                if txn is not None and txn.epoch == rec["epoch"] and any(txn.offsets.values()):
                    redo.append((rec["pid"], txn.offsets, m.queue_offset))
            self.state.apply(rec)
        for args in redo:  # a commit whose offsets were not saved yet, in the log's order
            self._apply_offsets(*args)
        self.replayed = n
        if n or snap is not None:
            log.info("Kafka-style transactions: %d open, %d aborted ranges, %d index records "
                     "after the snapshot (%d commits' offsets applied again)",
                     len(self.state.open), self.state.aborted_count(), n, len(redo))

    def compact(self, *, force: bool = False) -> bool:
        """Fold the index into its snapshot once ``compact_records`` records follow the last
        one, up to the first end whose offsets may not be applied yet; forget producer ids
        idle past ``expiry_ms``, and the applied keys no restart needs any more.  Whether
        it did.  ``force``: whatever the number of records (retention: the index's
        records before its snapshot may then go)."""
        with self.lock:
            end = min([self.store.max_queue_offset(KTX_INDEX_TOPIC, 0),
                       *self._ending.values()])
        if end - self._snapshot_offset < (1 if force else self.compact_records):
            return False
        self.store.make_durable()
        snap = read_snapshot(self._snapshot_path, SNAPSHOT_KIND)
        folded = KafkaTxns() if snap is None else KafkaTxns.from_state(snap[1])
        for m in self.store.scan_queue(KTX_INDEX_TOPIC, 0, 0 if snap is None else snap[0]):
            if m.queue_offset >= end:
                break
            rec = decode(m.body)
            if rec is not None:
                folded.apply(rec)
        folded.expire(self.clock.now_ms(), self.expiry_ms)
        self.store.offsets.flush()  # (the ends it passes are never applied again)
        write_snapshot(self._snapshot_path, SNAPSHOT_KIND, end, folded.to_state())
        self._snapshot_offset = end
        # (ends before the snapshot are never replayed: their applied keys are not needed)
        self.store.offsets.delete_below(APPLIED_PREFIX, end)
        with self.lock:
            self.state.expire(self.clock.now_ms(), self.expiry_ms)
        return True

    def start(self) -> None:
        """Compact in a background thread (a round a second)."""
        self._thread = threading.Thread(target=self._loop, daemon=True, name="raymq-ktx")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.compact()
            except Exception:  # noqa: BLE001 -- the loop must live on; the log still holds all
                log.exception("Kafka-style index compaction failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _append(self, rec: dict, *, wait: bool = True) -> int:
        """Write an index record (durably unless ``wait`` is False); its queue offset."""
        res = self.store.put(RecordBatch(KTX_INDEX_TOPIC, 0, [encode(rec)]), wait=wait)
        if wait and res.status is not PutStatus.PUT_OK:
            raise RequestTimeoutError("the transaction index write did not reach the disk "
                                      "within flush_timeout_ms; retry")
        return int(res.queue_offset_array[0])

    # ------------------------------------------------------- coordinator calls
    def register(self, producer_id: int, epoch: int, queues: list[Queue],
                 groups: list[str]) -> None:
        """The coordinator adds queues (and groups) to a producer's open transaction."""
        check_producer(producer_id, epoch)
        with self._locks.of(producer_id):
            with self.lock:
                self.state.check_epoch(producer_id, epoch)
                txn = self.state.open.get(producer_id)
                if txn is not None and txn.epoch != epoch:
                    raise InvalidTxnStateError(f"producer {producer_id}: epoch {txn.epoch}'s "
                                               f"transaction is still open here; end it first")
                new = [(t, q) for t, q in dict.fromkeys(map(tuple, queues))
                       if txn is None or (t, q) not in txn.queues]
                new_groups = [g for g in groups if txn is None or g not in txn.offsets]
                if not new and not new_groups and txn is not None:
                    return
            rec = {"k": "begin", "pid": producer_id, "epoch": epoch, "ms": self.clock.now_ms(),
                   "queues": [[t, q, self.store.max_queue_offset(t, q)] for t, q in new],
                   "groups": new_groups}
            # not waited for: the fsync of the first write it allows covers it (it is
            # earlier in the log); lost with a crash before that, the shard refuses the
            # transaction's writes as unregistered, and it is aborted
            self._append(rec, wait=False)
            with self.lock:
                self.state.apply(rec)
                self._changed.notify_all()

    def end(self, producer_id: int, epoch: int, outcome: str, *, expect: int | None = None,
            decide: bool = False) -> dict:
        """Write the markers of a producer's transaction open here with ``epoch`` or an
        older one (idempotent: nothing when none is open); the producer's epochs before
        ``epoch`` are fenced from now on.  On COMMIT its groups' offsets take effect.

        ``decide`` (the transaction's only shard: a one-phase commit,
        ``raymq.actors.kafka_tx.fast_commit``): the
        answer says the outcome the transaction has here (``"outcome"``) -- an end that
        contradicts one written before is answered with that one, not refused -- and a
        COMMIT whose writes are not all here (``expect``: the producer's last sequence;
        writes not yet durable when the shard crashed) is refused with
        ``TransactionAbortedError``, nothing written."""
        check_producer(producer_id, epoch)
        if outcome not in OUTCOMES:
            raise InvalidMessageError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        with self._locks.of(producer_id):
            with self.lock:
                txn = self.state.open.get(producer_id)
                if decide:
                    decided = self._decided(producer_id, epoch, outcome, txn, expect)
                    if decided is not None:
                        return decided
                if txn is None or epoch < txn.epoch:
                    last = self.state.ends.get(producer_id) if txn is None else None
                    if last is not None and last[0] == epoch and last[1] != outcome:
                        raise InvalidTxnStateError(
                            f"producer {producer_id}: its transaction ended here with "
                            f"{last[1]} (epoch {last[0]}); a {outcome} of it is refused")
                    self.state.epochs[producer_id] = max(epoch, self.state.epochs.get(
                        producer_id, -1))
                    self._changed.notify_all()  # (a fence: a waiting write is refused)
                    # (deciding: nothing of it is here -- lost, or never written -- so
                    # nothing of it can ever be visible: aborted)
                    return {"markers": 0, "outcome": "ABORT"} if decide else {"markers": 0}
                self._ending[producer_id] = self.store.max_queue_offset(KTX_INDEX_TOPIC, 0)
            try:
                done = self._end(producer_id, epoch, outcome, txn)
                return {**done, "outcome": outcome} if decide else done
            finally:
                with self.lock:
                    del self._ending[producer_id]

    def _decided(self, producer_id: int, epoch: int, outcome: str, txn,
                 expect: int | None) -> dict | None:
        """(under the locks) A one-phase end's answer when it writes nothing: the outcome
        written before, or a COMMIT refused for writes that are missing; None: go on."""
        last = self.state.ends.get(producer_id)
        if (txn is None or epoch <= txn.epoch) and last is not None and last[0] == epoch:
            return {"markers": 0, "outcome": last[1]}  # (asked again, or by a new leader)
        if outcome != "COMMIT" or not expect:
            return None
        if txn is None:  # (nothing of it here)
            self._require_writes(producer_id, epoch - 1, expect, held=0)
        self._require_writes(producer_id, txn.epoch, expect)
        return None

    def epoch_of(self, producer_id: int) -> int:
        """The highest epoch of the producer seen here, its fences included (-1: none)."""
        check_producer(producer_id, 0)
        with self.lock:
            return self.state.epochs.get(producer_id, -1)

    def sequence_of(self, producer_id: int, epoch: int) -> int:
        """The last sequence of the producer's transactional writes at ``epoch`` stored
        here (0: none)."""
        last = self.store.last_sequence(ktx_store_pid(producer_id))
        return last & MAX_SEQUENCE if last >> SEQ_BITS == epoch else 0

    def verify(self, producer_id: int, epoch: int, expect: int) -> None:
        """Before a two-phase commit: the producer's writes at ``epoch`` up to ``expect``
        are here and durable (they were written without waiting for it), else
        ``TransactionAbortedError``."""
        check_producer(producer_id, epoch)
        self.store.make_durable()
        with self._locks.of(producer_id):
            self._require_writes(producer_id, epoch, expect)

    def _require_writes(self, producer_id: int, epoch: int, expect: int,
                        held: int | None = None) -> None:
        """``TransactionAbortedError`` unless the producer's writes at ``epoch`` up to
        sequence ``expect`` are here (``held``: the last here, when known)."""
        if held is None:
            held = self.sequence_of(producer_id, epoch)
        if held < expect:
            raise TransactionAbortedError(
                f"producer {producer_id} epoch {epoch}: write {expect} of the transaction "
                f"is not here (this shard holds up to {held}: lost with a crash before it "
                f"was durable); it cannot commit")

    def _end(self, producer_id: int, epoch: int, outcome: str, txn: OpenTxn) -> dict:
        """``end``'s markers and offsets for the open ``txn`` (under the producer's lock)."""
        queues = sorted(txn.queues)
        # one put: a marker in each queue, then the end record (all or nothing).  The
        # record names each queue's end before the put: the marker lands there or
        # later, and every record of this producer's transaction lies before it
        rec = {"k": "end", "pid": producer_id, "epoch": txn.epoch, "fence": epoch,
               "outcome": outcome, "ms": self.clock.now_ms(),
               "markers": [[t, q, self.store.max_queue_offset(t, q)] for t, q in queues]}
        res = self.store.put(RecordBatch.from_records(
            [Record(t, q, outcome.encode(), flags=int(SysFlag.CONTROL),
                    prepared_offset=producer_id) for t, q in queues] +
            [Record(KTX_INDEX_TOPIC, 0, encode(rec))]))
        if res.status is not PutStatus.PUT_OK:
            raise RequestTimeoutError("the transaction markers did not reach the disk "
                                      "within flush_timeout_ms; retry")
        crash_point("ktx.markers_durable")
        placed = res.queue_offset_array.tolist()
        index_offset = placed[-1]
        rec = {**rec, "markers": [[t, q, off] for (t, q), off in zip(queues, placed)]}
        offsets = txn.offsets
        with self.lock:
            self.state.apply(rec)
            self._changed.notify_all()
        if outcome == "COMMIT" and any(offsets.values()):
            self._apply_offsets(producer_id, offsets, index_offset)
        self._wake()
        return {"markers": len(queues)}

    def _apply_offsets(self, producer_id: int, offsets: dict[str, dict[Queue, int]],
                       index_offset: int) -> None:
        """A commit's group offsets, with the producer's applied end, in one atomic write.
        Checked when they were accepted (``add_offsets``): nothing here refuses them."""
        values = {offset_key(group, t, q): off for group, got in offsets.items()
                  for (t, q), off in got.items()}
        values[applied_key(producer_id)] = index_offset
        # not fsynced here: the end record is durable, and a restart applies again every
        # commit whose applied key is behind it (``_recover``), in the log's order
        self.store.save_offsets(values, durable=False)

    # ---------------------------------------------------------- producer calls
    def send(self, batch: RecordBatch, queues: set[Queue], producer_id: int, epoch: int,
             sequence: int, put: Callable, wait_ms: int = 0, max_wait_ms: int = 0) -> object:
        """A transactional write to ``queues`` (the batch's): checked (epoch, registration,
        sequence), stamped, stored idempotently per (producer, epoch);
        ``put(batch, store_pid, sequence)`` stores.  With ``wait_ms`` (at most
        ``max_wait_ms``), a queue not registered yet is waited for that long (the producer
        asked its coordinator to add it as it sent this); a fenced epoch is refused at once."""
        check_producer(producer_id, epoch)
        _check_wait(wait_ms, max_wait_ms)
        if wait_ms:
            self._await_registration(producer_id, epoch, queues, wait_ms / 1000)
        check_sequence(sequence)
        store_pid = ktx_store_pid(producer_id)
        with self._locks.of(producer_id):
            with self.lock:
                self.state.check_send(producer_id, epoch, queues)
            last = self.sequence_of(producer_id, epoch)
            if sequence > last + 1:
                raise OutOfOrderSequenceError(
                    f"producer {producer_id} epoch {epoch}: sequence {sequence} after {last} "
                    f"(a write between them is missing)")
            batch.flags = int(SysFlag.TRANSACTIONAL)
            batch.prepared_offsets = producer_id
            return put(batch, store_pid, (epoch << SEQ_BITS) | sequence)

    def _await_registration(self, producer_id: int, epoch: int, queues: set[Queue],
                            wait_s: float, group: str | None = None) -> None:
        """Wait up to ``wait_s`` for ``queues`` (or ``group``) to be registered for the
        producer's epoch (its coordinator adds them as the write travels)."""
        deadline = time.monotonic() + wait_s  # (a real wait, whatever clock the shard keeps)
        with self._changed:
            while True:
                try:
                    self.state.check_send(producer_id, epoch, queues)
                    if group is not None and group not in self.state.open[producer_id].offsets:
                        raise InvalidTxnStateError(group)
                    return
                except InvalidTxnStateError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return  # refused by the check the write makes next
                    self._changed.wait(left)

    def add_offsets(self, producer_id: int, epoch: int, group: str,
                    offsets: dict[Queue, int], wait_ms: int = 0,
                    max_wait_ms: int = 0) -> None:
        """A group's next offsets, committed with the producer's transaction.  Everything
        that could refuse them at the commit (the group quota) is checked here.  With
        ``wait_ms``, a group not registered yet is waited for that long (its add travels
        with these offsets)."""
        check_producer(producer_id, epoch)
        _check_wait(wait_ms, max_wait_ms)
        if wait_ms:
            self._await_registration(producer_id, epoch, set(), wait_ms / 1000, group)
        with self._locks.of(producer_id):
            with self.lock:
                self.state.check_epoch(producer_id, epoch)
                txn = self.state.open.get(producer_id)
                if txn is None or txn.epoch != epoch or group not in txn.offsets:
                    raise InvalidTxnStateError(f"producer {producer_id} epoch {epoch}: group "
                                               f"{group!r} is not registered in its "
                                               f"transaction")
            if offsets:
                self._admit_group(group)
            rec = {"k": "offsets", "pid": producer_id, "epoch": epoch, "group": group,
                   "offsets": [[t, q, off] for (t, q), off in offsets.items()]}
            self._append(rec)
            with self.lock:
                self.state.apply(rec)

    def drop_topic(self, topic: str, delete: Callable[..., bool]) -> bool:
        """``topic`` is deleted by ``delete(topic, also=records, then=...)`` (the store's
        ``delete_topic``): a ``drop`` record in its tombstone's put (all or nothing with
        it) forgets the topic's queues here, live now and in every replay and snapshot
        from then on, in the index's order (a topic created again after it keeps its
        own).  Whether the store held the topic."""
        rec = {"k": "drop", "topic": topic}

        def applied():  # (before any write of the topic is taken again: as a replay has it)
            with self.lock:
                self.state.apply(rec)
        return delete(topic, also=[Record(KTX_INDEX_TOPIC, 0, encode(rec))], then=applied)

    # ------------------------------------------------------------- reads
    def touched(self, queue: Queue) -> bool:
        """Whether the queue ever took part in a transaction (else reads skip the filter)."""
        return queue in self.state.touched

    def lso(self, queue: Queue, end: int) -> int:
        with self.lock:
            return self.state.lso(queue, end)

    def visible(self, queue: Queue, headers, committed: bool):
        with self.lock:
            return self.state.visible(queue, headers, committed)

    # ------------------------------------------------------------- views
    def retention_pins(self) -> list[tuple[str, int, int]]:
        """What retention must keep: the index from its snapshot on, and every open
        transaction's records from its first on each queue."""
        with self.lock:
            pins = [(KTX_INDEX_TOPIC, 0, self._snapshot_offset)]
            pins += [(t, q, first) for (t, q), held in self.state._holding.items()
                     for first in held.values()]
        return pins

    def status(self, now_ms: int) -> list[dict]:
        with self.lock:
            out = []
            for pid, txn in sorted(self.state.open.items()):
                out.append({"producer_id": pid, "epoch": txn.epoch,
                            "age_ms": now_ms - txn.begun_ms if txn.begun_ms else None,
                            "queues": {f"{t}/{q}": {"first": first,
                                                    "end": self.store.max_queue_offset(t, q)}
                                       for (t, q), first in sorted(txn.queues.items())},
                            "groups": sorted(txn.offsets)})
            return out


def commit_batch(txq: KafkaTxnQueues, batch: RecordBatch, queues: set[Queue],
                 producer_id: int, epoch: int, sequence: int, put: Callable):
    """A transaction of one request (the coordinator's ``commit_batch``): the batch, a
    COMMIT marker in each of its queues and the index's ``commit`` record in one put
    (``put(batch, store_pid, sequence)``): never open here, it holds no LSO, and a
    crash leaves all of it or none.  The producer's epochs up to ``epoch`` are fenced
    after it, as after an end.  A resend of one stored (its answer lost) answers
    None, nothing written again."""
    check_producer(producer_id, epoch)
    check_sequence(sequence)
    with txq._locks.of(producer_id):
        last = txq.sequence_of(producer_id, epoch)
        with txq.lock:
            if txq.state.ends.get(producer_id) == (epoch + 1, "COMMIT") \
                    and last >= sequence:
                return None
            txq.state.check_epoch(producer_id, epoch)
            if producer_id in txq.state.open:
                raise InvalidTxnStateError(
                    f"producer {producer_id}: a transaction is open here; a transaction "
                    f"of one request cannot join it")
            # (before the put: a read of a queue it touches first must skip its markers)
            txq.state.touched.update(queues)
        ordered = sorted(queues)
        rec = {"k": "commit", "pid": producer_id, "epoch": epoch, "fence": epoch + 1,
               "ms": txq.clock.now_ms(), "queues": [[t, q] for t, q in ordered]}
        if last >= sequence:  # stored, unanswered (its fsync timed out): durable now
            txq.store.make_durable()
            with txq.lock:
                txq.state.apply(rec)
            return None
        if sequence != last + 1:
            raise OutOfOrderSequenceError(
                f"producer {producer_id} epoch {epoch}: sequence {sequence} after {last}")
        batch.flags = int(SysFlag.TRANSACTIONAL)
        batch.prepared_offsets = producer_id
        res = put(batch.with_records(
            [Record(t, q, b"COMMIT", flags=int(SysFlag.CONTROL),
                    prepared_offset=producer_id) for t, q in ordered] +
            [Record(KTX_INDEX_TOPIC, 0, encode(rec))]),
            ktx_store_pid(producer_id), (epoch << SEQ_BITS) | sequence)
        if res.status is not PutStatus.PUT_OK:
            raise RequestTimeoutError("the transaction did not reach the disk within "
                                      "flush_timeout_ms; retry")
        crash_point("ktx.batch_committed")
        with txq.lock:
            txq.state.apply(rec)
            txq._changed.notify_all()
    txq._wake()
    return res
