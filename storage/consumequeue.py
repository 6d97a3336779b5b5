"""Consume queues: one file of fixed 20-byte entries per (topic, queue).
Owns one queue file: its entry format, appends, reads, truncation and fsync.

Entry i is the message at logical (queue) offset i: commit-log offset (i64),
record size (i32) and tag hash (i64) -- for scheduled messages the tag hash is
the deliver time in ms, as in RocketMQ.  The files are an index: they are
written without fsync and rebuilt from the commit log past the last
checkpoint on start.  A checkpoint fsyncs them first; a failed fsync is final
(``ConsumeQueue.sync``): the queue stays dirty and no later checkpoint may
claim its entries until a restart re-indexes them.

A queue does not keep its file open: it asks the store's ``QueueFiles`` for a
descriptor under that pool's lock, for each operation.
"""
from __future__ import annotations

import logging
import os

import numpy as np

from raymq.storage.commitlog import SEGMENT_HEADER_BYTES
from raymq.storage.errors import StorageError
from raymq.storage.queuefiles import QueueFiles
from raymq.storage.records import FRAME_HEADER_BYTES, REC_HEADER_BYTES

log = logging.getLogger("raymq.storage")

CQ_ENTRY = np.dtype([("phys", "<i8"), ("size", "<i4"), ("tag", "<i8")])
CQ_ENTRY_BYTES = CQ_ENTRY.itemsize  # 20
_MIN_RECORD_PHYS = SEGMENT_HEADER_BYTES + FRAME_HEADER_BYTES  # the first record of a segment


_PAGE = 4096
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = None


def punch_hole(fd: int, offset: int, length: int) -> int:
    """Give back the disk blocks of ``[offset, offset + length)`` of ``fd``'s file, its size
    kept (Linux ``fallocate`` PUNCH_HOLE; those bytes then read as zeros).  The bytes
    freed, or 0 where the filesystem cannot."""
    global _libc
    import ctypes
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length):
        return 0
    return length


