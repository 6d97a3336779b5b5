"""Kafka transactional producers over RayMQ's Kafka-style transactions.  Pure Python over an
``mq`` (the SDK's ``RayMQ``): no sockets, no Ray.

A Kafka client keeps one producer id and epoch for all its transactions; RayMQ's
coordinator moves a producer's epoch on with every commit and abort.  So the listener
keeps a *session* per transactional id: the Kafka (id, epoch) it gave the client, and
RayMQ's (id, epoch) of the open transaction, with what the transaction holds (queues and
group offsets registered, the last write sequence per shard, the shards written without
an fsync).  Fencing is RayMQ's: ``InitProducerId`` asks the coordinator's
``init_producer``, which aborts the open transaction of the id and fences the instance
before (on this listener or another one).

A session is the listener's memory: after a listener restart a client's transactional
request names a session nobody holds.  It is answered ``INVALID_PRODUCER_ID_MAPPING``
(the client aborts), and an abort of an unknown session asks ``init_producer`` -- which
aborts whatever the transactional id had open -- and takes the client's ids on; nothing
of a transaction is ever committed in part.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from raymq.actors.kafka_tx.coordinator import coordinator_for
from raymq.storage import RecordBatch
from raymq.storage.errors import (ConcurrentTransactionsError, InvalidTxnStateError,
                                  ProducerFencedError, RayMQError, TransactionAbortedError)
from raymq.wire.sequences import SEQUENCE_SPACE, new_producer_id

#: Kafka's error codes of transactions.
INVALID_PRODUCER_EPOCH, INVALID_TXN_STATE, INVALID_PRODUCER_ID_MAPPING = 47, 48, 49
OUT_OF_ORDER_SEQUENCE, DUPLICATE_SEQUENCE = 45, 46
CONCURRENT_TRANSACTIONS, PRODUCER_FENCED = 51, 90
#: Batches of a partition whose offsets a resend is answered with (Kafka: 5 in flight).
KEPT_BATCHES = 5
#: Sessions kept (the least recently used dropped: its client re-inits).
MAX_SESSIONS = 100_000
#: Kafka's producer epoch is a 16-bit number; past this one a new producer id is given.
MAX_EPOCH = 32766


class TxnRefused(Exception):
    """A transactional request refused with Kafka error ``code``."""

    def __init__(self, code: int, message: str = ""):
        super().__init__(message or str(code))
        self.code = code


@dataclass
class Session:
    """One transactional id's producer, as the listener knows it."""

    tid: str
    kafka_pid: int
    kafka_epoch: int
    pid: int            # RayMQ's producer id and epoch of the open (or next) transaction
    epoch: int
    timeout_ms: int | None
    queues: set = field(default_factory=set)   # (shard, topic, queue) registered
    groups: set = field(default_factory=set)   # (shard, group) registered
    seqs: dict = field(default_factory=dict)   # shard -> the last write sequence given
    lazy: set = field(default_factory=set)     # shards written without an fsync
    unknown: str | None = None  # a write failed after it was sent: abort only
    #: (topic, queue) -> the Kafka sequence expected next, and the last batches'
    #: {base sequence: (record count, base offset)}
    kafka_seqs: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ended(self, pid: int, epoch: int) -> None:
        self.pid, self.epoch = pid, epoch
        self.queues.clear()
        self.groups.clear()
        self.seqs.clear()
        self.lazy.clear()
        self.unknown = None


