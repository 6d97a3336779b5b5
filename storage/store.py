"""MessageStore: the commit log, its consume queues, checkpoints and offsets.

A put encodes its records into CRC-framed batches, appends them to the commit
log, indexes them in the consume queues and -- in ``sync`` flush mode -- waits
for an fsync that covers them.  Concurrent puts share fsyncs (group commit):
the first waiter flushes for everybody written so far.

On open the store scans the commit log from the last checkpoint, cuts a torn
tail, and re-indexes every record the consume queues miss.  The checkpoint
records an offset below which every consume-queue entry is durable.
"""
from __future__ import annotations

import enum
import json
import logging
import os
import re
import shutil
import struct
import threading
from typing import Sequence

import numpy as np

from raymq.storage.clock import Clock, SystemClock
from raymq.storage.commitlog import CommitLog, SegmentSealError
from raymq.storage.config import StoreConfig
from raymq.storage.consumequeue import CQ_ENTRY, ConsumeQueue
from raymq.storage.errors import (CorruptLogError, InvalidMessageError, MessageTooLargeError,
                            StorageError)
from raymq.storage.fileutil import atomic_write, fsync_dir
from raymq.storage.offsets import OffsetStore
from raymq.storage.records import (REC_DTYPE, REC_HEADER_BYTES, MessageBatch, Record, RecordBatch,
                             StoredMessage, decode_records, encode_frame, frame_headers,
                             frame_producer, record_sizes, FRAME_ATTR_LAST)
from raymq.storage.commitlog import SEGMENT_HEADER_BYTES
from raymq.storage.producers import ProducerTable

log = logging.getLogger("raymq.storage")

TOPIC_RE = re.compile(r"^[A-Za-z0-9_%|.\-]{1,127}$")
CHECKPOINT_FORMAT = "raymq-checkpoint"
_SPAN_READ_SLACK_BYTES = 256 * 1024
#: Puts of at most this many records to several queues index them record by record.
SMALL_PUT = 64
_CQ_PACK = struct.Struct("<qiq").pack  # one CQ_ENTRY
assert struct.calcsize("<qiq") == CQ_ENTRY.itemsize


def check_topic_name(topic: object) -> str:
    if not isinstance(topic, str) or not TOPIC_RE.match(topic) or topic in (".", ".."):
        raise InvalidMessageError(
            f"invalid topic name {topic!r}: use 1-127 characters of letters, digits, "
            "'_', '-', '.', '%' or '|'")
    return topic


class PutStatus(enum.Enum):
    PUT_OK = 0
    FLUSH_DISK_TIMEOUT = 1


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


