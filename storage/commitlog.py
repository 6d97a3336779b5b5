"""The commit log: one append-only, segmented file set holding every topic.
Owns segment files: their headers, appends, fsyncs, reads, the scan and torn-tail cut.

Segment files are named by their base physical offset (20 digits) and start
with a 24-byte header (magic, format version, segment size, base offset).  The
segment size on disk wins over the configured one when they differ.

The segment being written is allocated ahead of its end (``PREALLOCATE_BYTES`` at a time,
blocks that read as zeros, as RocketMQ allocates its mapped files ahead): a frame then
fills blocks the file already has, and the fsync after it writes the data, not a new
length and block map through the filesystem's journal -- on ext4 a single put's fsync
takes about 0.7 of an append's.  The space ahead goes when a segment is sealed or the log
closed; after a crash its zeros end the data the scan finds (cut quietly: a torn frame
is still cut with a warning).

A physical offset is ``base + position in file``; a frame never spans two segments, so
the space left at the end of a full segment is simply skipped (the next segment starts
at ``base + segment_size_bytes``).
"""
from __future__ import annotations

import bisect
import errno
import logging
import mmap
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from raymq.storage.errors import CorruptLogError, DiskFullError, StorageError
from raymq.storage.faults import crash_point
from raymq.storage.fileutil import fsync_dir
from raymq.storage.records import FRAME_MAGIC, EncodedFrame, FrameError, check_frame

log = logging.getLogger("raymq.storage")

SEGMENT_MAGIC = b"RMQSEG\x00\x01"
SEGMENT_VERSION = 1
SEGMENT_HEADER = struct.Struct("<8sHHIq")
SEGMENT_HEADER_BYTES = SEGMENT_HEADER.size  # 24
_FRAME_MAGIC_BYTES = struct.pack("<I", FRAME_MAGIC)
_MAX_RESYNC_CANDIDATES = 256
#: How far ahead of its end the segment being written is allocated.
PREALLOCATE_BYTES = 4 << 20
#: What a filesystem that cannot allocate ahead answers (the log then only appends).
_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_ZEROS = bytes(1 << 16)  # (what a tail is compared with, a piece at a time)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class SegmentSealError(OSError):
    """The fsync (or the next segment's creation) that seals a full segment failed."""


def segment_name(base: int) -> str:
    return f"{base:020d}.log"


@dataclass
class Segment:
    base: int
    path: str
    fd: int | None  # None while closed (a sealed segment out of the pool)
    size: int  # bytes of data, header included
    pins: int = 0  # uses of ``fd`` outside ``_fd_lock`` (an fsync): not closed meanwhile
    allocated: int = 0  # the file's length: past ``size``, space allocated ahead (zeros)

    def __post_init__(self):
        self.allocated = max(self.allocated, self.size)

    @property
    def end(self) -> int:
        return self.base + self.size