class Transactions:
    """The sessions of one listener."""

    def __init__(self, mq, max_sessions: int = MAX_SESSIONS):
        self.mq = mq
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._by_pid: dict[int, str] = {}
        self._max = max_sessions
        self._lock = threading.Lock()

    # ------------------------------------------------------------ sessions
    def init(self, tid: str, timeout_ms: int | None, kafka_pid: int = -1,
             kafka_epoch: int = -1) -> Session:
        """``InitProducerId`` of a transactional id: RayMQ's coordinator aborts its open
        transaction and fences the instance before; the session goes on with the next
        Kafka epoch (a client asking with its ids, KIP-360, keeps its producer id)."""
        pid, epoch = self._ask("init_producer", tid, timeout_ms)
        with self._lock:
            old = self._sessions.get(tid)
            if old is not None:
                kafka_pid, kafka_epoch = old.kafka_pid, old.kafka_epoch
            if kafka_pid < 0 or kafka_epoch >= MAX_EPOCH:
                kafka_pid, kafka_epoch = new_producer_id(), -1
            s = Session(tid, kafka_pid, kafka_epoch + 1, pid, epoch, timeout_ms)
            self._keep(s, old)
            return s

    def session(self, tid: str, kafka_pid: int, kafka_epoch: int) -> Session:
        """The session ``tid`` the client names with its ids; ``TxnRefused`` when it is not
        this listener's (``INVALID_PRODUCER_ID_MAPPING``) or a newer instance has it
        (``PRODUCER_FENCED``)."""
        with self._lock:
            s = self._sessions.get(tid)
            if s is not None:
                self._sessions.move_to_end(tid)
        return self._checked(s, tid, kafka_pid, kafka_epoch)

    def of_producer(self, kafka_pid: int, kafka_epoch: int) -> Session:
        """The session of a transactional Produce's writer."""
        with self._lock:
            tid = self._by_pid.get(kafka_pid)
            s = self._sessions.get(tid) if tid is not None else None
        return self._checked(s, tid or "?", kafka_pid, kafka_epoch)

    def known(self, tid: str) -> Session | None:
        """The session of ``tid``, if this listener holds one (no check)."""
        with self._lock:
            return self._sessions.get(tid)

    def _checked(self, s: Session | None, tid: str, kafka_pid: int,
                 kafka_epoch: int) -> Session:
        if s is None or s.kafka_pid != kafka_pid:
            raise TxnRefused(INVALID_PRODUCER_ID_MAPPING,
                             f"transactional id {tid!r}: producer {kafka_pid} is not known "
                             f"here (init the producer again)")
        if kafka_epoch < s.kafka_epoch:
            raise TxnRefused(PRODUCER_FENCED, f"transactional id {tid!r}: epoch {kafka_epoch}"
                                              f" is fenced by epoch {s.kafka_epoch}")
        if kafka_epoch > s.kafka_epoch:
            raise TxnRefused(INVALID_PRODUCER_EPOCH, f"transactional id {tid!r}: epoch "
                                                     f"{kafka_epoch} was never given")
        return s

    def _keep(self, s: Session, old: Session | None) -> None:
        """(under the lock)"""
        if old is not None:
            self._by_pid.pop(old.kafka_pid, None)
        self._sessions[s.tid] = s
        self._sessions.move_to_end(s.tid)
        self._by_pid[s.kafka_pid] = s.tid
        while len(self._sessions) > self._max:
            _tid, gone = self._sessions.popitem(last=False)
            self._by_pid.pop(gone.kafka_pid, None)

    # --------------------------------------------------------- what it holds
    def add_queues(self, s: Session, queues: set) -> None:
        """(under ``s.lock``) Register ``queues`` [(shard, topic, queue)] in the open
        transaction (RayMQ's coordinator registers them on their shards first)."""
        new = queues - s.queues
        if new:
            self._ask("add_to_transaction", s.tid, s.pid, s.epoch, sorted(new), [])
            s.queues |= new

    def commit_offsets(self, s: Session, group: str, by_shard: dict) -> None:
        """(under ``s.lock``) A group's offsets {shard: {(topic, queue): offset}} in the
        open transaction."""
        new = {(shard, group) for shard in by_shard} - s.groups
        if new:
            self._ask("add_to_transaction", s.tid, s.pid, s.epoch, [], sorted(new))
            s.groups |= new
        calls = [self.mq.transport.begin(shard, "ktx_offsets",
                                         (s.pid, s.epoch, group, values, 0), timeout_s=30)
                 for shard, values in by_shard.items()]
        failed = None
        for call in calls:  # (every answer read: each connection goes back to its pool)
            try:
                call.result()
            except RayMQError as err:
                failed = failed or err
        if failed is not None:
            raise failed

    def begin_write(self, s: Session, shard: int, batch: RecordBatch):
        """(under ``s.lock``) A transactional write of ``batch`` to ``shard`` begun; its
        ``result()`` waits.  ``wrote`` or ``failed`` says how it ended."""
        seq = s.seqs.get(shard, 0) + 1
        lazy = len({q[0] for q in s.queues} | {g[0] for g in s.groups}) == 1
        if lazy:
            s.lazy.add(shard)
        return seq, self.mq.transport.begin(shard, "ktx_send",
                                            (batch, s.pid, s.epoch, seq, 0, not lazy),
                                            timeout_s=30)

    @staticmethod
    def wrote(s: Session, shard: int, seq: int) -> None:
        s.seqs[shard] = seq

    @staticmethod
    def failed(s: Session, err: BaseException) -> None:
        """A write sent failed: whether its shard stored it is unknown, so the transaction
        can only be aborted."""
        if s.unknown is None:
            s.unknown = f"{type(err).__name__}: {err}"

    def end(self, s: Session, commit: bool) -> None:
        """(under ``s.lock``) Commit or abort the open transaction; RayMQ's next epoch for
        the next one.  A commit after a write whose outcome is unknown aborts it and
        refuses (``INVALID_TXN_STATE``)."""
        unknown = s.unknown
        outcome = "COMMIT" if commit and unknown is None else "ABORT"
        try:
            pid, epoch = self._ask("end_transaction", s.tid, s.pid, s.epoch, outcome,
                                   dict(s.seqs), sorted(s.lazy))
        except TransactionAbortedError as err:  # (its timeout passed: aborted, fenced)
            pid, epoch = self._ask("init_producer", s.tid, s.timeout_ms)
            s.ended(pid, epoch)
            raise TxnRefused(INVALID_PRODUCER_EPOCH, str(err)) from None
        s.ended(pid, epoch)
        if commit and unknown is not None:
            raise TxnRefused(INVALID_TXN_STATE, f"transaction aborted, not committed: a "
                                                f"write's outcome was unknown ({unknown})")

    def adopt_and_abort(self, tid: str, kafka_pid: int, kafka_epoch: int,
                        timeout_ms: int | None = None) -> None:
        """An abort of a session this listener does not hold (it restarted): RayMQ's
        coordinator aborts whatever ``tid`` had open, and the session takes the client's
        ids on."""
        pid, epoch = self._ask("init_producer", tid, timeout_ms)
        with self._lock:
            self._keep(Session(tid, kafka_pid, kafka_epoch, pid, epoch, timeout_ms),
                       self._sessions.get(tid))

    def _ask(self, method: str, tid: str, *args):
        index = coordinator_for(tid, self.mq.config.num_coordinators)
        return self.mq.coordinator_transport.call(index, method, tid, *args, timeout_s=60)


