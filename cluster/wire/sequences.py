"""Idempotent Kafka producers over RayMQ's idempotent puts.  Pure: no sockets, no Ray.

A Kafka producer numbers its records per partition (a batch carries its first record's
sequence); a broker takes a batch only when its first sequence is the one after the last
it stored, answers a resend of a stored batch with that batch's offsets, and refuses a
batch past a gap with OUT_OF_ORDER_SEQUENCE_NUMBER (the client resends in order).  Here
each (producer id, topic, partition) is a RayMQ producer of its own (its id derived
from the three), whose put sequence is the batch's sequence after its last record: the
shard's producer table answers a resend with the first put's offsets, and the listener
keeps the sequence each partition expects next to refuse gaps.  One it does not know
(after a listener restart, or forgotten as least recent) it learns from the shard's
producer table before the batch is taken (``check``'s ``stored``): the first batch is never taken for
a resend, nor a resend for a new batch.  Put sequences never wrap: a Kafka sequence that
wrapped past 2^31 - 1 continues the put's count; a new producer epoch is a new RayMQ
producer.

As Kafka, a batch behind the expected sequence is a resend only when it is exactly one of
the last stored (its first and last sequence): the shard would answer any put at or below
its producer's last as a resend -- without storing it, and without offsets when it is no
put's -- so anything else behind is refused as out of order here, from the bounds of the
last ``KEPT_BATCHES`` batches the listener stored, and (bounds it does not know) by the
listener when the shard's answer is not one stored put of as many records.
"""
from __future__ import annotations

import hashlib
import random
import threading
from collections import OrderedDict

from raymq.storage.producers import INTERNAL_PRODUCER_BASE
from raymq.wire.records import Producer

#: ``check``'s answer to a batch past a gap.
OUT_OF_ORDER = -1
#: Kafka's sequences: 0 .. 2^31 - 1, then 0 again.
SEQUENCE_SPACE = 1 << 31
#: (producer, partition) pairs whose next sequence is remembered (least recent dropped).
REMEMBERED = 100_000
#: A producer's last batches whose bounds are remembered (Kafka: its last 5 are resends).
KEPT_BATCHES = 5


def new_producer_id() -> int:
    """A Kafka producer id nobody else holds (random 48 bits: a collision is as likely as
    two producers among ~10^7 drawing the same)."""
    return random.getrandbits(48) + 1


def raymq_producer(pid: int, epoch: int, topic: str, queue: int) -> int:
    """The RayMQ producer id of Kafka producer ``pid`` at ``epoch`` on ``topic``/``queue``
    (a client's: below the broker's own).  A new epoch numbers from 0 again (KIP-360): a
    producer of its own here."""
    digest = hashlib.blake2b(f"{pid}/{epoch}/{topic}/{queue}".encode(),
                             digest_size=8).digest()
    return (int.from_bytes(digest, "big") % (INTERNAL_PRODUCER_BASE - 1)) + 1


class Sequences:
    def __init__(self, remembered: int = REMEMBERED):
        self._next: OrderedDict[int, int] = OrderedDict()
        #: pid -> the record counts of its last batches stored, oldest first (they end at
        #: its ``_next``, one after the other; empty: their bounds are not known here)
        self._counts: dict[int, tuple[int, ...]] = {}
        self._remembered = remembered
        self._lock = threading.Lock()

    def check(self, writer: Producer, topic: str, queue: int,
              stored=None) -> tuple[int, int]:
        """``(RayMQ producer id, put sequence)`` of a batch (``(0, 0)``: not idempotent;
        sequence ``OUT_OF_ORDER``: past a gap, or behind and no stored batch's bounds).
        ``stored(pid)``: the last put sequence the shard holds of a producer (None: none),
        asked when this one is not known here.  A put at or below the last is a resend to
        the shard: its answer must be one stored put of ``writer.count`` records."""
        if writer.id < 0 or writer.base_sequence < 0:
            return 0, 0
        pid = raymq_producer(writer.id, writer.epoch, topic, queue)
        base = writer.base_sequence
        with self._lock:  # (both at once: a concurrent ``stored`` moves them together)
            expected, counts = self._next.get(pid), self._counts.get(pid, ())
        if expected is None and stored is not None:
            expected = stored(pid)
            if expected is not None:
                self.stored(pid, expected)
        if expected is not None:  # (Kafka's sequences wrap past 2^31 - 1; the put's do not)
            ahead = (base - expected) % SEQUENCE_SPACE
            if 0 < ahead < SEQUENCE_SPACE // 2:
                return pid, OUT_OF_ORDER
            base = expected - (SEQUENCE_SPACE - ahead if ahead else 0)
            if ahead and not _may_be_resend(counts, expected, base + writer.count,
                                            writer.count):
                return pid, OUT_OF_ORDER
        return pid, base + writer.count  # (the put's sequence: past its records)

    def stored(self, pid: int, sequence: int, count: int = 0) -> None:
        """A put of ``pid`` of ``count`` records up to ``sequence`` is stored (or was: a
        resend; ``count`` 0: its bounds are not known)."""
        if not pid:
            return
        with self._lock:
            last = self._next.get(pid)
            if last is None or sequence > last:
                kept = self._counts.get(pid, ()) if sequence - count == last else ()
                self._counts[pid] = (kept + (count,))[-KEPT_BATCHES:] if count else ()
                self._next[pid] = sequence
            self._next.move_to_end(pid)
            while len(self._next) > self._remembered:
                gone, _seq = self._next.popitem(last=False)
                self._counts.pop(gone, None)


def _may_be_resend(counts: tuple, expected: int, put: int, count: int) -> bool:
    """Whether a batch behind, of ``count`` records ending at put sequence ``put``, may be
    one of a producer's last stored (their ``counts``, ending at ``expected``); else it
    must not reach the shard, which would drop it as a resend, or store again records it
    holds.  Past the bounds known here the shard's answer tells."""
    if put > expected or put - count < 0:  # (reaches past the next, or before any)
        return False
    end = expected
    for n in reversed(counts):  # (newest first: each ends where the next starts)
        if end == put:
            return n == count
        if end < put:  # (it would end inside a stored batch)
            return False
        end -= n
    # older than the batches known here: past Kafka's last 5, no resend; else their
    # bounds are not known here (learned from the shard), whose answer tells
    return end >= put and len(counts) < KEPT_BATCHES