class CommitLog:
    """Not thread-safe for writers: the store serialises ``append``.

    Descriptors: the last segment (the one written) is always open; of the sealed
    ones at most ``max_open_segments`` are, least recently read closed first, and a
    read reopens its segment.  Every read and every close of a sealed segment's
    descriptor holds ``_fd_lock``, so a number is never closed (and reused) under a
    read.  Out of descriptors (EMFILE), sealed segments are closed until an open works.
    """

    def __init__(self, directory: str, segment_size_bytes: int, max_open_segments: int = 64):
        self.directory = directory
        self.segment_size = segment_size_bytes
        os.makedirs(directory, exist_ok=True)
        self._segments: list[Segment] = []
        self._bases: list[int] = []
        self.max_open_segments = max(1, max_open_segments)
        self._fd_lock = threading.Lock()
        self._open_sealed: OrderedDict[int, Segment] = OrderedDict()  # by base, LRU first
        self.flushed_offset = 0
        self.sync_count = 0  # fsyncs issued by sync(), for group-commit metrics
        self._allocate_ahead = True  # (False on a filesystem that cannot)

    # ---------------------------------------------------------------- open
    def open(self, from_offset: int,
             on_frame: Callable[[int, object, int, int, int], None]) -> None:
        """Open the segments, verify every frame at or after ``from_offset``.

        ``on_frame(frame_phys, buf, pos, frame_len, count)`` is called for each valid
        frame scanned.  A bad frame with no valid frame after it is a torn
        tail: it is cut off (and logged).  A bad frame followed by valid data
        raises ``CorruptLogError`` naming file and offset.
        """
        names = sorted(n for n in os.listdir(self.directory) if n.endswith(".log"))
        for name in names:
            path = os.path.join(self.directory, name)
            try:
                base = int(name[:-4])
            except ValueError:
                raise CorruptLogError(f"{path}: not a segment file name") from None
            self._open_segment(path, base, is_last=(name == names[-1]))
        if not self._segments:
            self._new_segment(0)
            self.flushed_offset = self.max_offset
            return
        start = _scan_start(self._segments, self._bases, from_offset)
        for i in range(start[0], len(self._segments)):
            seg = self._segments[i]
            pos = start[1] if i == start[0] else SEGMENT_HEADER_BYTES
            self._scan_segment(i, seg, pos, on_frame)
        self.flushed_offset = self.max_offset

    # ------------------------------------------------------- descriptors
    def _fd(self, seg: Segment) -> int:
        """``seg``'s descriptor, reopened if its segment is sealed and was closed.  For a
        sealed segment call it holding ``_fd_lock`` (and use the number under it)."""
        if seg.fd is not None:
            if seg.base in self._open_sealed:
                self._open_sealed.move_to_end(seg.base)
            return seg.fd
        sealed = seg is not self._segments[-1]
        if sealed:
            self._make_room(1)
        while True:
            try:
                seg.fd = os.open(seg.path, os.O_RDWR)
                break
            except OSError as err:
                if err.errno not in (errno.EMFILE, errno.ENFILE) \
                        or not self._close_least_recent():
                    raise
                log.warning("out of file descriptors opening %s: closed a sealed segment",
                            seg.path)
        if sealed:
            self._note_sealed_open(seg)
        return seg.fd

    def _make_room(self, n: int) -> None:
        """Close sealed segments until ``n`` more fit the pool (first: never over it)."""
        while len(self._open_sealed) + n > self.max_open_segments \
                and self._close_least_recent():
            pass

    def _note_sealed_open(self, seg: Segment) -> None:
        self._open_sealed[seg.base] = seg
        self._make_room(0)

    def _close_least_recent(self) -> bool:
        """Close the least recently used sealed segment not in use; whether there was one."""
        base = next((b for b, s in self._open_sealed.items() if not s.pins), None)
        if base is None:  # all in use: closed when the pool is trimmed next
            return False
        seg = self._open_sealed.pop(base)
        fd, seg.fd = seg.fd, None
        os.close(fd)
        return True

    def _forget(self, seg: Segment) -> None:
        """Close ``seg``'s descriptor, if open (it is being removed)."""
        self._open_sealed.pop(seg.base, None)
        if seg.fd is not None:
            fd, seg.fd = seg.fd, None
            os.close(fd)

    def _open_segment(self, path: str, base: int, *, is_last: bool) -> None:
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        header = os.pread(fd, SEGMENT_HEADER_BYTES, 0)
        if len(header) < SEGMENT_HEADER_BYTES and is_last:
            log.warning("commit log %s: torn segment header (%d bytes), rewriting it",
                        path, len(header))
            os.ftruncate(fd, 0)
            os.write(fd, SEGMENT_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, 0,
                                             self.segment_size, base))
            os.fsync(fd)
            size = SEGMENT_HEADER_BYTES
        else:
            if len(header) < SEGMENT_HEADER_BYTES:
                os.close(fd)
                raise CorruptLogError(f"{path}: segment header cut short ({len(header)} bytes)")
            try:
                seg_size = _header_segment_size(path, header, base)
            except CorruptLogError:
                os.close(fd)
                raise
            if seg_size != self.segment_size:
                if self._segments:
                    os.close(fd)
                    raise CorruptLogError(f"{path}: segment size {seg_size} differs from "
                                          f"the earlier segments' {self.segment_size}")
                log.warning("commit log %s: segments on disk are %d bytes, not the configured "
                            "%d; keeping %d", self.directory, seg_size, self.segment_size,
                            seg_size)
                self.segment_size = seg_size
        if self._segments and base < self._segments[-1].base + self.segment_size:
            os.close(fd)
            raise CorruptLogError(f"{path}: overlaps the previous segment "
                                  f"(segment size {self.segment_size})")
        if self._segments:  # the one before is sealed: into the pool (or closed)
            self._note_sealed_open(self._segments[-1])
        self._segments.append(Segment(base, path, fd, size))
        self._bases.append(base)

    def _scan_segment(self, index: int, seg: Segment, pos: int, on_frame) -> None:
        if seg.size <= pos:
            return
        with mmap.mmap(self._fd(seg), seg.size, prot=mmap.PROT_READ) as mm:
            while pos < seg.size:
                try:
                    frame_len, count = check_frame(mm, pos, seg.size)
                except FrameError as err:
                    self._bad_frame(index, seg, mm, pos, err)
                    return
                on_frame(seg.base + pos, mm, pos, frame_len, count)
                pos += frame_len

    def _bad_frame(self, index: int, seg: Segment, mm, pos: int, err: FrameError) -> None:
        later_data = any(s.size > SEGMENT_HEADER_BYTES for s in self._segments[index + 1:])
        where = f"{seg.path} at file offset {pos} (physical offset {seg.base + pos})"
        if later_data:
            raise CorruptLogError(f"{where}: {err.reason}; later segments hold data, "
                                  f"refusing to cut the log."
                                  f"{_cut_hint(self.directory, seg.base + pos)}")
        valid_after = _find_valid_frame(mm, pos, seg.size, err.frame_len)
        if valid_after is not None:
            raise CorruptLogError(
                f"{where}: {err.reason}; a valid frame follows at file offset "
                f"{valid_after}, so this is not a torn tail and nothing is skipped."
                f"{_cut_hint(self.directory, seg.base + pos)}")
        cut = seg.size - pos
        if _zeros(mm, pos, seg.size):  # (allocated ahead of the data: its end, not a tear)
            log.debug("commit log %s: %d bytes allocated ahead end the data", where, cut)
        else:
            log.warning("commit log %s: %s; truncating torn tail of %d bytes", where,
                        err.reason, cut)
        os.ftruncate(self._fd(seg), pos)
        os.fsync(seg.fd)
        seg.size = seg.allocated = pos
        for later in self._segments[index + 1:]:
            log.warning("commit log: removing empty segment %s after the torn tail", later.path)
            self._forget(later)
            os.unlink(later.path)
        del self._segments[index + 1:]
        del self._bases[index + 1:]
        self._open_sealed.pop(seg.base, None)  # the last segment now: always open

    # --------------------------------------------------------------- write
    def _new_segment(self, base: int) -> Segment:
        path = os.path.join(self.directory, segment_name(base))
        if self._segments:  # the last one joins the pool next: room first
            with self._fd_lock:
                self._make_room(1)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            crash_point("segment.created")
            header = SEGMENT_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, 0, self.segment_size,
                                         base)
            if os.write(fd, header) != len(header):
                raise OSError(errno.ENOSPC, "short write of a segment header")
            os.fsync(fd)
            crash_point("segment.header_synced")
            fsync_dir(self.directory)
        except BaseException:
            os.close(fd)
            raise
        seg = Segment(base, path, fd, SEGMENT_HEADER_BYTES)
        with self._fd_lock:
            if self._segments:  # the one before is sealed now: into the pool
                self._note_sealed_open(self._segments[-1])
            self._segments.append(seg)
            self._bases.append(base)
        return seg

    def _drop_unborn(self, base: int) -> None:
        """A new segment whose creation failed (no space for its header): its file goes,
        the one before stays the last."""
        with self._fd_lock:
            if self._segments and self._segments[-1].base == base:
                seg = self._segments.pop()
                self._bases.pop()
                self._forget(seg)
                self._open_sealed.pop(self._segments[-1].base, None)
                self._fd(self._segments[-1])  # the last one again: always open
        path = os.path.join(self.directory, segment_name(base))
        if os.path.exists(path):
            os.unlink(path)

    def next_frame_offset(self, size: int) -> int:
        """Where the next frame of ``size`` bytes goes: the end of the last segment, or the
        first frame of a new one when it does not fit there (what a follower copying
        another log's frames checks against)."""
        seg = self._segments[-1]
        if seg.size + size > self.segment_size:
            return seg.base + self.segment_size + SEGMENT_HEADER_BYTES
        return seg.end

    def append(self, frame: EncodedFrame) -> int:
        """Write one frame; return its physical offset."""
        size = frame.size
        if size > self.segment_size - SEGMENT_HEADER_BYTES:
            raise StorageError(f"frame of {size} bytes cannot fit a segment of {self.segment_size}")
        seg = self._segments[-1]
        if self.next_frame_offset(size) != seg.end:
            try:
                _trim(seg)
                os.fsync(seg.fd)  # a sealed segment is durable before the next one starts
                crash_point("segment.sealed")
            except OSError as err:  # what was written before may be lost: not retriable
                raise SegmentSealError(err.errno, f"sealing segment {seg.path} failed: "
                                                  f"{err.strerror}") from err
            try:
                seg = self._new_segment(seg.base + self.segment_size)
            except OSError as err:
                self._drop_unborn(seg.base + self.segment_size)
                if err.errno in _NO_SPACE:
                    raise DiskFullError(f"commit log {self.directory}: no space for a new "
                                        f"segment ({err.strerror}); nothing written") from None
                raise SegmentSealError(err.errno, f"creating the segment after {seg.path} "
                                                  f"failed: {err.strerror}") from err
        try:
            if seg.size + size > seg.allocated and self._allocate_ahead:
                self._allocate_ahead = _allocate_ahead(seg, seg.size + size, self.segment_size)
            written = os.pwritev(seg.fd, frame.parts, seg.size)
        except OSError as err:
            written, failure = -1, err
        else:
            failure = None
        if written != size:
            # a short (or failed) write leaves a torn frame: cut it, the log stays parseable
            os.ftruncate(seg.fd, seg.size)
            seg.allocated = seg.size
            if failure is None or failure.errno in _NO_SPACE:
                why = failure.strerror if failure is not None else "short write"
                raise DiskFullError(f"commit log {seg.path}: no space for a frame of {size} "
                                    f"bytes ({why}; {max(written, 0)} written, cut back); "
                                    f"nothing written")
            raise failure
        pos = seg.base + seg.size
        seg.size += size
        seg.allocated = max(seg.allocated, seg.size)
        return pos

    @property
    def max_offset(self) -> int:
        """Physical offset just past the last written byte."""
        return self._segments[-1].end

    @property
    def min_offset(self) -> int:
        return self._segments[0].base + SEGMENT_HEADER_BYTES

    def sync(self) -> int:
        """fsync what has been written; return the offset now durable."""
        with self._fd_lock:  # the writer may seal it meanwhile: pinned, not closed
            target = self.max_offset
            seg = self._segments[-1]
            seg.pins += 1
        try:
            os.fsync(seg.fd)
        finally:
            with self._fd_lock:
                seg.pins -= 1
        crash_point("log.fsync.after")
        self.sync_count += 1
        if target > self.flushed_offset:
            self.flushed_offset = target
        return target

    # ---------------------------------------------------------------- read
    def _segment_for(self, offset: int) -> Segment:
        i = bisect.bisect_right(self._bases, offset) - 1
        if i < 0:
            raise StorageError(f"physical offset {offset} is before the log start "
                               f"{self.min_offset}")
        return self._segments[i]

    def read(self, offset: int, size: int, into: memoryview | None = None):
        """The ``size`` bytes at physical ``offset`` (one segment); read ``into`` a buffer
        of that size when given (and it returned)."""
        seg = self._segment_for(offset)
        pos = offset - seg.base
        if pos < SEGMENT_HEADER_BYTES or pos + size > seg.size:
            raise StorageError(f"physical range [{offset}, {offset + size}) is outside "
                               f"segment {seg.path} (holds up to {seg.end})")
        with self._fd_lock:
            if into is None:
                data = os.pread(self._fd(seg), size, pos)
                got = len(data)
            else:
                data, got = into, os.preadv(self._fd(seg), [into], pos)
        if got != size:
            raise StorageError(f"short read at {offset} in {seg.path}")
        return data

    def truncate_to(self, offset: int) -> None:
        """Cut the log at physical ``offset`` (recovery only): later segments go."""
        i = max(0, bisect.bisect_right(self._bases, offset) - 1)
        seg = self._segments[i]
        keep = max(SEGMENT_HEADER_BYTES, offset - seg.base)
        with self._fd_lock:
            os.ftruncate(self._fd(seg), keep)
            os.fsync(seg.fd)
            seg.size = seg.allocated = keep
            for later in self._segments[i + 1:]:
                self._forget(later)
                os.unlink(later.path)
            del self._segments[i + 1:]
            del self._bases[i + 1:]
            self._open_sealed.pop(seg.base, None)  # the last segment now: always open
        self.flushed_offset = min(self.flushed_offset, self.max_offset)

    # ------------------------------------------------------------ retention
    def delete_oldest(self, count: int) -> int:
        """Delete the ``count`` oldest segments (never the last one); the bytes freed.  Each
        file goes at once (an unlink); a crash between two leaves the log starting at the
        next: the log's start is its first segment's."""
        freed = 0
        for _ in range(count):
            with self._fd_lock:
                if len(self._segments) < 2:
                    break
                seg = self._segments[0]
                if seg.pins:
                    break
                self._forget(seg)
                os.unlink(seg.path)
                del self._segments[0]
                del self._bases[0]
            freed += seg.size
            crash_point("retention.deleted_one")
        if freed:
            fsync_dir(self.directory)
        return freed

    def segment_end(self, offset: int) -> int:
        return self._segment_for(offset).end

    def segments(self) -> list[tuple[str, int, int]]:
        return [(s.path, s.base, s.size) for s in self._segments]

    def close(self, *, sync: bool = True) -> None:
        """Close every segment (fsync'd first unless ``sync`` is False: after a failed
        write, when an fsync could report pages Linux dropped as written)."""
        first_error = None
        with self._fd_lock:
            for seg in self._segments:
                if seg.fd is None:  # sealed (fsynced when it was) and closed
                    continue
                try:
                    _trim(seg)
                    if sync:
                        os.fsync(seg.fd)
                except OSError as err:
                    first_error = first_error or err
                finally:
                    self._forget(seg)
            self._segments.clear()
            self._bases.clear()
        if first_error is not None:
            raise first_error


