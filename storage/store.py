"""MessageStore: one shard's storage, the facade over its commit log and consume queues.
Owns the put path (lock, write, index, producer table), reads, checkpoint and close.

A put encodes its records into CRC-framed batches (``putframes``), appends them
to the commit log, indexes them in the consume queues (``queueindex``) and --
in ``sync`` flush mode -- waits for an fsync that covers them; concurrent puts
share fsyncs (group commit, ``durability``).  On open the store recovers from
the last checkpoint (``recovery``).
"""
from __future__ import annotations

import enum
import os
import threading
from typing import Callable, Iterator, Sequence

import numpy as np

from raymq.storage import steps
from raymq.storage.buffers import fresh_buffer
from raymq.storage.clock import Clock, SystemClock
from raymq.storage.commitlog import SEGMENT_HEADER_BYTES, CommitLog, SegmentSealError
from raymq.storage.config import StoreConfig
from raymq.storage.consumequeue import CQ_ENTRY
from raymq.storage.durability import Durability, FlushLoop, write_checkpoint
from raymq.storage.errors import (CorruptLogError, DiskFullError, InvalidMessageError,
                                  StorageError, UnknownTopicError)
from raymq.storage.faults import crash_point
from raymq.storage.offsets import OffsetStore
from raymq.storage.putframes import PutFramer
from raymq.storage.putframes import TOPIC_RE, check_topic_name  # noqa: F401  (were defined here)
from raymq.storage.queueindex import QueueIndex
from raymq.storage import replication
from raymq.storage.recovery import RebuildNeeded, Replay, recover
from raymq.storage import topics
from raymq.storage.cleaner import StoreRetention
from raymq.storage.records import (REC_DTYPE, REC_HEADER_BYTES, MessageBatch, Record, RecordBatch,
                                   RecordSpans, StoredMessage, decode_records,
                                   record_sizes)

#: Bytes between two records' ranges read rather than skipped (one read instead of two).
_READ_GAP_BYTES = 64 * 1024


class PutStatus(enum.Enum):
    PUT_OK = 0
    FLUSH_DISK_TIMEOUT = 1
    FLUSH_SLAVE_TIMEOUT = 2     # durable here; the in-sync replicas did not all copy it in time


