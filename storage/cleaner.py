"""A store's retention at work: deleting the segments ``raymq.storage.retention`` gives up.
Owns the sealed segments' summaries, each queue's log start, giving back the disk blocks
of aged-out queue entries, and the disk's use.

A queue's *log start* is its first entry whose record is still in the log: entries are
in log order, so it is a binary search from the log's first segment.  It only moves up
(segments go oldest first).  The entries below it stay as positions (offsets do not
change) but their blocks are given back (``ConsumeQueue.give_back``).
"""
from __future__ import annotations

import logging
import os
import threading

import numpy as np

from raymq.storage import topics
from raymq.storage.commitlog import SEGMENT_HEADER_BYTES, CommitLog
from raymq.storage.errors import OffsetOutOfRangeError
from raymq.storage.queueindex import QueueIndex
from raymq.storage.recovery import read_checkpoint
from raymq.storage.records import (FRAME_HEADER_BYTES, REC_DTYPE, REC_HEADER_BYTES, FrameError,
                                   check_frame, frame_producer)
from raymq.storage.retention import (RetentionPolicy, SegmentSummary, Verdict, expired_prefix,
                                     summarize)

log = logging.getLogger(__name__)


class StoreRetention:
    def __init__(self, directory: str, log: CommitLog, queues: QueueIndex, covered_end: int):
        self.directory = directory
        self._log = log
        self._cq = queues
        #: what the last checkpoint covers (the store moves it): no segment past it goes
        self.covered_end = covered_end
        self._checkpoint_path = os.path.join(directory, "checkpoint")
        self._starts: dict = {}  # queue -> (the log's start then, the queue's log start)
        self._summaries: dict[int, SegmentSummary] = {}
        self._lock = threading.Lock()
        self.deleted_bytes = self.deleted_segments = 0
        #: deleted topics -> their last tombstone's offset (what was scheduled for a topic
        #: before its deletion is never delivered: ``raymq.actors.timing``)
        self.tombstones: dict[str, int] = topics.read_deleted(directory)

    # ---------------------------------------------------------- log starts
    def log_start(self, topic: str, queue_id: int) -> int:
        """The queue's first offset still readable (what lies below aged out)."""
        cq = self._cq.queues.get((topic, queue_id))
        return 0 if cq is None else self._start_of(cq)

    def _start_of(self, cq) -> int:
        first = self._log.min_offset
        cached = self._starts.get(cq)
        if cached is not None and cached[0] == first:
            return cached[1]
        start = cq.first_from(first) if first > SEGMENT_HEADER_BYTES else 0
        self._starts[cq] = (first, start)
        return start

    def first_at(self, topic: str, queue_id: int, phys: int) -> int:
        """The queue's first offset whose record is at or after log offset ``phys`` (what
        a deletion up to ``phys`` would leave of it); its end when none is."""
        cq = self._cq.queues.get((topic, queue_id))
        return 0 if cq is None else cq.first_from(phys)

    def check_readable(self, topic: str, queue_id: int, offset: int) -> None:
        """``OffsetOutOfRangeError`` (naming queue, offset and log start) when ``offset`` of
        the queue aged out."""
        start = self.log_start(topic, queue_id)
        if offset < start:
            raise OffsetOutOfRangeError(f"{topic}/{queue_id}: offset {offset} is below the "
                                        f"queue's log start {start} (aged out)")

    def offset_for_time(self, topic: str, queue_id: int, ts_ms: int) -> int:
        """The first offset of the queue whose message was stored at or after ``ts_ms``
        (Kafka's ``offsetsForTimes``), from its log start; its end when none was.  Store
        times follow the log, so it is a binary search: a record header and its frame's
        header read per step (~30 steps for a billion messages)."""
        cq = self._cq.queues.get((topic, queue_id))
        if cq is None:
            return 0
        lo, hi = self._start_of(cq), cq.count
        while lo < hi:
            mid = (lo + hi) // 2
            if self._stored_ms(int(cq.read(mid, 1)["phys"][0])) >= ts_ms:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _stored_ms(self, phys: int) -> int:
        head = np.frombuffer(self._log.read(phys, REC_HEADER_BYTES), REC_DTYPE)
        frame = phys - int(head["frame_delta"][0])
        return frame_producer(self._log.read(frame, FRAME_HEADER_BYTES), 0)[2]

    # ------------------------------------------------------------ deleting
    def summaries(self) -> list[SegmentSummary]:
        """The sealed segments' summaries, oldest first; each read once, when first asked."""
        out = []
        for _path, base, size in self._log.segments()[:-1]:  # (the sealed ones)
            end = base + size
            s = self._summaries.get(base)
            if s is None or s.end != end:
                s = self._summaries[base] = summarize(base, end, _frames(self._log, base, end))
            out.append(s)
        return out

    def plan(self, policy: RetentionPolicy, now_ms: int, *, pinned: int = 1 << 62,
             force_bytes: int = 0) -> Verdict:
        """What ``apply`` would delete, nothing deleted."""
        with self._lock:
            return self._verdict(policy, now_ms, pinned, force_bytes)

    def apply(self, policy: RetentionPolicy, now_ms: int, *, pinned: int = 1 << 62,
              force_bytes: int = 0) -> Verdict:
        """Delete the oldest segments ``policy`` gives up (``retention.expired_prefix``),
        then give back the blocks of queue entries below each queue's log start."""
        with self._lock:
            verdict = self._verdict(policy, now_ms, pinned, force_bytes)
            self._delete(verdict.count)
            return verdict

    def drop_below(self, phys: int) -> int:
        """(a follower) Delete the segments that end at or below ``phys``, the leader's log
        start (never past what a checkpoint covers here); how many."""
        with self._lock:
            limit = min(phys, self._covered())
            n = sum(1 for _p, base, size in self._log.segments()[:-1] if base + size <= limit)
            self._delete(n)
            return n

    def _covered(self) -> int:
        """What the checkpoint on disk covers (two checkpoints written at once may land out
        of order, and only the one on disk counts after a crash); under the lock."""
        return min(self.covered_end, read_checkpoint(self._checkpoint_path).offset)

    def _verdict(self, policy: RetentionPolicy, now_ms: int, pinned: int,
                 force_bytes: int) -> Verdict:
        return expired_prefix(self.summaries(), policy, now_ms, covered_end=self._covered(),
                              pinned=pinned, force=force_bytes)

    def _delete(self, n: int) -> None:
        """(under the lock) Delete the ``n`` oldest segments, then give back the blocks of
        queue entries below each queue's log start."""
        if not n:
            return
        self.deleted_bytes += self._log.delete_oldest(n)
        self.deleted_segments += n
        for base in [b for b in self._summaries if b < self._log.min_offset]:
            del self._summaries[base]
        for cq in list(self._cq.queues.values()):
            cq.give_back(self._start_of(cq))

    def forget_queues(self, topic: str) -> None:
        """The queues of ``topic`` were dropped (deleted): their log starts go."""
        self._starts = {cq: v for cq, v in self._starts.items() if cq.topic != topic}

    def deleted(self) -> dict[str, int]:
        """Deleted topics -> their tombstone's offset, for the retention policy; those whose
        old records all went with their segments are forgotten (nothing scheduled for them
        is left either: it would pin its segment)."""
        kept = {t: p for t, p in self.tombstones.items() if p >= self._log.min_offset}
        if kept != self.tombstones:
            try:
                topics.write_deleted(self.directory, kept)
            except OSError as err:  # (no room even for this file: the one on disk lists
                # more, which an open prunes again; deletion must not wait for it)
                log.warning("store %s: deleted topics not rewritten: %s", self.directory, err)
            self.tombstones = kept
        return kept

    def disk_usage(self) -> tuple[float, int]:
        """(the used fraction of the store's filesystem, the bytes free there)."""
        st = os.statvfs(self.directory)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        free = st.f_bavail * st.f_frsize  # (what an unprivileged writer may still use)
        # df's "Use%": of what writers can use, the part used (reserved blocks left out)
        return (used / (used + free) if used + free else 0.0), free


def _frames(log: CommitLog, base: int, end: int):
    """``(buf, pos, count)`` of each whole frame of the sealed segment ``[base, end)`` (read
    whole, once in its life: what its summary needs; a bad frame ends it)."""
    start = base + SEGMENT_HEADER_BYTES
    if end <= start:
        return
    data = log.read(start, end - start)
    pos = 0
    while pos < len(data):
        try:
            frame_len, count = check_frame(data, pos, len(data))
        except FrameError:
            return
        yield data, pos, count
        pos += frame_len