class _QueueIndex:
    """Consume queues by (topic, queue id), created on first use."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.queues: dict[tuple[str, int], ConsumeQueue] = {}

    def load(self) -> None:
        for topic in sorted(os.listdir(self.root)):
            tdir = os.path.join(self.root, topic)
            if not os.path.isdir(tdir):
                continue
            for name in sorted(os.listdir(tdir)):
                if name.isdigit():
                    qid = int(name)
                    self.queues[(topic, qid)] = ConsumeQueue(os.path.join(tdir, name), topic, qid)

    def get_or_create(self, topic: str, qid: int) -> ConsumeQueue:
        cq = self.queues.get((topic, qid))
        if cq is None:
            tdir = os.path.join(self.root, topic)
            fresh_dir = not os.path.isdir(tdir)
            os.makedirs(tdir, exist_ok=True)
            cq = ConsumeQueue(os.path.join(tdir, str(qid)), topic, qid)
            fsync_dir(tdir)
            if fresh_dir:
                fsync_dir(self.root)
            self.queues[(topic, qid)] = cq
        return cq

    def close(self) -> None:
        for cq in self.queues.values():
            cq.close()
        self.queues.clear()


class MessageStore:
    """One shard's storage.  ``put`` and the read methods are thread-safe."""

    def __init__(self, directory: str, config: StoreConfig | None = None,
                 clock: Clock | None = None, *, background: bool = True):
        self.directory = directory
        self.config = config or StoreConfig()
        self.clock = clock or SystemClock()
        os.makedirs(directory, exist_ok=True)
        self._write_lock = threading.Lock()
        self._failed: BaseException | None = None
        self._valid_topics: set[str] = set()
        self._flush_cond = threading.Condition()
        self._flushing = False
        self._closed = False
        self._checkpoint_path = os.path.join(directory, "checkpoint")
        self.offsets = OffsetStore(os.path.join(directory, "offsets.json"))
        self._log = CommitLog(os.path.join(directory, "commitlog"), self.config.segment_size_bytes)
        self._cq = _QueueIndex(os.path.join(directory, "consumequeue"))
        self.recovered_records = 0
        self._recover()
        self._dispatched_end = self._log.max_offset
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        if background:
            self._flusher = threading.Thread(target=self._flush_loop, name="raymq-flush",
                                             daemon=True)
            self._flusher.start()

    # ------------------------------------------------------------ recovery
    def _read_checkpoint(self) -> int:
        try:
            with open(self._checkpoint_path, "rb") as f:
                doc = json.loads(f.read())
            if doc.get("format") != CHECKPOINT_FORMAT:
                raise ValueError("format")
            offset = int(doc["consume_queue_offset"])
            self._producers = ProducerTable.restore(doc["producers"])
            return offset
        except FileNotFoundError:
            return 0
        except (ValueError, KeyError, TypeError) as err:
            log.warning("checkpoint %s is unreadable (%s); rebuilding consume queues and "
                        "producer state from the start of the log", self._checkpoint_path, err)
            self._producers = ProducerTable()
            return 0

    def _recover(self) -> None:
        self._producers = ProducerTable()
        self._open_put_entries: dict[ConsumeQueue, list] = {}
        self._open_put_frames: list = []
        ckpt = self._read_checkpoint()
        self._cq.load()
        try:
            self._log.open(ckpt, self._replay_frame)
            if ckpt > self._log.max_offset:
                # flushed data the checkpoint covers is gone (a lost tail, pages dropped
                # after an I/O error): its producer snapshot would claim sequences the log
                # no longer holds -- the scheduler and resends would skip, resends of
                # clients be taken for duplicates.  Everything is rebuilt from the log.
                raise _RebuildNeeded(f"the checkpoint ({ckpt}) is past the end of the "
                                     f"commit log ({self._log.max_offset})")
            self._cut_open_put()
        except _RebuildNeeded as why:
            log.warning("consume queues disagree with the commit log (%s); rebuilding them", why)
            self._log.close()
            self._cq.close()
            shutil.rmtree(self._cq.root)
            self._cq = _QueueIndex(self._cq.root)
            self._log = CommitLog(self._log.directory, self.config.segment_size_bytes)
            self.recovered_records = 0
            self._producers = ProducerTable()
            self._open_put_entries, self._open_put_frames = {}, []
            self._log.open(0, self._replay_frame)
            self._cut_open_put()
        end = self._log.max_offset
        for cq in self._cq.queues.values():
            dropped = cq.truncate_past(end)
            if dropped:
                log.warning("consume queue %s: dropped %d entries past the commit log end %d",
                            cq.path, dropped, end)
        if self.recovered_records:
            log.info("store %s: re-indexed %d records past checkpoint %d",
                     self.directory, self.recovered_records, ckpt)
        self._log.sync()  # the snapshot below must cover only what is on disk
        self._write_checkpoint(self._log.max_offset, sync_queues=True,
                               producers=self._producers.snapshot())

    def _replay_frame(self, frame_phys: int, buf, pos: int, frame_len: int,
                      count: int) -> None:
        """Re-index one frame found past the checkpoint.

        The frames of one put are applied together when its LAST frame is
        seen; frames of a put whose LAST frame never made it to disk are
        cut off after the scan (``_cut_open_put``), so a put is all or nothing.
        """
        h = frame_headers(buf, pos, count)
        phys = frame_phys + h["frame_delta"].astype(np.int64)
        sizes = record_sizes(h)
        producer_id, sequence, store_ms, attrs = frame_producer(buf, pos)
        topic_at: dict[tuple[int, int], str] = {}
        pending = self._open_put_entries
        for i, (meta_off, topic_len, qid, qoff) in enumerate(zip(
                h["meta_off"].tolist(), h["topic_len"].tolist(), h["queue_id"].tolist(),
                h["queue_offset"].tolist())):
            topic = topic_at.get((meta_off, topic_len))
            if topic is None:
                topic = topic_at[(meta_off, topic_len)] = bytes(
                    buf[pos + meta_off:pos + meta_off + topic_len]).decode()
            cq = self._cq.get_or_create(topic, qid)
            if phys[i] <= cq.last_phys:
                continue
            waiting = pending.setdefault(cq, [])
            expected = cq.count + len(waiting)
            if qoff != expected:
                raise _RebuildNeeded(f"{topic}/{qid}: record at {phys[i]} has queue offset "
                                     f"{qoff}, the index expects {expected}")
            waiting.append((int(phys[i]), int(sizes[i]), int(h["tag_code"][i])))
        self._open_put_frames.append((frame_phys, producer_id, sequence, phys,
                                      h["queue_offset"].copy(), sizes, frame_phys + frame_len,
                                      store_ms))
        if attrs & FRAME_ATTR_LAST:
            for cq, entries in pending.items():
                if entries:
                    cq.append(np.array(entries, CQ_ENTRY).tobytes(), entries[-1][0])
                    self.recovered_records += len(entries)
            for (_fp, pid, seq, ph, qo, sz, end, ms) in self._open_put_frames:
                if pid:
                    self._producers.record(pid, seq, ph, qo, sz, end, ms)
            self._open_put_entries = {}
            self._open_put_frames = []

    def _cut_open_put(self) -> None:
        """A put whose last frame is missing at the end of the log: cut its frames."""
        if not self._open_put_frames:
            return
        start = self._open_put_frames[0][0]
        log.warning("store %s: the last put was cut short (%d of its frames on disk, its last "
                    "frame missing); removing it from physical offset %d", self.directory,
                    len(self._open_put_frames), start)
        self._log.truncate_to(start)
        self._open_put_frames = []
        self._open_put_entries = {}

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
        if not isinstance(batch, RecordBatch):
            if not batch:
                return PutResult(PutStatus.PUT_OK, [], [], [])
            batch = RecordBatch.from_records(batch)
        n = len(batch)
        if not n:
            return PutResult(PutStatus.PUT_OK, [], [], [])
        body_lens = self._validate(batch)
        if producer_id and (not isinstance(producer_id, int) or not 0 < producer_id < 2**63
                            or not isinstance(sequence, int) or not 0 < sequence < 2**63):
            raise InvalidMessageError(f"producer id {producer_id!r} and sequence {sequence!r} "
                                      "must be positive 63-bit integers")
        with self._write_lock:
            if self._closed:
                raise StorageError(f"store {self.directory} is closed")
            if self._failed is not None:
                raise self._stopped()
            if producer_id and self._producers.is_duplicate(producer_id, sequence):
                return self._duplicate(producer_id, sequence)
            store_ms = self.clock.now_ms()
            qoffs, groups = self._assign_queue_offsets(batch)
            # encode every frame first: a bad record fails the put before anything is written
            frames = self._encode_frames(batch, body_lens, qoffs, store_ms, producer_id, sequence)
            positions = []
            try:
                for _lo, _hi, frame in frames:
                    positions.append(self._log.append(frame))
            except BaseException as err:
                if positions:  # part of a put is on disk: stop; recovery cuts the partial put
                    self._fail(err, f"write failed after {len(positions)} of {len(frames)} "
                                    "frames of a put")
                elif isinstance(err, SegmentSealError):  # earlier puts may not be on disk
                    self._fail(err, "sealing a full commit-log segment failed")
                raise
            phys_parts, size_parts = [], []
            try:
                for (lo, hi, frame), pos in zip(frames, positions):
                    phys = frame.rel_offsets + pos
                    self._dispatch(batch, groups, lo, hi, phys, frame)
                    phys_parts.append(phys)
                    size_parts.append(frame.rec_lens)
                end = self._log.max_offset
                self._dispatched_end = end
                if producer_id:
                    self._producers.record(
                        producer_id, sequence,
                        phys_parts[0] if len(phys_parts) == 1 else np.concatenate(phys_parts),
                        qoffs,
                        size_parts[0] if len(size_parts) == 1 else np.concatenate(size_parts),
                        end, store_ms)
            except BaseException as err:
                # the put is in the log but only partly indexed (a full disk under a
                # consume queue): queue counts and producer sequences no longer match the
                # log, and a resend would be stored again.  Stop; a restart re-indexes.
                self._fail(err, "indexing a put failed after its commit-log write")
                raise
        phys_all = phys_parts[0] if len(phys_parts) == 1 else np.concatenate(phys_parts)
        sizes = size_parts[0] if len(size_parts) == 1 else np.concatenate(size_parts)
        result = PutResult(PutStatus.PUT_OK, phys_all, qoffs, sizes, end_offset=end)
        if wait:
            result.status = self.wait_durable(result)
        return result

    def wait_durable(self, result: PutResult) -> PutStatus:
        """Wait until a put is durable under the flush mode; its final status."""
        if result.duplicate:  # its first copy's fsync was waited for already
            return result.status
        if self.config.flush_mode == "sync" and not self._wait_flushed(result.end_offset):
            return PutStatus.FLUSH_DISK_TIMEOUT
        return PutStatus.PUT_OK

    def _duplicate(self, producer_id: int, sequence: int) -> PutResult:
        cached = self._producers.cached(producer_id, sequence)
        # no longer remembered (later puts pushed it out): it lies somewhere before the end
        end = self._log.max_offset if cached is None else cached.end_offset
        self._write_lock.release()  # the original put may still be waiting for its fsync
        try:
            ok = self.config.flush_mode != "sync" or self._wait_flushed(end)
        finally:
            self._write_lock.acquire()
        status = PutStatus.PUT_OK if ok else PutStatus.FLUSH_DISK_TIMEOUT
        if cached is None:
            return PutResult(status, [], [], [], duplicate=True)
        return PutResult(status, cached.phys, cached.queue_offsets, cached.sizes,
                         duplicate=True)

    def last_sequence(self, producer_id: int) -> int:
        """The last put sequence stored for a producer (0: none)."""
        with self._write_lock:
            return self._producers.last_sequence(producer_id) or 0

    def _validate(self, batch: RecordBatch) -> np.ndarray:
        """Check what can be checked before writing; return the body lengths.

        (A body that is not bytes is caught when the frame is encoded.)
        """
        limit = self.config.max_message_bytes
        try:
            lens = np.array(list(map(len, batch.bodies)), np.int64)
        except TypeError:
            bad = next(b for b in batch.bodies if not hasattr(b, "__len__"))
            raise InvalidMessageError(f"message body must be bytes, got "
                                      f"{type(bad).__name__}") from None
        biggest = int(lens.max())
        if biggest > limit:
            raise MessageTooLargeError(f"message body of {biggest} bytes exceeds the maximum "
                                       f"of {limit} bytes (max_message_bytes)")
        topics = batch.topics
        for topic in (set(topics) if isinstance(topics, list) else (topics,)):
            if topic not in self._valid_topics:
                check_topic_name(topic)
                if len(self._valid_topics) < 100_000:
                    self._valid_topics.add(topic)
        qids = batch.queue_ids
        for qid in ((qids,) if not isinstance(qids, list) else set(qids)):
            if isinstance(qid, bool) or not isinstance(qid, int) or not 0 <= qid < 2**31:
                raise InvalidMessageError(f"invalid queue id {qid!r}")
        return lens

    def _assign_queue_offsets(self, batch: RecordBatch):
        """Queue offsets for the batch, and its per-queue index groups (None: one queue)."""
        n = len(batch)
        topics, qids = batch.topics, batch.queue_ids
        if not isinstance(topics, list) and not isinstance(qids, list):
            start = self._cq.get_or_create(topics, qids).count
            return np.arange(start, start + n, dtype=np.int64), None
        keys = list(zip(batch.column("topics"), batch.column("queue_ids")))
        ids_of = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        if len(ids_of) == 1:
            start = self._cq.get_or_create(*keys[0]).count
            return np.arange(start, start + n, dtype=np.int64), None
        if n <= SMALL_PUT:  # record by record: numpy costs more than it saves here
            next_offset, groups, qoffs = {}, {}, []
            for i, key in enumerate(keys):
                at = next_offset.get(key)
                if at is None:
                    at = self._cq.get_or_create(*key).count
                    groups[key] = []
                qoffs.append(at)
                next_offset[key] = at + 1
                groups[key].append(i)
            return np.array(qoffs, np.int64), groups
        ids = np.fromiter(map(ids_of.__getitem__, keys), np.int64, n)
        qoffs = np.empty(n, np.int64)
        groups = {}
        for key, i in ids_of.items():
            idx = np.flatnonzero(ids == i)
            start = self._cq.get_or_create(*key).count
            qoffs[idx] = np.arange(start, start + len(idx))
            groups[key] = idx
        return qoffs, groups

    def _dispatch(self, batch: RecordBatch, groups, lo: int, hi: int, phys: np.ndarray,
                  frame) -> None:
        if groups is not None and len(batch) <= SMALL_PUT:  # index groups are lists (a small put)
            phys_l, sizes, tags = phys.tolist(), frame.rec_lens.tolist(), frame.tag_codes.tolist()
            for key, idx in groups.items():
                part = [i - lo for i in idx if lo <= i < hi]
                if part:
                    self._cq.get_or_create(*key).append(
                        b"".join([_CQ_PACK(phys_l[j], sizes[j], tags[j]) for j in part]),
                        phys_l[part[-1]])
            return
        entries = np.empty(hi - lo, CQ_ENTRY)
        entries["phys"] = phys
        entries["size"] = frame.rec_lens
        entries["tag"] = frame.tag_codes
        if groups is None:
            key = (batch.topics if isinstance(batch.topics, str) else batch.topics[lo],
                   batch.queue_ids if not isinstance(batch.queue_ids, list) else batch.queue_ids[lo])
            self._cq.get_or_create(*key).append(entries.tobytes(), int(phys[-1]))
            return
        for key, idx in groups.items():
            part = idx[(idx >= lo) & (idx < hi)] - lo
            if len(part):
                self._cq.get_or_create(*key).append(entries[part].tobytes(),
                                                    int(phys[part[-1]]))

    def _encode_frames(self, batch: RecordBatch, body_lens: np.ndarray, qoffs: np.ndarray,
                       store_ms: int, producer_id: int, sequence: int):
        """The frames of a put: chunks by estimated size, split again if a frame came out
        too big (large keys or properties); only the last frame is flagged LAST."""
        limit = min(self.config.max_frame_bytes,
                    self._log.segment_size - SEGMENT_HEADER_BYTES)
        work = list(self._chunks(body_lens))
        frames = []
        i = 0
        while i < len(work):
            lo, hi = work[i]
            frame = encode_frame(batch.slice(lo, hi), qoffs[lo:hi], store_ms, body_lens[lo:hi],
                                 producer_id=producer_id, sequence=sequence,
                                 last=(i == len(work) - 1))
            if frame.size > limit:
                if hi - lo == 1:
                    raise MessageTooLargeError(f"a record of {frame.size} bytes cannot fit a "
                                               f"frame of at most {limit} bytes")
                mid = (lo + hi) // 2
                work[i:i + 1] = [(lo, mid), (mid, hi)]
                continue
            frames.append((lo, hi, frame))
            i += 1
        return frames

    def _chunks(self, body_lens: np.ndarray):
        """Index ranges whose frames stay under max_frame_bytes."""
        budget = min(self.config.max_frame_bytes, self._log.segment_size - 64)
        n = len(body_lens)
        est = body_lens + (REC_HEADER_BYTES + 2048)
        if est.sum() <= budget:
            yield 0, n
            return
        lo, acc = 0, 0
        for i, size in enumerate(est.tolist()):
            if acc + size > budget and i > lo:
                yield lo, i
                lo, acc = i, 0
            acc += size
        yield lo, n

    # -------------------------------------------------------------- flush
    def _fail(self, err: BaseException, what: str) -> None:
        """Stop accepting writes until a restart (which recovers from the log)."""
        if self._failed is None:
            self._failed = err
            log.error("store %s: %s (%s); refusing further writes until restart",
                      self.directory, what, err)

    def _stopped(self) -> StorageError:
        return StorageError(f"store {self.directory} stopped after a failed write "
                            f"({self._failed}); restart it to recover")

    def _sync_log(self) -> int:
        """fsync the commit log.  A failed fsync stops the store: Linux may drop the pages
        it could not write and report the next fsync as a success, so nothing written
        since the last good one may be acknowledged any more."""
        try:
            return self._log.sync()
        except OSError as err:
            self._fail(err, "fsync of the commit log failed")
            raise

    def _wait_flushed(self, target: int) -> bool:
        """Group commit: return once an fsync covers ``target`` (False on timeout)."""
        deadline = self.clock.monotonic_ms() + self.config.flush_timeout_ms
        with self._flush_cond:
            while self._log.flushed_offset < target:
                if self._failed is not None:
                    raise self._stopped()
                if self._flushing:
                    remaining = deadline - self.clock.monotonic_ms()
                    if remaining <= 0:
                        return False
                    self._flush_cond.wait(remaining / 1000.0)
                    continue
                self._flushing = True
                break
            else:
                return True
        try:
            self._sync_log()
        finally:
            with self._flush_cond:
                self._flushing = False
                self._flush_cond.notify_all()
        return self._log.flushed_offset >= target and self.clock.monotonic_ms() <= deadline

    def save_offsets(self, values: dict[str, int]) -> None:
        """Save offsets that pass records (consumer positions, progress through a queue).

        What they pass is made durable first: a reader may have seen records not
        flushed yet, and a power loss must not keep an offset and lose what it
        passed (the records written next would be skipped).
        """
        self.make_durable()
        self.offsets.update(values)

    def make_durable(self) -> None:
        """Return once everything written so far is durable (group commit; nothing to do
        when it already is, as after every put in sync mode)."""
        target = self._log.max_offset
        if self._log.flushed_offset < target and not self._wait_flushed(target):
            raise StorageError(f"store {self.directory}: fsync did not complete within "
                               f"{self.config.flush_timeout_ms} ms")

    def flush(self) -> int:
        """fsync the commit log now; return the durable offset."""
        with self._flush_cond:
            while self._flushing:
                self._flush_cond.wait()
            self._flushing = True
        try:
            return self._sync_log()
        finally:
            with self._flush_cond:
                self._flushing = False
                self._flush_cond.notify_all()

    def checkpoint(self) -> int:
        """Make consume-queue entries durable and record up to where; return it."""
        with self._write_lock:
            if self._failed is not None:  # keep the last good checkpoint: a restart recovers
                return self._log.flushed_offset
            # fsync first, so that the producer snapshot covers only durable puts
            if self._log.flushed_offset < self._dispatched_end:
                self._sync_log()
            end = self._dispatched_end
            self._producers.expire(self.clock.now_ms(), self.config.producer_expiry_ms)
            producers = self._producers.snapshot()
            queues = list(self._cq.queues.values())
        for cq in queues:
            cq.sync()
        self._write_checkpoint(end, sync_queues=False, producers=producers)
        return end

    def _write_checkpoint(self, offset: int, *, sync_queues: bool,
                          producers: dict[str, list[int]]) -> None:
        if sync_queues:
            for cq in self._cq.queues.values():
                cq.sync()
        doc = {"format": CHECKPOINT_FORMAT, "version": 1, "consume_queue_offset": offset,
               "producers": producers}
        atomic_write(self._checkpoint_path, json.dumps(doc).encode())

    def _flush_loop(self) -> None:
        interval = self.config.flush_interval_ms / 1000.0
        last_ckpt = -1
        while not self._stop.wait(interval):
            try:
                if self.config.flush_mode == "async":
                    self.flush()
                if self._dispatched_end != last_ckpt:
                    last_ckpt = self.checkpoint()
            except Exception:  # the loop must not die; the next round retries
                log.exception("store %s: background flush failed", self.directory)

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

    def read_batch(self, topic: str, queue_id: int, offset: int,
                   max_messages: int = 32) -> MessageBatch:
        """Like ``read_queue``, in columns (no object per message)."""
        return self.messages_at(self.read_cq(topic, queue_id, offset, max_messages))

    def messages_at(self, entries: np.ndarray) -> MessageBatch:
        """Decode the records that consume-queue ``entries`` point to, in order.

        Records close together in the commit log are fetched with one read.
        """
        if not len(entries):
            return MessageBatch.empty()
        phys = entries["phys"]
        ends = phys + entries["size"]
        lo, hi = int(phys.min()), int(ends.max())
        span, payload = hi - lo, int(entries["size"].sum())
        if len(entries) == 1 or (hi <= self._log.segment_end(lo)
                                 and span <= 4 * payload + _SPAN_READ_SLACK_BYTES):
            buf = self._log.read(lo, span)
            return decode_records(buf, phys - lo, phys.tolist())
        mid = len(entries) // 2
        return self.messages_at(entries[:mid]).concat(self.messages_at(entries[mid:]))

    @property
    def max_phys_offset(self) -> int:
        return self._log.max_offset

    @property
    def sync_count(self) -> int:
        """Commit-log fsyncs so far (group commit makes this smaller than the puts)."""
        return self._log.sync_count

    @property
    def flushed_offset(self) -> int:
        return self._log.flushed_offset

    def segments(self) -> list[tuple[str, int, int]]:
        return self._log.segments()

    # -------------------------------------------------------------- close
    def close(self) -> None:
        if self._closed:
            return
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join()
        with self._write_lock:
            self._closed = True
            if self._failed is None:  # after a failed write the last good checkpoint stays
                self._log.sync()
                self._write_checkpoint(min(self._log.flushed_offset, self._dispatched_end),
                                       sync_queues=True, producers=self._producers.snapshot())
            self._log.close(sync=self._failed is None)
            self._cq.close()

    def __enter__(self) -> "MessageStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _RebuildNeeded(Exception):
    pass


__all__ = ["MessageStore", "PutResult", "PutStatus", "check_topic_name", "CorruptLogError"]
