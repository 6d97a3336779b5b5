"""Offline repair of a commit log: cutting it at a bad frame, what follows kept aside.
Owns the cut plan (what a cut would remove, what of that still parses) and the cut.

A store refuses to open when a bad frame is followed by valid data: skipping it
silently could lose acknowledged messages.  The operator -- the shard stopped --
runs ``raymq storage cut DIR --at OFFSET`` (the command the error names): it
shows what the cut removes (bytes, later segment files, the records there that
still parse, by topic) and, once confirmed, moves all of it into
``DIR/quarantine/cut-at-OFFSET/`` and cuts the segment there.  Nothing is
deleted.  The next start recovers as after a torn tail: consume queues past
the new end are dropped or rebuilt, a put left without its last frame is cut.

Only a frame boundary reached through good frames from the segment start is
accepted: a cut inside a frame, or behind an earlier bad frame, is refused
(naming the offset to use instead).
"""
from __future__ import annotations

import bisect
import mmap
import os
import shutil
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

from raymq.storage.commitlog import SEGMENT_HEADER_BYTES
from raymq.storage.errors import StorageError
from raymq.storage.fileutil import fsync_dir
from raymq.storage.records import (FRAME_ATTR_LAST, FRAME_MAGIC, FrameError, check_frame,
                                   frame_headers, frame_producer)

QUARANTINE_DIR = "quarantine"
_MAGIC_BYTES = FRAME_MAGIC.to_bytes(4, "little")


@dataclass(frozen=True)
class CutPlan:
    """What cutting the commit log of ``store_dir`` at physical ``offset`` does."""

    store_dir: str
    offset: int                 # physical offset of the cut
    segment: str                # the segment file cut there
    file_offset: int            # the cut's position in that file
    segment_size: int           # that file's size now (checked again before cutting)
    later_segments: tuple[str, ...]  # segment files after it: moved aside whole
    lost_bytes: int             # bytes from the cut to the end of the log
    frames: int                 # frames past the cut that still pass their checks
    records: int                # records in those frames
    topics: dict[str, int] = field(default_factory=dict)  # those records by topic
    open_put_from: int | None = None  # the put the frame at the cut belongs to began here

    def describe(self) -> str:
        """The operator's summary of what the cut removes."""
        lines = [f"commit log of {self.store_dir}: cut at physical offset {self.offset} "
                 f"({self.segment}, file offset {self.file_offset})",
                 f"  removes {self.lost_bytes} bytes: {self.segment_size - self.file_offset} "
                 f"of this segment and {len(self.later_segments)} later segment files",
                 f"  of which {self.frames} frames holding {self.records} records still "
                 "parse" + (":" if self.topics else "")]
        lines += [f"    {topic}: {n}" for topic, n in sorted(self.topics.items())]
        if self.open_put_from is not None:
            lines.append(f"  the put the cut falls in began at physical offset "
                         f"{self.open_put_from}: its frames before the cut go too (on start)")
        quarantine = os.path.join(self.store_dir, QUARANTINE_DIR)
        lines.append(f"  everything removed is kept in {quarantine}/; stop the shard that owns "
                     "this directory first")
        return "\n".join(lines)


def _segments(log_dir: str) -> list[tuple[int, str]]:
    try:
        names = sorted(n for n in os.listdir(log_dir) if n.endswith(".log"))
    except FileNotFoundError:
        raise StorageError(f"{log_dir}: no such directory (is this a store directory?)") from None
    out = []
    for name in names:
        try:
            out.append((int(name[:-4]), os.path.join(log_dir, name)))
        except ValueError:
            raise StorageError(f"{log_dir}/{name}: not a segment file name") from None
    if not out:
        raise StorageError(f"{log_dir}: no commit-log segments")
    return out