def _find_valid_frame(mm, pos: int, end: int, frame_len: int | None) -> int | None:
    candidates = []
    if frame_len and pos + frame_len < end:
        candidates.append(pos + frame_len)
    found = pos
    for _ in range(_MAX_RESYNC_CANDIDATES):
        found = mm.find(_FRAME_MAGIC_BYTES, found + 1, end)
        if found < 0:
            break
        candidates.append(found)
    for cand in candidates:
        try:
            check_frame(mm, cand, end)
            return cand
        except FrameError:
            continue
    return None


def _scan_start(segments: list[Segment], bases: list[int], offset: int) -> tuple[int, int]:
    """Where a scan from ``offset`` starts: (segment index, position in it)."""
    i = max(0, bisect.bisect_right(bases, offset) - 1)
    seg = segments[i]
    pos = offset - seg.base
    if pos < SEGMENT_HEADER_BYTES or offset < seg.base:
        return i, SEGMENT_HEADER_BYTES
    if pos > seg.size:
        log.error("commit log %s: checkpoint offset %d is past the end of the data (%d): "
                  "%d bytes that were flushed are missing; rescanning the segment",
                  seg.path, offset, seg.end, offset - seg.end)
        return i, SEGMENT_HEADER_BYTES
    return i, pos


def _header_segment_size(path: str, header: bytes, base: int) -> int:
    """The segment size a segment file's ``header`` names (``CorruptLogError`` when the
    header is not that of the segment at ``base``)."""
    magic, version, _res, seg_size, hbase = SEGMENT_HEADER.unpack(header)
    if magic != SEGMENT_MAGIC or version != SEGMENT_VERSION or hbase != base or seg_size < 4096:
        raise CorruptLogError(
            f"{path}: bad segment header (magic {magic!r}, version {version}, segment size "
            f"{seg_size}, base {hbase}); expected {SEGMENT_MAGIC!r} v{SEGMENT_VERSION} base "
            f"{base}")
    return seg_size


