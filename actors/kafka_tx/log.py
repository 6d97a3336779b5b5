"""A transaction coordinator's durable log: every ``TxnMetadata`` it moves to, appended
to a topic of its own store, replayed on start, and compacted into a snapshot of its
live state (``raymq.storage.snapshots``) so that a restart reads the snapshot and the
records after it: time and memory follow the transactional ids in use, not how many
transactions ever ran.  The newest record of an id wins; a DEAD record drops the id.

The disk follows them too: each compaction keeps the snapshot it replaces (``.prev``)
and deletes the log's segments wholly before that one's end, so a damaged snapshot
still has the previous one and every record after it to fall back on.
"""
from __future__ import annotations

import logging
import os
import threading

from raymq.actors.kafka_tx.state import TxnMetadata, TxnState
from raymq.storage import MessageStore, RecordBatch
from raymq.storage.commitlog import SEGMENT_HEADER_BYTES
from raymq.storage.errors import RayMQError, RequestTimeoutError
from raymq.storage.snapshots import read_snapshot, write_snapshot
from raymq.storage.store import PutStatus

log = logging.getLogger("raymq.coordinator")

TXN_LOG_TOPIC = "RMQ_SYS_TXN_LOG"
#: The log's snapshot: its live state up to an offset.
SNAPSHOT_FILE, SNAPSHOT_KIND = "txn-log.snapshot", "coordinator-txn-log"
#: The snapshot before it (what a damaged one falls back on).
PREV_SUFFIX = ".prev"
#: How long a record logged with ``append_soon`` may wait for the log's writer thread.
#: What waits goes in one put, and an id that moved several times meanwhile is written
#: once, at its newest (what a replay keeps anyway): a producer committing transactions
#: of one request back to back costs the log a record per 10 ms, not one a transaction.
SOON_MS = 10