@contextmanager
def _mapped(path: str):
    """A file's bytes, read-only (mapped)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            yield b""
            return
        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
            yield mm


def plan_cut(store_dir: str, offset: int) -> CutPlan:
    """What a cut of ``store_dir``'s commit log at physical ``offset`` would remove.

    Raises ``StorageError`` when ``offset`` is not a frame boundary reached through
    good frames from the start of its segment.  Reads, changes nothing.
    """
    store_dir = os.path.abspath(store_dir)
    segs = _segments(os.path.join(store_dir, "commitlog"))
    i = bisect.bisect_right([base for base, _ in segs], offset) - 1
    if i < 0:
        raise StorageError(f"physical offset {offset} is before the first segment")
    base, path = segs[i]
    with _mapped(path) as buf:
        size, pos = len(buf), offset - base
        if not SEGMENT_HEADER_BYTES <= pos <= size:
            raise StorageError(f"physical offset {offset} is not in {path}, which holds "
                               f"physical offsets {base + SEGMENT_HEADER_BYTES} to {base + size}")
        open_put_from = _walk_to(buf, path, base, pos)
        frames, records, topics = _parsable(buf, pos, size)
    later, later_bytes = [], 0
    for _b, later_path in segs[i + 1:]:
        with _mapped(later_path) as lbuf:
            f, r, t = _parsable(lbuf, SEGMENT_HEADER_BYTES, len(lbuf))
        frames, records = frames + f, records + r
        later_bytes += os.path.getsize(later_path)
        topics.update(t)
        later.append(later_path)
    return CutPlan(store_dir, offset, path, pos, size, tuple(later),
                   size - pos + later_bytes, frames, records, dict(topics), open_put_from)


def _walk_to(buf, path: str, base: int, pos: int) -> int | None:
    """Check good frames lead from the segment header to ``pos``; return where the put
    open at ``pos`` began (None: ``pos`` starts a put)."""
    p, open_from = SEGMENT_HEADER_BYTES, None
    while p < pos:
        try:
            frame_len, _count = check_frame(buf, p, len(buf))
        except FrameError as err:
            raise StorageError(
                f"{path}: the frame at physical offset {base + p} is bad ({err.reason}), "
                f"before {base + pos}: cut there instead (--at {base + p})") from None
        last = frame_producer(buf, p)[3] & FRAME_ATTR_LAST
        open_from = None if last else (base + p if open_from is None else open_from)
        if p + frame_len > pos:
            raise StorageError(f"physical offset {base + pos} is inside a frame: the nearest "
                               f"frame boundaries are {base + p} and {base + p + frame_len}")
        p += frame_len
    return open_from


def _parsable(buf, pos: int, end: int) -> tuple[int, int, Counter]:
    """Frames, records and records by topic that pass their checks in ``buf[pos:end]``,
    resynchronising on the frame magic after a bad one."""
    frames = records = 0
    topics: Counter = Counter()
    while pos < end:
        try:
            frame_len, count = check_frame(buf, pos, end)
        except FrameError:
            pos = _next_good_frame(buf, pos, end)
            continue
        h = frame_headers(buf, pos, count)
        for meta_off, topic_len in zip(h["meta_off"].tolist(), h["topic_len"].tolist()):
            start = pos + meta_off
            topics[bytes(buf[start:start + topic_len]).decode(errors="replace")] += 1
        frames, records, pos = frames + 1, records + count, pos + frame_len
    return frames, records, topics


def _next_good_frame(buf, pos: int, end: int) -> int:
    """The next position after ``pos`` where a good frame starts, else ``end``."""
    found = pos
    while True:
        found = buf.find(_MAGIC_BYTES, found + 1, end)
        if found < 0:
            return end
        try:
            check_frame(buf, found, end)
            return found
        except FrameError:
            continue


def apply_cut(plan: CutPlan) -> str:
    """Move what ``plan`` removes into a new quarantine directory, then cut; its path.

    Order: the tail is copied and fsynced, later segments moved (last first), the
    segment truncated last -- a crash part-way leaves a log that still refuses to open
    (run the cut again), never one with a hole.
    """
    if (os.path.getsize(plan.segment) != plan.segment_size
            or tuple(p for _b, p in _segments(os.path.dirname(plan.segment))
                     if p > plan.segment) != plan.later_segments):
        raise StorageError(f"the commit log of {plan.store_dir} changed since the plan "
                           "(is the shard running?); nothing was changed")
    qroot = os.path.join(plan.store_dir, QUARANTINE_DIR)
    os.makedirs(qroot, exist_ok=True)
    qdir, n = os.path.join(qroot, f"cut-at-{plan.offset}"), 1
    while os.path.exists(qdir):
        n += 1
        qdir = os.path.join(qroot, f"cut-at-{plan.offset}-{n}")
    os.mkdir(qdir)
    tail = os.path.join(qdir, f"{os.path.basename(plan.segment)}.from-{plan.file_offset}")
    with open(plan.segment, "rb") as src, open(tail, "wb") as dst:
        src.seek(plan.file_offset)
        shutil.copyfileobj(src, dst)
        dst.flush()
        os.fsync(dst.fileno())
    for d in (qdir, qroot, plan.store_dir):
        fsync_dir(d)
    for path in reversed(plan.later_segments):
        os.rename(path, os.path.join(qdir, os.path.basename(path)))
    fsync_dir(qdir)
    fsync_dir(os.path.dirname(plan.segment))
    fd = os.open(plan.segment, os.O_RDWR)
    try:
        os.ftruncate(fd, plan.file_offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return qdir
