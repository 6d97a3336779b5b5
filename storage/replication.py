"""Commit-log replication at the storage level (issue 26, first part): a leader's store
hands out whole frames of its commit log from a physical offset (``read_frames``); a
follower's store writes them at the same physical offsets and indexes them as recovery
does (``append_replicated``), so that every queue, offset and producer sequence of the
follower is the leader's, byte for byte (RocketMQ HA's shape).  A returning replica
cuts its store where it diverged (``cut_store``, the point from
``raymq.storage.epochs``): the commit log, its consume queues and its checkpoint go back
together, so the store reopens without re-indexing anything below the cut.

Segment boundaries need no message: a commit log starts a new segment exactly when the
next frame does not fit, so the same frames in the same order land at the same offsets
on a store with the same ``segment_size_bytes`` (checked: a frame placed elsewhere is an
error, nothing written).  Pure Python, no Ray.
"""
from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass

from raymq.storage.commitlog import SEGMENT_HEADER_BYTES, CommitLog
from raymq.storage.durability import write_checkpoint
from raymq.storage.errors import StorageError
from raymq.storage.faults import crash_point
from raymq.storage.producers import ProducerTable
from raymq.storage.queueindex import QueueIndex
from raymq.storage.records import (FRAME_HEADER_BYTES, FRAME_MAGIC, FrameError, check_frame,
                                   frame_producer)
from raymq.storage.recovery import read_checkpoint

log = logging.getLogger(__name__)

_MAGIC_LEN = struct.Struct("<II")  # a frame header's first fields: magic, length


@dataclass
class RawFrame:
    """A frame as the commit log writes it (``parts`` for ``writev``)."""

    parts: tuple
    size: int


def read_frames(log: CommitLog, written_end: int, from_phys: int,
                max_bytes: int) -> tuple[int, bytes]:
    """Whole frames of ``log`` from ``from_phys`` up to ``written_end`` (what is written
    and indexed), at most ``max_bytes`` of them but one frame at least: ``(the physical
    offset of the first, their bytes)``.  ``from_phys`` is the end of what the follower
    holds: a frame start, or the end of a segment (the frames go on at the next
    segment's first frame).  ``(from_phys, b"")`` when there is nothing new."""
    start = from_phys
    for _path, base, size in log.segments():
        if base <= from_phys <= base + size:
            if from_phys == base + size and from_phys < written_end:  # a sealed segment's end
                start = base + log.segment_size + SEGMENT_HEADER_BYTES
            start = max(start, base + SEGMENT_HEADER_BYTES)  # (a segment's first frame)
            break
    else:
        raise StorageError(f"physical offset {from_phys} is not in the commit log "
                           f"(it holds {log.min_offset}..{log.max_offset})")
    seg_end = log.segment_end(start) if start < written_end else start
    end = min(written_end, seg_end)
    if end <= start:
        return from_phys, b""
    data = log.read(start, min(end - start, max(max_bytes, FRAME_HEADER_BYTES)))
    pos = 0
    while pos + FRAME_HEADER_BYTES <= len(data):
        # whole frames by their lengths: the follower checks every CRC (checking here too
        # cost the leader a third of what serving a fetch costs)
        magic, frame_len = _MAGIC_LEN.unpack_from(data, pos)
        if magic != FRAME_MAGIC or frame_len < FRAME_HEADER_BYTES:
            break
        if pos + frame_len > len(data):
            if pos == 0:  # one large frame
                data = log.read(start, min(end - start, frame_len))
                if frame_len <= len(data):
                    continue
            break
        pos += frame_len
    if pos == 0:
        raise StorageError(f"no whole frame at physical offset {start}")
    return start, data[:pos]


def split_frames(data: bytes) -> list[tuple[int, int, int]]:
    """``(position, length, records)`` of each frame of ``data`` (all CRC-checked);
    ``StorageError`` naming the first bad one."""
    out, pos = [], 0
    while pos < len(data):
        try:
            frame_len, count = check_frame(data, pos, len(data))
        except FrameError as err:
            raise StorageError(f"replicated frame at byte {pos}: {err.reason}") from None
        out.append((pos, frame_len, count))
        pos += frame_len
    return out