class TxnLog:
    def __init__(self, directory: str, store_config, clock, *, compact_records: int,
                 background: bool = True):
        self.store = MessageStore(directory, store_config, clock, background=background)
        self.compact_records = compact_records
        self._snapshot_path = os.path.join(directory, SNAPSHOT_FILE)
        self._snapshot_offset = 0
        self.replayed = 0  # records read after the snapshot by ``load``
        #: ``append_soon``'s records not written yet: the newest of each id, at most one
        #: per id in use (written within ``SOON_MS``, before any later record, at close)
        self._soon: dict[str, TxnMetadata] = {}
        self._soon_cv = threading.Condition()
        self._closed = False
        self._writer: threading.Thread | None = None
        if background:
            self._writer = threading.Thread(target=self._write_soon_loop, daemon=True,
                                            name="raymq-txn-log")
            self._writer.start()

    def load(self) -> tuple[dict[str, TxnMetadata], int]:
        """(each live transactional id's metadata, the highest producer-id counter ever
        logged: ids above it were never handed out)."""
        txns, start, counter, _current = self._snapshot()
        self._snapshot_offset = start
        self.replayed, counter = self._fold(txns, start, None, counter)
        return txns, counter

    def append(self, meta: TxnMetadata, *, wait: bool = True) -> None:
        """Log ``meta``: durably before returning, unless ``wait`` is False; after what
        ``append_soon`` left (one put)."""
        with self._soon_cv:
            metas, self._soon = [*self._soon.values(), meta], {}
            res = self._put(metas)
        if wait and self.store.wait_durable(res) is not PutStatus.PUT_OK:
            raise RequestTimeoutError("the transaction log write did not reach the disk "
                                      "within flush_timeout_ms; retry")

    def append_soon(self, meta: TxnMetadata) -> None:
        """Log ``meta``, not durably, off the caller's path: the log's writer thread writes
        it within ``SOON_MS`` (``write_soon``), before any record appended after it, and
        at close; replaced, unwritten, by a newer one of its id meanwhile.  For records
        whose loss with a crash the coordinator's protocol already covers (a transaction
        of one request's COMPLETE_COMMIT: ``FastCommit.commit_batch``)."""
        with self._soon_cv:
            first = not self._soon
            self._soon.pop(meta.transactional_id, None)  # (now last: the order ids moved in)
            self._soon[meta.transactional_id] = meta
            if first:
                self._soon_cv.notify()

    def write_soon(self) -> None:
        """Write what ``append_soon`` left, in one put (the writer thread's step)."""
        with self._soon_cv:
            if self._soon:
                metas, self._soon = list(self._soon.values()), {}
                self._put(metas)

    def _write_soon_loop(self) -> None:
        while True:
            with self._soon_cv:
                self._soon_cv.wait_for(lambda: self._soon or self._closed)
                if self._closed:
                    return  # (``close`` writes what waits)
                # what comes within SOON_MS goes in the same put
                self._soon_cv.wait_for(lambda: self._closed, SOON_MS / 1000.0)
            try:
                self.write_soon()
            except Exception:  # noqa: BLE001 -- (a stopped store): the next append raises
                log.exception("%s: writing the transaction log failed", self.store.directory)

    def _put(self, metas: list[TxnMetadata]):
        return self.store.put(RecordBatch(TXN_LOG_TOPIC, 0, [m.to_json() for m in metas],
                                          keys=[m.transactional_id for m in metas]), wait=False)

    def compact(self) -> bool:
        """Fold the log into its snapshot once ``compact_records`` records follow the last
        one (only what is durable: the snapshot never runs ahead of the log).  Whether
        it did."""
        end = self.store.max_queue_offset(TXN_LOG_TOPIC, 0)
        if end - self._snapshot_offset < self.compact_records:
            return False
        self.store.make_durable()
        txns, start, counter, current = self._snapshot()
        _n, counter = self._fold(txns, start, end, counter)
        if current:  # (a damaged one is not kept as the one to fall back on)
            os.replace(self._snapshot_path, self._snapshot_path + PREV_SUFFIX)
        write_snapshot(self._snapshot_path, SNAPSHOT_KIND, end, {
            "last_counter": counter,
            "txns": [m.to_json().decode() for _t, m in sorted(txns.items())]})
        self._snapshot_offset = end
        self._give_back(start)
        return True

    def _give_back(self, kept_from: int) -> None:
        """Delete the segments wholly before log record ``kept_from`` (the previous
        snapshot's end: what a fall back on it replays), once a checkpoint covers them."""
        entry = self.store.read_cq(TXN_LOG_TOPIC, 0, kept_from, 1) if kept_from else []
        if not len(entry):
            return
        self.store.checkpoint()
        if n := self.store.retention.drop_below(int(entry["phys"][0])):
            log.info("%s: %d segments before its snapshots deleted", self.store.directory, n)

    def close(self) -> None:
        with self._soon_cv:
            self._closed = True
            self._soon_cv.notify_all()
        if self._writer is not None:
            self._writer.join()
        self.write_soon()
        self.store.close()

    def _snapshot(self) -> tuple[dict[str, TxnMetadata], int, int, bool]:
        """(live state, the offset it runs to, the producer-id counter, whether it is the
        current snapshot -- else the previous one, or none)."""
        snap = read_snapshot(self._snapshot_path, SNAPSHOT_KIND)
        current = snap is not None
        snap = snap or read_snapshot(self._snapshot_path + PREV_SUFFIX, SNAPSHOT_KIND)
        if snap is None:
            if self.store.min_phys_offset > SEGMENT_HEADER_BYTES:
                log.error("%s: no snapshot readable and the log's first segments were "
                          "deleted: transactional ids logged only there are forgotten",
                          self.store.directory)
            return {}, 0, 0, False
        offset, state = snap
        txns = {}
        for text in state["txns"]:
            meta = TxnMetadata.from_json(text.encode())
            txns[meta.transactional_id] = meta
        return txns, offset, state["last_counter"], current

    def _fold(self, txns: dict[str, TxnMetadata], start: int, end: int | None,
              counter: int) -> tuple[int, int]:
        """Apply the records from ``start`` (to ``end``) to ``txns``: (how many, the
        highest producer-id counter seen)."""
        n = 0
        for m in self.store.scan_queue(TXN_LOG_TOPIC, 0, start):
            if end is not None and m.queue_offset >= end:
                break
            n += 1
            try:
                meta = TxnMetadata.from_json(m.body)
            except RayMQError as err:  # skip-and-log, as every recovery does
                log.error("%s: skipped a log record: %s", self.store.directory, err)
                continue
            counter = max(counter, meta.producer_id >> 8)
            if meta.state is TxnState.DEAD:
                txns.pop(meta.transactional_id, None)
            else:
                txns[meta.transactional_id] = meta
        return n, counter