class ConsumeQueue:
    """One queue file.  One writer (``append``, ``truncate_*``: the store serialises them);
    ``read`` and ``sync`` from any thread."""

    def __init__(self, path: str, topic: str, queue_id: int, *, files: QueueFiles):
        self.path = path
        self.topic = topic
        self.queue_id = queue_id
        self.files = files
        self.open_fd: int | None = None  # kept by ``files``
        with files.lock:
            fd = files.fd(self)  # creates the file
            size = os.fstat(fd).st_size
            if size % CQ_ENTRY_BYTES:
                keep = size - size % CQ_ENTRY_BYTES
                log.warning("consume queue %s: cutting a partial entry (%d bytes) at %d",
                            path, size - keep, keep)
                os.ftruncate(fd, keep)
                size = keep
        self.count = size // CQ_ENTRY_BYTES
        self.last_phys = -1
        if self.count:
            self.last_phys = int(self.read(self.count - 1, 1)["phys"][0])
        self._changes = 0  # appends and truncations so far
        self._synced = 0   # ``_changes`` when the last good fsync began
        self.sync_error: OSError | None = None  # a failed fsync: final until a restart
        self._given_back = 0  # the entries' bytes before it have had their blocks freed

    @property
    def dirty(self) -> bool:
        """Changed since the last good fsync."""
        return self._changes != self._synced

    def append(self, entries: bytes, last_phys: int) -> None:
        files = self.files
        with files.lock:
            fd = files.fd(self)
            written = os.write(fd, entries)
            if written != len(entries):  # keep the file whole entries only
                os.ftruncate(fd, self.count * CQ_ENTRY_BYTES)
                raise OSError(f"short write to consume queue {self.path}: {written} of "
                              f"{len(entries)} bytes")
        self.count += len(entries) // CQ_ENTRY_BYTES
        self.last_phys = last_phys
        self._changes += 1

    def read(self, start: int, max_entries: int) -> np.ndarray:
        """Entries [start, start + max_entries) that exist (a copy)."""
        start = max(0, start)
        n = min(max_entries, self.count - start)
        if n <= 0:
            return np.empty(0, CQ_ENTRY)
        files = self.files
        with files.lock:
            data = os.pread(files.fd(self), n * CQ_ENTRY_BYTES, start * CQ_ENTRY_BYTES)
        return np.frombuffer(data, CQ_ENTRY, len(data) // CQ_ENTRY_BYTES)

    def first_from(self, phys: int) -> int:
        """The first entry whose record is at or after physical offset ``phys`` (entries
        are in log order; entries whose disk blocks were given back read as zeros, below
        any record): a binary search, one entry read a step; ``count`` when none is."""
        lo, hi = 0, self.count
        while lo < hi:
            mid = (lo + hi) // 2
            if int(self.read(mid, 1)["phys"][0]) >= phys:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def give_back(self, below: int) -> int:
        """Free the disk blocks of entries below ``below`` (aged out: the queue's log start),
        keeping the file's size so that offsets stay positions; the block of the last
        entry stays (what a checkpoint's check of the queue reads).  Bytes freed (0 where
        the filesystem cannot punch holes: the entries then just stay)."""
        end = min(below, self.count - 1) * CQ_ENTRY_BYTES // _PAGE * _PAGE
        begin = self._given_back
        if end <= begin:
            return 0
        with self.files.lock:
            freed = punch_hole(self.files.fd(self), begin, end - begin)
        self._given_back = end
        return freed

    def pad_to(self, count: int) -> None:
        """An empty queue whose first records aged out before a rebuild re-indexed the log:
        offsets below ``count`` are kept as a hole, its last entry a placeholder below
        every record (so that the queue's log start, and a checkpoint, see it)."""
        assert self.count == 0 and count > 0
        placeholder = np.zeros(1, CQ_ENTRY)
        placeholder["phys"], placeholder["size"] = _MIN_RECORD_PHYS, REC_HEADER_BYTES
        with self.files.lock:
            fd = self.files.fd(self)
            os.ftruncate(fd, (count - 1) * CQ_ENTRY_BYTES)
            os.pwrite(fd, placeholder.tobytes(), (count - 1) * CQ_ENTRY_BYTES)
        self.count = count
        self.last_phys = _MIN_RECORD_PHYS
        self._changes += 1

    def checkpointed_count(self, checkpoint: int) -> int:
        """How many leading entries a checkpoint at offset ``checkpoint`` vouches for.

        Entries are appended in log order, and a checkpoint fsyncs every entry of a
        record below its offset before it is written: so the entries up to the last
        plausible one whose record ends at or below ``checkpoint`` are durable.  The
        ones after it are not (zeros where a page was lost, entries of records past the
        checkpoint that may point anywhere): recovery re-indexes them from the log.
        Reads from the end, in growing chunks (one entry for a queue not written since).
        """
        hi, chunk = self.count, 1
        while hi > 0:
            lo = max(0, hi - chunk)
            e = self.read(lo, hi - lo)
            ok = ((e["phys"] >= _MIN_RECORD_PHYS) & (e["size"] >= REC_HEADER_BYTES)
                  & (e["phys"] + e["size"] <= checkpoint))
            found = np.flatnonzero(ok)
            if len(found):
                return lo + int(found[-1]) + 1
            hi, chunk = lo, min(chunk * 16, 1 << 16)
        return 0

    def truncate_past(self, log_end: int) -> int:
        """Drop entries whose record does not end within ``log_end``; return how many.
        (Entries are in log order: a binary search, one entry read a step.)"""
        if not self.count or self.last_phys < 0:
            return 0

        def ends_within(k: int) -> bool:
            e = self.read(k, 1)
            return int(e["phys"][0]) + int(e["size"][0]) <= log_end

        if ends_within(self.count - 1):
            return 0
        lo, hi = 0, self.count - 1  # entries below lo end within; the one at hi does not
        while lo < hi:
            mid = (lo + hi) // 2
            if ends_within(mid):
                lo = mid + 1
            else:
                hi = mid
        dropped = self.count - lo
        self.truncate_to(lo)
        return dropped

    def truncate_to(self, count: int) -> None:
        with self.files.lock:
            os.ftruncate(self.files.fd(self), count * CQ_ENTRY_BYTES)
        self.count = count
        self.last_phys = int(self.read(count - 1, 1)["phys"][0]) if count else -1
        self._changes += 1

    def sync(self) -> None:
        """fsync what changed since the last good fsync (thread-safe against appends:
        what is appended during the fsync stays dirty).

        A failed fsync is not retried: Linux may drop the pages it could not write and
        report the next fsync a success.  The queue stays dirty and this raises from then
        on, so no checkpoint claims its entries; a restart re-indexes them from the log.
        """
        if self.sync_error is not None:
            raise StorageError(f"consume queue {self.path}: an earlier fsync failed "
                               f"({self.sync_error}); no checkpoint until a restart")
        changes = self._changes
        if changes == self._synced:
            return
        with self.files.lock:  # a duplicate: the fsync must not hold up appends and reads
            fd = os.dup(self.files.fd(self))
        try:
            os.fsync(fd)
        except OSError as err:
            self.sync_error = err
            log.error("consume queue %s: fsync failed (%s); checkpoints stop at the last good "
                      "one until a restart re-indexes from the commit log", self.path, err)
            raise
        finally:
            os.close(fd)
        self._synced = changes

    def close(self) -> None:
        with self.files.lock:
            self.files.release(self)