def place_frames(log: CommitLog, phys: int, data: bytes,
                 frames: list[tuple[int, int, int]]) -> list[int]:
    """Write ``frames`` of ``data`` (the leader wrote the first at ``phys``) to ``log`` at
    the same offsets; their physical offsets.  ``StorageError`` (nothing written) when
    the first would land elsewhere: this log is out of step with the leader's."""
    if frames and log.next_frame_offset(frames[0][1]) != phys:
        raise StorageError(f"replicated frames start at {phys}; this log would write them "
                           f"at {log.next_frame_offset(frames[0][1])} (it ends at "
                           f"{log.max_offset}): out of step with the leader")
    view = memoryview(data)
    return [log.append(RawFrame((view[pos:pos + length],), length))
            for pos, length, _count in frames]


def cut_store(directory: str, segment_size_bytes: int, phys: int) -> None:
    """Cut the closed store in ``directory`` at ``phys`` (a put boundary: a returning
    replica, where its epochs diverge from the leader's).

    What a checkpoint past the cut vouches for is cut back with the log, so the store
    reopens from the cut instead of re-indexing its whole log: every consume queue
    loses the entries of records at or past ``phys``, every producer whose puts were cut
    goes back to the sequence before its first cut one (sequences only grow along the
    log), and the checkpoint moves to ``phys`` -- then the log is cut.  A crash between
    the steps leaves a checkpoint at or past the log's end and queues that agree with it,
    or (queues cut, checkpoint not yet moved) queues that disagree: recovery rebuilds
    them then, as it did before this shortcut.  A cut below a topic deletion the store
    applied is rebuilt too (its dropped queues come back only from the log): recovery
    finds the tombstone noted past the log's end.
    """
    commit_log = CommitLog(os.path.join(directory, "commitlog"), segment_size_bytes)
    firsts: dict[int, int] = {}  # producer id -> its first sequence at or past the cut

    def note(_frame_phys, buf, pos, _frame_len, _count) -> None:
        producer_id, sequence, _ms, _attrs = frame_producer(buf, pos)
        if producer_id and producer_id not in firsts:
            firsts[producer_id] = sequence

    commit_log.open(phys, note)  # (the frames past the cut checked: a torn tail is cut)
    try:
        if phys >= commit_log.max_offset:
            return
        checkpoint_path = os.path.join(directory, "checkpoint")
        checkpoint = read_checkpoint(checkpoint_path)
        if checkpoint.offset > phys and not checkpoint.rebuilding:
            _cut_queues(directory, checkpoint_path, checkpoint.producers, firsts, phys)
        commit_log.truncate_to(phys)
    finally:
        commit_log.close()


def _cut_queues(directory: str, checkpoint_path: str, producers: ProducerTable,
                firsts: dict[int, int], phys: int) -> None:
    queues = QueueIndex(os.path.join(directory, "consumequeue"), 64)
    queues.load()
    try:
        dropped = sum(cq.truncate_past(phys) for cq in queues.queues.values())
        crash_point("cut.queues")
        producers.cut_back(firsts)
        write_checkpoint(checkpoint_path, phys, queues.queues.values(), producers.snapshot())
    finally:
        for cq in queues.queues.values():
            cq.close()
    log.info("store %s: cut at %d: %d consume-queue entries and the sequences of %d "
             "producers went with it", directory, phys, dropped, len(firsts))


def truncate_log(directory: str, segment_size_bytes: int, phys: int) -> None:
    """Cut only the commit log of a closed store at ``phys``; the store reopened then
    rebuilds its queues and producer table from the start of its log (its checkpoint is
    past the cut).  ``cut_store`` is the shortcut."""
    log_ = CommitLog(directory, segment_size_bytes)
    log_.open(0, lambda *_a: None)  # (every frame checked: a torn tail is cut first)
    try:
        if phys < log_.max_offset:
            log_.truncate_to(phys)
    finally:
        log_.close()


def restart_store_at(directory: str, segment_size_bytes: int, base: int) -> None:
    """Empty the closed store in ``directory``: its commit log then starts, with no record,
    at segment ``base`` (a follower behind its leader's log start: what it would copy next
    aged out there).  Its queues are rebuilt from what it copies next, each starting at the
    offset its first record has (``Replay.late_start``); its group offsets stay."""
    from raymq.storage.commitlog import SEGMENT_HEADER, SEGMENT_MAGIC, SEGMENT_VERSION, \
        segment_name
    from raymq.storage.fileutil import fsync_dir
    log_dir = os.path.join(directory, "commitlog")
    write_checkpoint(os.path.join(directory, "checkpoint"), 0, [], {}, rebuilding=True)
    for name in sorted(os.listdir(log_dir)):
        os.unlink(os.path.join(log_dir, name))
    path = os.path.join(log_dir, segment_name(base))
    with open(path, "wb") as f:
        f.write(SEGMENT_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, 0, segment_size_bytes, base))
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(log_dir)
