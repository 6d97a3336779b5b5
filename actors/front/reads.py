"""Reads of one shard's queues: long-polling pulls with tag filters, lookups by key.

Sends bump a data version (``wake``); a pull that found nothing waits for it.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import numpy as np

from raymq.storage import MessageStore
from raymq.storage.clock import Clock
from raymq.actors.protocol import HALF_TOPIC, SCHEDULE_TOPIC, Prop, make_msg_id
from raymq.storage.errors import InvalidMessageError, OffsetOutOfRangeError, StorageError
from raymq.storage.records import MessageBatch, RecordSpans, StoredMessage, tags_hash


#: Most bytes of messages one pull reads from one queue (at least one message).
PULL_MAX_BYTES = 32 << 20
#: A pull asking for more waits or reads at most this much.
MAX_PULL_WAIT_MS = 60_000
MAX_PULL_MESSAGES = 100_000

log = logging.getLogger("raymq.shard")


class QueueReads:
    """Pulls and lookups over a shard's store."""

    def __init__(self, store: MessageStore, clock: Clock, metrics):
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self._new_data = threading.Condition()
        self._data_version = 0
        #: Kafka-style transactions (``KafkaTxnQueues``): LSOs and what a reader may see
        self.txns = None
        #: a replicated shard's confirmed offset (``raymq.actors.replication.replica``): records at or
        #: past it are not read yet (a failover may take them back)
        self.confirmed: Callable[[], int] | None = None
        #: (topic, queue, group) -> the log start last told of (a read below it, once)
        self._told_expired: dict[tuple, int] = {}

    def confirmed_offset(self) -> int | None:
        """The confirmed offset (None: not replicated, every record is)."""
        confirmed = self.confirmed
        return None if confirmed is None else confirmed()

    def check_confirmed(self, phys_offset) -> None:
        """A look-up by id sees what readers see: "no such message" past the confirmed
        offset."""
        confirmed = self.confirmed_offset()
        if confirmed is not None and isinstance(phys_offset, int) and phys_offset >= confirmed:
            raise InvalidMessageError(f"no such message (offset {phys_offset} is not "
                                      f"confirmed by the in-sync replicas)")

    def wake(self) -> None:
        """New data is stored: waiting pulls look again."""
        with self._new_data:
            self._data_version += 1
            self._new_data.notify_all()

    def pull(self, requests: list[tuple[str, int, int, int]], wait_ms: int,
             tags: dict[str, list[str]] | None, committed: bool = True,
             spans: bool = False, reset: str = "earliest",
             group: str | None = None) -> list[tuple]:
        """Read several queues: [(topic, qid, offset, max)] -> [(topic, qid, batch, next, end)].

        Waits up to ``wait_ms`` for new data when every queue is empty (long
        polling).  ``tags`` filters by topic: only messages whose tag is listed.
        An offset past the end is answered with the end as next offset.  Control
        markers of Kafka-style transactions are never returned (``next`` passes
        them); with ``committed`` (read_committed) a queue is read only up to its
        last stable offset, which is its ``end`` then, and records of aborted
        transactions are left out.  With ``spans`` each batch is ``RecordSpans`` (the
        records undecoded, for columnar readers; no tag filter) instead of a
        ``MessageBatch``; ``spans`` ``"kafka"`` adds to each queue's tuple its
        ``(high watermark, log start)``: its end with uncommitted transactions counted, of
        a replicated shard what the in-sync replicas confirmed (a Kafka Fetch's marks).
        """
        wait_ms = min(wait_ms, MAX_PULL_WAIT_MS)
        requests = [(t, q, o, min(n, MAX_PULL_MESSAGES)) for t, q, o, n in requests]
        deadline_ms = self.clock.monotonic_ms() + wait_ms
        while True:
            with self._new_data:
                version = self._data_version
            out, total = self._pull_once(requests, tags, committed, spans, reset, group)
            remaining_ms = deadline_ms - self.clock.monotonic_ms()
            moved = any(r[3] > req[2] for r, req in zip(out, requests))  # markers, a reset
            if total or moved or remaining_ms <= 0:
                return [o + (self._marks(o[0], o[1]),) for o in out] if spans == "kafka" \
                    else out
            with self._new_data:
                if self._data_version == version:
                    self._new_data.wait(remaining_ms / 1000.0)

    def _marks(self, topic: str, qid: int) -> tuple[int, int]:
        """A queue's (high watermark, log start)."""
        start, end = self.store.retention.log_start(topic, qid), \
            self.store.max_queue_offset(topic, qid)
        if self.confirmed is None or end <= start:
            return end, start
        confirmed = self.confirmed()
        last = self.store.read_cq(topic, qid, end - 1, 1)
        if len(last) and int(last["phys"][0]) < confirmed:
            return end, start  # (all of it confirmed: the usual case)
        # the confirmed end is near the end, or (replicas far behind) further back: windows
        # doubling backwards until one starts confirmed (a queue's records lie in log order)
        hi, lo = end, max(start, end - 4096)
        while True:
            entries = self.store.read_cq(topic, qid, lo, hi - lo)
            k = int(np.searchsorted(entries["phys"], confirmed, "left"))
            if k or lo == start:
                return lo + k, start
            hi, lo = lo, max(start, lo - 2 * (hi - lo))

    def _reset(self, topic: str, qid: int, offset: int, start: int, end: int, reset: str,
               group: str | None) -> int:
        """A read below the queue's log start: ``earliest`` goes on from the log start,
        ``latest`` from the end, ``error`` raises ``OffsetOutOfRangeError``.  The messages
        skipped are counted (per group) and told once per queue and group."""
        if reset == "error":
            raise OffsetOutOfRangeError(f"{topic}/{qid}: offset {offset} is below the queue's "
                                        f"log start {start} (aged out); auto_offset_reset is "
                                        f"'error'")
        to = start if reset == "earliest" else end
        self.metrics.inc("messages_expired_unread", start - offset, group=group or "")
        key = (topic, qid, group)
        if self._told_expired.get(key, -1) < start:
            self._told_expired[key] = start
            log.warning("%s/%d: group %s read from offset %d, below the log start %d: %d "
                        "messages aged out unread; going on from %s (%d)", topic, qid,
                        group or "-", offset, start, start - offset, reset, to)
        return to

    def _pull_once(self, requests, tags, committed: bool = True, spans: bool = False,
                   reset: str = "earliest", group: str | None = None):
        out, total = [], 0
        codes_of = {t: np.array([tags_hash(x) for x in wanted], np.int64)
                    for t, wanted in (tags or {}).items() if wanted}
        txns = self.txns
        empty = RecordSpans.empty() if spans else MessageBatch.empty()
        for topic, qid, offset, max_n in requests:
            if offset < 0:
                raise OffsetOutOfRangeError(f"negative offset {offset} for {topic}/{qid}")
            real_end = self.store.max_queue_offset(topic, qid)
            start = self.store.retention.log_start(topic, qid)
            if offset > real_end and spans == "kafka":  # (Kafka's: the client resets)
                raise OffsetOutOfRangeError(f"{topic}/{qid}: offset {offset} is past the "
                                            f"queue's end {real_end}")
            if offset < start:  # aged out: where the reader's reset policy says
                offset = self._reset(topic, qid, offset, start, real_end, reset, group)
            touched = txns is not None and txns.touched((topic, qid))
            end = txns.lso((topic, qid), real_end) if touched and committed else real_end
            if offset >= end:
                out.append((topic, qid, empty, min(offset, real_end), end))
                continue
            entries = self.store.read_cq(topic, qid, offset, min(max_n, end - offset))
            if self.confirmed is not None and len(entries):
                k = int(np.searchsorted(entries["phys"], self.confirmed(), "left"))
                if k < len(entries):  # (a queue's records lie in log order)
                    entries, end = entries[:k], offset + k
                    if not k:
                        out.append((topic, qid, empty, offset, end))
                        continue
            entries = _within_pull_bytes(entries)
            next_offset = offset + len(entries)
            wanted = tags.get(topic) if tags else None
            if wanted:
                entries = entries[np.isin(entries["tag"], codes_of[topic])]
            try:
                batch = self.store.records_at(entries)
            except (StorageError, FileNotFoundError):
                if self.store.retention.log_start(topic, qid) <= offset:
                    raise
                # (aged out while being read: the next pull goes on from the log start)
                out.append((topic, qid, empty, offset, end))
                continue
            if touched and len(batch):
                keep = txns.visible((topic, qid), batch.headers, committed)
                if not keep.all():
                    batch = batch.select(keep)
            batch = batch.compact() if spans else batch.decode()
            if wanted and len(batch):
                keep = [i for i, t in enumerate(batch.tags or [None] * len(batch)) if t in wanted]
                if len(keep) != len(batch):
                    batch = _select(batch, keep)
            total += len(batch)
            out.append((topic, qid, batch, next_offset, end))
        if total:
            self.metrics.inc("messages_out", total)
            self.metrics.inc("bytes_out", float(sum(int(batch.headers["body_len"].sum())
                                                    for _t, _q, batch, _n, _e in out)))
        return out, total

    def bounds(self, queues: list[tuple[str, int]], times: list | None,
               isolation: str | None = None) -> dict:
        """Each queue's (log start, end, first offset stored at or after its time in
        ``times`` -- the log start when that aged out, the end when none --, else -1).
        With an ``isolation`` (a Kafka ListOffsets'), the end a reader may read to: the
        high watermark, and for ``read_committed`` the last stable offset."""
        store = self.store
        return {(t, q): (store.retention.log_start(t, q), self._end(t, q, isolation),
                         store.retention.offset_for_time(t, q, int(times[i]))
                         if times is not None and times[i] is not None else -1)
                for i, (t, q) in enumerate(queues)}

    def _end(self, topic: str, qid: int, isolation: str | None) -> int:
        if isolation is None:
            return self.store.max_queue_offset(topic, qid)
        end = self._marks(topic, qid)[0]
        txns = self.txns
        if isolation == "read_committed" and txns is not None and txns.touched((topic, qid)):
            return txns.lso((topic, qid), end)
        return end

    def find_by_key(self, topic: str, key: str, max_scan: int) -> list[StoredMessage]:
        """Messages of ``topic`` with ``key``, scanning the newest ``max_scan`` of each queue
        (of a replicated shard: the confirmed ones)."""
        found = []
        confirmed = self.confirmed_offset()
        for t, qid in self.store.queues():
            if t != topic:
                continue
            end = self.store.max_queue_offset(t, qid)
            for off in range(max(0, end - max_scan), end, 1000):
                batch = self.store.read_batch(t, qid, off, 1000)
                if batch.keys:
                    found += [batch[i] for i, k in enumerate(batch.keys) if k == key]
        return found if confirmed is None else [m for m in found if m.phys_offset < confirmed]