def kafka_sequence(s: Session, topic: str, queue: int, base: int, count: int | None = None):
    """(under ``s.lock``) Where a transactional batch whose first Kafka sequence is
    ``base`` stands: ``None`` to write it, or the base offset it was stored at (a resend of
    one of the last batches: its first sequence, and its ``count`` when given);
    ``TxnRefused`` OUT_OF_ORDER_SEQUENCE for any other.  Never DUPLICATE_SEQUENCE: a Java
    client takes it for success, so a batch not stored would be lost.  The expected
    sequence follows the client's over 2^31 - 1 to 0."""
    expected, kept = s.kafka_seqs.get((topic, queue), (None, None))
    if expected is None or base == expected:
        return None
    stored = kept.get(base)
    if stored is not None and count in (None, stored[0]):
        return stored[1]
    raise TxnRefused(OUT_OF_ORDER_SEQUENCE, f"{topic}/{queue}: sequence {base} is neither "
                                            f"the expected {expected} nor a stored batch's")


def stored_sequence(s: Session, topic: str, queue: int, base: int, count: int,
                    offset: int) -> None:
    """(under ``s.lock``) A batch was stored at ``offset``."""
    _expected, kept = s.kafka_seqs.get((topic, queue), (None, OrderedDict()))
    kept[base] = (count, offset)
    while len(kept) > KEPT_BATCHES:
        kept.popitem(last=False)
    s.kafka_seqs[(topic, queue)] = ((base + count) % SEQUENCE_SPACE, kept)


#: Kafka's error code for each RayMQ transaction error.
TXN_ERRORS = ((ProducerFencedError, PRODUCER_FENCED),
              (TransactionAbortedError, INVALID_PRODUCER_EPOCH),
              (ConcurrentTransactionsError, CONCURRENT_TRANSACTIONS),
              (InvalidTxnStateError, INVALID_TXN_STATE))