def _allocate_ahead(seg: Segment, need: int, segment_size: int) -> bool:
    """Allocate ``seg``'s file from its end up to ``PREALLOCATE_BYTES`` past it (at least
    to ``need``, at most to the segment size); on a disk too full for that, to ``need``
    alone.  ``OSError`` (ENOSPC) when even that does not fit; False when the filesystem
    cannot allocate ahead (the log is only appended to from then on)."""
    ahead = min(segment_size, max(need, seg.allocated + PREALLOCATE_BYTES))
    try:
        _allocate(seg, ahead)
    except OSError as err:
        if err.errno in _NO_FALLOCATE:
            log.info("commit log %s: the filesystem cannot allocate ahead (%s); appending",
                     os.path.dirname(seg.path), err.strerror)
            return False
        if err.errno not in _NO_SPACE or ahead == need:
            raise
        _allocate(seg, need)
    return True


def _allocate(seg: Segment, to: int) -> None:
    """Extend ``seg``'s file to ``to`` bytes with blocks that read as zeros (allocated, not
    written: ``fallocate``)."""
    try:
        os.posix_fallocate(seg.fd, seg.allocated, to - seg.allocated)
    except BaseException:
        os.ftruncate(seg.fd, seg.allocated)  # (what was allocated before stays)
        raise
    seg.allocated = to


def _trim(seg: Segment) -> None:
    """Drop the space allocated past ``seg``'s data (it is sealed, or closed)."""
    if seg.allocated > seg.size:
        os.ftruncate(seg.fd, seg.size)
        seg.allocated = seg.size


def _zeros(mm, pos: int, end: int) -> bool:
    """Whether ``mm[pos:end]`` holds zeros only."""
    while pos < end:
        piece = min(len(_ZEROS), end - pos)
        if mm[pos:pos + piece] != _ZEROS[:piece]:
            return False
        pos += piece
    return True


def _cut_hint(directory: str, offset: int) -> str:
    store_dir = os.path.dirname(os.path.abspath(directory))
    return (f" To give up what follows (it is moved to {store_dir}/quarantine/, after a "
            f"summary and a confirmation), stop the shard and run: "
            f"raymq storage cut {store_dir} --at {offset}")