class PutResult:
    """Outcome of a put: status, and per record its physical offset, queue offset, size.

    Offsets are kept as numpy arrays (``*_array``); the list views are made on
    first access.
    """

    __slots__ = ("status", "phys_array", "queue_offset_array", "size_array", "_lists",
                 "duplicate", "end_offset")

    def __init__(self, status: PutStatus, phys, queue_offsets, sizes, *,
                 duplicate: bool = False, end_offset: int = 0):
        self.status = status
        self.end_offset = end_offset  # the log end after this put: durable once flushed to here
        self.duplicate = duplicate  # a resend of a put already stored; offsets are the
        # original ones when still remembered, else empty
        self.phys_array = np.asarray(phys, np.int64)
        self.queue_offset_array = np.asarray(queue_offsets, np.int64)
        self.size_array = np.asarray(sizes, np.int64)
        self._lists: dict[str, list[int]] = {}

    def _list(self, name: str) -> list[int]:
        out = self._lists.get(name)
        if out is None:
            out = self._lists[name] = getattr(self, name).tolist()
        return out

    @property
    def phys_offsets(self) -> list[int]:
        return self._list("phys_array")

    @property
    def queue_offsets(self) -> list[int]:
        return self._list("queue_offset_array")

    @property
    def sizes(self) -> list[int]:
        return self._list("size_array")

    def __len__(self) -> int:
        return len(self.phys_array)


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """The per-frame arrays of a put as one array (the one itself for a single frame)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class MessageStore:
    """One shard's storage.  ``put`` and the read methods are thread-safe."""

    def __init__(self, directory: str, config: StoreConfig | None = None,
                 clock: Clock | None = None, *, background: bool = True):
        self.directory = directory
        self.config = config or StoreConfig()
        self.clock = clock or SystemClock()
        os.makedirs(directory, exist_ok=True)
        self._write_lock = threading.Lock()
        self._closed = False
        self._deleting: dict[str, int] = {}  # topics between their tombstone and forget
        self._checkpoint_path = os.path.join(directory, "checkpoint")
        self.offsets = OffsetStore(os.path.join(directory, "offsets.json"))
        recovered = recover(
            directory,
            CommitLog(os.path.join(directory, "commitlog"), self.config.segment_size_bytes,
                      self.config.max_open_segments),
            QueueIndex(os.path.join(directory, "consumequeue"), self.config.max_open_queue_files),
            checkpoint_path=self._checkpoint_path,
            segment_size_bytes=self.config.segment_size_bytes)
        self._log = recovered.commit_log
        self._cq = recovered.queues
        self._producers = recovered.producers
        self.recovered_records = recovered.recovered_records
        self._dispatched_end = self._log.max_offset
        #: segments aged out, queues' log starts (recovery's checkpoint covers the log)
        self.retention = StoreRetention(directory, self._log, self._cq, self._log.max_offset)
        topics.settle(self)
        self._replica: Replay | None = None  # a follower's indexing of replicated frames
        self._closed_end: int | None = None  # where the log ended when the store closed
        #: a leader's wait for its in-sync replicas (``raymq.actors.replication.replica``): called with a
        #: put's end offset once it is durable here; its status, or a RayMQ error
        self.replication: Callable[[int], PutStatus] | None = None
        #: told after each put is written, before it is durable (a leader's followers
        #: copy it while the leader's fsync runs)
        self.written: Callable[[], None] | None = None
        self._framer = PutFramer(self.config, self._log.segment_size)
        self._durable = Durability(directory, self._log, self.clock,
                                   self.config.flush_timeout_ms)
        self._flusher: FlushLoop | None = None
        if background:
            self._flusher = FlushLoop(
                directory, self.config.flush_interval_ms,
                flush=self.flush if self.config.flush_mode == "async" else None,
                checkpoint=self.checkpoint, written_end=lambda: self._dispatched_end)
            self._flusher.start()

    # ---------------------------------------------------------------- put
    def put(self, batch: RecordBatch | Sequence[Record], *, producer_id: int = 0,
            sequence: int = 0, wait: bool = True) -> PutResult:
        """Append a batch durably (per flush mode); one result for the batch.

        ``wait=False`` returns once the batch is written (readable, not yet
        flushed): the caller then calls ``wait_durable(result)`` -- e.g. after
        releasing its own locks, so that other puts can share the fsync.

        With a ``producer_id`` (non-zero) and increasing ``sequence`` the put is
        idempotent: a put whose sequence is not above the producer's last one
        is not stored again and returns ``duplicate=True`` with the original
        offsets (while remembered).  Without one, a retried put stores again.
        """
        if not isinstance(batch, RecordBatch) and batch:
            batch = RecordBatch.from_records(batch)
        if not len(batch):
            return PutResult(PutStatus.PUT_OK, [], [], [])
        body_lens = self._framer.validate(batch)
        if producer_id and (not isinstance(producer_id, int) or not 0 < producer_id < 2**63
                            or not isinstance(sequence, int) or not 0 < sequence < 2**63):
            raise InvalidMessageError(f"producer id {producer_id!r} and sequence {sequence!r} "
                                      "must be positive 63-bit integers")
        with self._write_lock:
            if self._closed:
                raise StorageError(f"store {self.directory} is closed")
            if self._durable.failed is not None:
                raise self._durable.stopped()
            if producer_id and self._producers.is_duplicate(producer_id, sequence):
                return self._duplicate(producer_id, sequence)
            if self._deleting and not self._deleting.keys().isdisjoint(batch.column("topics")):
                raise UnknownTopicError(f"topic {sorted(self._deleting)} is being deleted")
            store_ms = self.clock.now_ms()
            qoffs, groups = self._cq.assign_offsets(batch)
            # encode every frame first: a bad record fails the put before anything is written
            frames = self._framer.encode(batch, body_lens, qoffs, store_ms, producer_id, sequence)
            positions = self._append_frames(frames)
            crash_point("put.appended")
            phys_parts, size_parts, end = self._index_frames(
                batch, groups, frames, positions, qoffs, producer_id, sequence, store_ms)
        crash_point("put.indexed")
        steps.mark("store.written")
        if self.written is not None:
            self.written()
        result = PutResult(PutStatus.PUT_OK, _joined(phys_parts), qoffs, _joined(size_parts),
                           end_offset=end)
        if wait:
            result.status = self.wait_durable(result)
        return result

    def _append_frames(self, frames) -> list[int]:
        """Write a put's frames to the commit log; their physical offsets."""
        positions = []
        try:
            for _lo, _hi, frame in frames:
                if positions:
                    crash_point("put.partly_appended")
                positions.append(self._log.append(frame))
        except DiskFullError:
            if positions:  # its first frames went in, none indexed: cut back, no harm done
                self._log.truncate_to(positions[0])
            raise
        except BaseException as err:
            if positions:  # part of a put is on disk: stop; recovery cuts the partial put
                self._durable.fail(err, f"write failed after {len(positions)} of "
                                        f"{len(frames)} frames of a put")
            elif isinstance(err, SegmentSealError):  # earlier puts may not be on disk
                self._durable.fail(err, "sealing a full commit-log segment failed")
            raise
        return positions

    def _index_frames(self, batch: RecordBatch, groups, frames, positions: list[int],
                      qoffs: np.ndarray, producer_id: int, sequence: int, store_ms: int):
        """Index a written put and note it for its producer; (phys parts, size parts, end)."""
        phys_parts, size_parts = [], []
        try:
            for (lo, hi, frame), pos in zip(frames, positions):
                phys = frame.rel_offsets + pos
                self._cq.dispatch(batch, groups, lo, hi, phys, frame)
                phys_parts.append(phys)
                size_parts.append(frame.rec_lens)
            end = self._log.max_offset
            self._dispatched_end = end
            if producer_id:
                self._producers.record(producer_id, sequence, _joined(phys_parts), qoffs,
                                       _joined(size_parts), end, store_ms)
        except BaseException as err:
            # the put is in the log but only partly indexed (a full disk under a
            # consume queue): queue counts and producer sequences no longer match the
            # log, and a resend would be stored again.  Stop; a restart re-indexes.
            self._durable.fail(err, "indexing a put failed after its commit-log write")
            raise
        return phys_parts, size_parts, end

    def wait_durable(self, result: PutResult) -> PutStatus:
        """Wait until a put is durable under the flush mode; its final status."""
        if result.duplicate:  # its first copy's fsync was waited for already
            return result.status
        return self._settled(result.end_offset)

    def _settled(self, end: int) -> PutStatus:
        """Wait until the log up to ``end`` is durable under the flush mode, and (a leader)
        held by its in-sync replicas; the status a put ending there is answered with."""
        if self.config.flush_mode == "sync" and not self._durable.wait_flushed(end):
            return PutStatus.FLUSH_DISK_TIMEOUT
        if self.replication is not None:
            return self.replication(end)
        return PutStatus.PUT_OK

    def _duplicate(self, producer_id: int, sequence: int) -> PutResult:
        cached = self._producers.cached(producer_id, sequence)
        # no longer remembered (later puts pushed it out): it lies somewhere before the end
        end = self._log.max_offset if cached is None else cached.end_offset
        # the original put may still be waiting for its fsync (or its replicas): a resend
        # waits as it does
        self._write_lock.release()
        try:
            status = self._settled(end)
        finally:
            self._write_lock.acquire()
        if cached is None:
            return PutResult(status, [], [], [], duplicate=True)
        return PutResult(status, cached.phys, cached.queue_offsets, cached.sizes,
                         duplicate=True)

    def producer_ids(self) -> list[int]:
        """The producer ids the idempotence table holds now (one entry each)."""
        with self._write_lock:
            return [int(p) for p in self._producers.snapshot()]

    def last_sequence(self, producer_id: int) -> int:
        """The last put sequence stored for a producer (0: none)."""
        with self._write_lock:
            return self._producers.last_sequence(producer_id) or 0

    # ---------------------------------------------------------- durability
    def save_offsets(self, values: dict[str, int], *, durable: bool = True) -> None:
        """Save offsets that pass records (consumer positions, progress through a queue).

        What they pass is made durable first: a reader may have seen records not
        flushed yet, and a power loss must not keep an offset and lose what it
        passed (the records written next would be skipped).
        """
        self.make_durable()
        self.offsets.update(values, durable=durable)

    def make_durable(self) -> None:
        """Return once everything written so far is durable (group commit; nothing to do
        when it already is, as after every put in sync mode)."""
        self._durable.make_durable()

    def flush(self) -> int:
        """fsync the commit log now; return the durable offset."""
        return self._durable.flush()

    def checkpoint(self) -> int:
        """Make consume-queue entries durable and record up to where; return it."""
        with self._write_lock:
            # after a failed write or consume-queue fsync the last good checkpoint stays:
            # a restart recovers from it
            if self._durable.failed is not None or self._cq.sync_failed:
                return self._log.flushed_offset
            # fsync first, so that the producer snapshot covers only durable puts
            if self._log.flushed_offset < self._dispatched_end:
                self._durable.sync_log()
            end = self._dispatched_end
            self._producers.expire(self.clock.now_ms(), self.config.producer_expiry_ms)
            producers = self._producers.snapshot()
            queues = list(self._cq.queues.values())
        write_checkpoint(self._checkpoint_path, end, queues, producers)
        self.retention.covered_end = max(self.retention.covered_end, end)
        self.offsets.flush()
        return end

    # --------------------------------------------------------------- read
    def queues(self) -> list[tuple[str, int]]:
        return sorted(self._cq.queues)

    def max_queue_offset(self, topic: str, queue_id: int) -> int:
        """Logical offset the next message of the queue will get."""
        cq = self._cq.queues.get((topic, queue_id))
        return cq.count if cq else 0

    def read_cq(self, topic: str, queue_id: int, offset: int, max_entries: int) -> np.ndarray:
        cq = self._cq.queues.get((topic, queue_id))
        if cq is None:
            return np.empty(0, CQ_ENTRY)
        return cq.read(offset, max_entries)

    def get_message(self, phys_offset: int, size: int | None = None) -> StoredMessage:
        """The message whose record header is at ``phys_offset``."""
        if size is None:
            head = np.frombuffer(self._log.read(phys_offset, REC_HEADER_BYTES), REC_DTYPE)
            size = int(record_sizes(head)[0])
        return decode_records(self._log.read(phys_offset, size), np.zeros(1, np.int64),
                              [phys_offset])[0]

    def read_queue(self, topic: str, queue_id: int, offset: int,
                   max_messages: int = 32) -> list[StoredMessage]:
        """Messages at logical offsets [offset, offset + max_messages) that exist."""
        return self.read_batch(topic, queue_id, offset, max_messages).messages()

    def scan_queue(self, topic: str, queue_id: int, start: int = 0,
                   step: int = 1000) -> Iterator[StoredMessage]:
        """Every message of a queue from ``start`` to its end at this call, in order,
        read ``step`` at a time (what recoveries replay: a system queue to its end)."""
        start = max(start, self.retention.log_start(topic, queue_id))  # (aged out: not replayed)
        for offset in range(max(0, start), self.max_queue_offset(topic, queue_id), step):
            yield from self.read_queue(topic, queue_id, offset, step)

    def read_batch(self, topic: str, queue_id: int, offset: int,
                   max_messages: int = 32) -> MessageBatch:
        """Like ``read_queue``, in columns (no object per message)."""
        return self.messages_at(self.read_cq(topic, queue_id, offset, max_messages))

    def messages_at(self, entries: np.ndarray) -> MessageBatch:
        """Decode the records that consume-queue ``entries`` point to, in order."""
        return self.records_at(entries).decode()

    def records_at(self, entries: np.ndarray) -> RecordSpans:
        """The records that consume-queue ``entries`` point to, in order, undecoded.

        Only their ranges of the log are read, into one buffer: records of one frame share
        a range, ranges closer than ``_READ_GAP_BYTES`` are read as one, and the records
        of other queues between them are not read (nor sent on by a pull).
        """
        if not len(entries):
            return RecordSpans.empty()
        phys = entries["phys"]
        starts, stops, at = _read_ranges(phys, phys + entries["size"], self._log.segment_size)
        buf = fresh_buffer(int(at[-1]))  # (a big read: in huge pages, not zeroed first)
        with memoryview(buf) as view:
            for lo, hi, pos in zip(starts.tolist(), stops.tolist(), at[:-1].tolist()):
                self._log.read(lo, hi - lo, view[pos:pos + hi - lo])
        which = np.searchsorted(starts, phys, "right") - 1
        return RecordSpans.read(buf, phys - starts[which] + at[which], phys)

    @property
    def max_phys_offset(self) -> int:
        """The log's end (a closed store: where it ended)."""
        end = self._closed_end
        return self._log.max_offset if end is None else end

    @property
    def sync_count(self) -> int:
        """Commit-log fsyncs so far (group commit makes this smaller than the puts)."""
        return self._log.sync_count

    flushed_offset = property(lambda self: self._log.flushed_offset)

    def segments(self) -> list[tuple[str, int, int]]:
        return self._log.segments()

    @property
    def min_phys_offset(self) -> int:
        """Where the log starts (its oldest segment's first frame)."""
        return self._log.min_offset

    def delete_topic(self, topic: str, also: Sequence[Record] = (), then=None) -> bool:
        """Delete ``topic`` here (``topics.delete``); whether it had queues here."""
        return topics.delete(self, topic, also, then)

    # -------------------------------------------------------- replication
    def read_frames(self, from_phys: int, max_bytes: int) -> tuple[int, bytes]:
        """A leader's whole frames from ``from_phys`` (``replication.read_frames``)."""
        return replication.read_frames(self._log, self._dispatched_end, from_phys, max_bytes)

    def append_replicated(self, phys: int, data: bytes) -> int:
        """A follower writes the leader's frames ``data`` (the first at ``phys``) at the same
        physical offsets and indexes them as recovery does; its new log end.  Frames
        are checked (CRC) before anything is written; a put whose last frame has not
        come yet is indexed when it comes."""
        frames = replication.split_frames(data)
        with self._write_lock:
            if self._closed:
                raise StorageError(f"store {self.directory} is closed")
            if self._durable.failed is not None:
                raise self._durable.stopped()
            positions = self._append_frames_at(phys, data, frames)
            if self._replica is None:
                late = self._log.min_offset > SEGMENT_HEADER_BYTES  # (segments deleted)
                self._replica = Replay(self._cq, self._producers, late_start=late,
                                       directory=self.directory)
            try:
                for (pos, length, count), at in zip(frames, positions):
                    self._replica.frame(at, data, pos, length, count)
            except RebuildNeeded as why:  # (the log is fine: a restart re-indexes it)
                self._durable.fail(why, "indexing replicated frames failed")
                raise StorageError(f"replicated frames do not match this store's queues: "
                                   f"{why}") from None
            # what is indexed (and checkpointed) ends at the last whole put: a put whose
            # last frame has not come yet is no part of it
            open_frames = self._replica.open_start
            self._dispatched_end = self._log.max_offset if open_frames is None else open_frames
            return self._log.max_offset

    @property
    def complete_end(self) -> int:
        """The end of the last whole put (a follower's log may end inside one)."""
        with self._write_lock:
            if self._replica is not None and self._replica.open_start is not None:
                return self._replica.open_start
            return self.max_phys_offset

    def _append_frames_at(self, phys: int, data: bytes, frames) -> list[int]:
        before = self._log.max_offset
        try:
            return replication.place_frames(self._log, phys, data, frames)
        except BaseException as err:  # some frames written, none indexed: stop (as a put)
            if self._log.max_offset != before or isinstance(err, SegmentSealError):
                self._durable.fail(err, "writing replicated frames failed part-way")
            raise

    # -------------------------------------------------------------- close
    def close(self) -> None:
        if self._closed:
            return
        if self._flusher is not None:
            self._flusher.stop()
        with self._write_lock:
            self._closed_end = self._log.max_offset
            self._closed = True
            try:
                # after a failed write or queue fsync the last good checkpoint stays
                if self._durable.failed is None:
                    self._log.sync()
                    self.offsets.flush()
                    if not self._cq.sync_failed:
                        write_checkpoint(self._checkpoint_path,
                                         min(self._log.flushed_offset, self._dispatched_end),
                                         self._cq.queues.values(), self._producers.snapshot())
            finally:
                try:
                    self._log.close(sync=self._durable.failed is None)
                finally:
                    self._cq.close()

    def __enter__(self) -> "MessageStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["MessageStore", "PutResult", "PutStatus", "check_topic_name", "CorruptLogError"]


def _read_ranges(phys: np.ndarray, ends: np.ndarray, segment_size: int):
    """What to read for records at ``[phys, ends)``: the union of their ranges (records
    of one frame overlap: a record's range runs from its header to the end of its body),
    gaps under ``_READ_GAP_BYTES`` read through, never across a segment (segments start
    at multiples of ``segment_size``): ``(starts, stops, at)`` in log order, ``at`` each
    range's place in one buffer and its end last."""
    order = np.argsort(phys, kind="stable")
    phys, ends = phys[order].astype(np.int64), ends[order].astype(np.int64)
    reach = np.maximum.accumulate(ends)
    new = np.ones(len(phys), bool)
    new[1:] = (phys[1:] > reach[:-1] + _READ_GAP_BYTES) | \
        (phys[1:] // segment_size != phys[:-1] // segment_size)
    first = np.flatnonzero(new)
    starts = phys[first]
    stops = np.maximum.reduceat(ends, first)
    at = np.zeros(len(first) + 1, np.int64)
    np.cumsum(stops - starts, out=at[1:])
    return starts, stops, at