def _within_pull_bytes(entries: np.ndarray) -> np.ndarray:
    """The first ``entries`` whose records span at most PULL_MAX_BYTES of the log (one at
    least).  An entry's size runs from its record's header to the end of its body: in a
    frame of many records that spans the frame's other headers and bodies, so sizes
    overlap and their sum says nothing; the span read does (before, a pull of records
    sent in batches got ~150 messages)."""
    if len(entries) <= 1:
        return entries
    span = np.maximum.accumulate(entries["phys"] + entries["size"]) - entries["phys"][0]
    return entries[:max(1, int(np.searchsorted(span, PULL_MAX_BYTES, "right")))]


def _select(batch: MessageBatch, keep: list[int]) -> MessageBatch:
    pick = lambda col: None if col is None else [col[i] for i in keep]  # noqa: E731
    return MessageBatch(batch.headers[keep], pick(batch.phys_offsets), pick(batch.topics),
                        pick(batch.keys), pick(batch.tags), pick(batch.properties),
                        pick(batch.bodies), pick(batch.record_headers))


def stored_message(store: MessageStore, shard: int, phys: int) -> StoredMessage:
    """The message a client names by physical offset, checked against the log: a record
    must start there (its consume-queue entry points back at it with its size), else
    ``InvalidMessageError`` "no such message" -- never a garbage record, an ``OSError``
    or a server path."""
    nope = InvalidMessageError(f"no such message: {make_msg_id(shard, phys)}"
                               if isinstance(phys, int) and not isinstance(phys, bool)
                               and 0 <= phys < 2**64 else f"no such message: offset {phys!r}")
    if isinstance(phys, bool) or not isinstance(phys, int) or not 0 <= phys < store.max_phys_offset:
        raise nope
    if phys < store.min_phys_offset:
        raise InvalidMessageError(f"message {make_msg_id(shard, phys)} expired: it aged out "
                                  f"with its segment (the shard's log starts at "
                                  f"{store.min_phys_offset})")
    try:
        m = store.get_message(phys)
        entry = store.read_cq(m.topic, m.queue_id, m.queue_offset, 1)
    except Exception:  # (whatever a wrong offset decodes into)
        raise nope from None
    if len(entry) != 1 or int(entry["phys"][0]) != phys or int(entry["size"][0]) != m.size:
        raise nope
    return m


def as_delivered(shard: int, m: StoredMessage) -> StoredMessage:
    """A stored message as its consumers get it: a delayed one (schedule topic) or a half
    shows its real topic and queue, queue offset -1 (not there yet), and its id."""
    p = m.properties
    if m.topic not in (SCHEDULE_TOPIC, HALF_TOPIC) or Prop.REAL_TOPIC not in p:
        return m
    p = {k: v for k, v in p.items() if k not in _DIVERSION_PROPS}
    p.setdefault(Prop.PRODUCER_MSG_ID, make_msg_id(shard, m.phys_offset))
    try:
        qid = int(m.properties[Prop.REAL_QID])
    except (KeyError, ValueError):
        qid = -1
    return StoredMessage(m.properties[Prop.REAL_TOPIC], qid, -1, m.phys_offset, m.size, m.flags,
                         m.born_ms, m.store_ms, m.prepared_offset, m.tag_code,
                         m.reconsume_count, m.key, m.tags, p, m.body, m.headers)


#: What a diverted copy carries for the broker only.
_DIVERSION_PROPS = frozenset((Prop.DELAY, Prop.REAL_TOPIC, Prop.REAL_QID, Prop.REAL_FLAGS,
                              Prop.TRAN_MSG, Prop.CHECK_TIMES, Prop.ORIGIN_HALF,
                              Prop.CHECK_BASE_MS, Prop.TXN_TIMEOUT_MS))
