"""Opening a store after a stop or a crash: from the last checkpoint to a consistent state.
Owns reading the checkpoint, the log scan from it, cutting an open put, re-indexing, rebuilds.

The commit log is scanned from the checkpoint offset (``CommitLog.open`` cuts a
torn tail).  Consume-queue entries the checkpoint does not vouch for are not
trusted (a lost page reads as zeros): each queue is cut back to its last entry
of a record below the checkpoint, every record from the checkpoint on is
re-indexed, and the producer table brought up to date; the frames of a put
whose LAST frame never reached the disk are cut off, so a put is all or nothing.  When the consume
queues disagree with the log, or the checkpoint or a noted tombstone (a deleted
topic, ``raymq.storage.topics``) is past its end, the queues, the producer table
and the noted tombstones are rebuilt from the start of the log.  Recovery ends
with a fresh checkpoint.

A rebuild is crash-safe at every step: before it deletes anything it durably
replaces the checkpoint with one marked ``rebuilding`` (offset 0, no producer
state), and only the checkpoint written once every queue is rebuilt and
fsynced clears the mark.  A start that finds the mark rebuilds again from
scratch: it never trusts queue files a rebuild left half deleted or half
written.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import numpy as np

from raymq.storage.commitlog import CommitLog
from raymq.storage.consumequeue import CQ_ENTRY, ConsumeQueue
from raymq.storage.durability import CHECKPOINT_FORMAT, write_checkpoint
from raymq.storage.faults import crash_point
from raymq.storage.fileutil import fsync_dir
from raymq.storage.producers import ProducerTable
from raymq.storage import topics
from raymq.storage.queueindex import QueueIndex
from raymq.storage.topics import TOPIC_DELETED
from raymq.storage.records import FRAME_ATTR_LAST, frame_headers, frame_producer, record_sizes

log = logging.getLogger("raymq.storage")


class RebuildNeeded(Exception):
    pass


@dataclass
class Recovered:
    """What an opened store continues from."""

    commit_log: CommitLog  # the one given to ``recover``, or a new one after a rebuild
    queues: QueueIndex     # likewise
    producers: ProducerTable
    recovered_records: int  # records re-indexed past the checkpoint


@dataclass
class Checkpoint:
    """What the checkpoint file says."""

    offset: int  # every consume-queue entry of a record below it is durable
    producers: ProducerTable
    rebuilding: bool = False  # a rebuild of the consume queues began and has not ended


def read_checkpoint(path: str) -> Checkpoint:
    """The checkpoint; offset 0 and no producers if missing or unreadable."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        if doc.get("format") != CHECKPOINT_FORMAT:
            raise ValueError("format")
        offset = int(doc["consume_queue_offset"])
        return Checkpoint(offset, ProducerTable.restore(doc["producers"]),
                          rebuilding=bool(doc.get("rebuilding", False)))
    except FileNotFoundError:
        return Checkpoint(0, ProducerTable())
    except (ValueError, KeyError, TypeError) as err:
        log.warning("checkpoint %s is unreadable (%s); rebuilding consume queues and "
                    "producer state from the start of the log", path, err)
        return Checkpoint(0, ProducerTable())


def recover(directory: str, commit_log: CommitLog, queues: QueueIndex, *,
            checkpoint_path: str, segment_size_bytes: int) -> Recovered:
    """Open ``commit_log`` and ``queues`` (both not opened yet) consistently; checkpoint.

    Raises ``CorruptLogError`` for a bad frame that is not a torn tail.
    """
    checkpoint = read_checkpoint(checkpoint_path)
    ckpt = checkpoint.offset
    queues.load()
    replay = Replay(queues, checkpoint.producers, late_start=_starts_late(commit_log.directory),
                    directory=directory)
    try:
        if checkpoint.rebuilding:
            raise RebuildNeeded("a rebuild of the consume queues was interrupted")
        untrusted = queues.trim_to_checkpoint(ckpt)
        if untrusted:
            log.info("store %s: %d consume-queue entries past checkpoint %d are re-indexed "
                     "from the commit log", directory, untrusted, ckpt)
        commit_log.open(ckpt, replay.frame)
        if ckpt > commit_log.max_offset:
            # flushed data the checkpoint covers is gone (a lost tail, pages dropped
            # after an I/O error): its producer snapshot would claim sequences the log
            # no longer holds -- the scheduler and resends would skip, resends of
            # clients be taken for duplicates.  Everything is rebuilt from the log.
            raise RebuildNeeded(f"the checkpoint ({ckpt}) is past the end of the "
                                 f"commit log ({commit_log.max_offset})")
        replay.cut_open_put(commit_log, directory)
        _check_tombstones(directory, commit_log.max_offset)
    except RebuildNeeded as why:
        commit_log, replay = _rebuild(directory, commit_log, queues, why, segment_size_bytes,
                                      checkpoint_path)
    _drop_entries_past_end(replay.queues, commit_log.max_offset)
    if replay.recovered_records:
        log.info("store %s: re-indexed %d records past checkpoint %d",
                 directory, replay.recovered_records, ckpt)
    commit_log.sync()  # the snapshot below must cover only what is on disk
    write_checkpoint(checkpoint_path, commit_log.max_offset, replay.queues.queues.values(),
                     replay.producers.snapshot())
    return Recovered(commit_log, replay.queues, replay.producers, replay.recovered_records)


def _rebuild(directory: str, commit_log: CommitLog, queues: QueueIndex, why: RebuildNeeded,
             segment_size_bytes: int, checkpoint_path: str) -> tuple[CommitLog, "Replay"]:
    """Drop the consume queues and producer state; re-index the whole log into new ones.

    The checkpoint is marked ``rebuilding`` (durably) before anything is deleted; the
    caller's final checkpoint, written after the new queues are fsynced, clears it.
    """
    log.warning("consume queues disagree with the commit log (%s); rebuilding them", why)
    commit_log.close()
    queues.close()
    write_checkpoint(checkpoint_path, 0, [], {}, rebuilding=True)
    crash_point("rebuild.marked")
    # the tombstones are noted again from the log, as the queues are indexed again: one
    # noted for a record the log no longer holds (cut away) must not outlive the rebuild
    # (one before the log start goes with it too: no record it could hide is left)
    topics.write_deleted(directory, {})
    _delete_queue_files(queues.root)
    crash_point("rebuild.deleted")
    queues = QueueIndex(queues.root, queues.files.configured_limit)
    commit_log = CommitLog(commit_log.directory, segment_size_bytes,
                           commit_log.max_open_segments)
    replay = Replay(queues, ProducerTable(), late_start=_starts_late(commit_log.directory),
                    directory=directory)
    commit_log.open(0, replay.frame)
    replay.cut_open_put(commit_log, directory)
    crash_point("rebuild.reindexed")
    return commit_log, replay


def _check_tombstones(directory: str, end: int) -> None:
    """``RebuildNeeded`` when a noted tombstone lies at or past the log's end ``end``: the
    deletion was cut away (a follower cut back below a tombstone it had copied, a lost
    tail) but the queues it dropped are still gone and the topic still counts as deleted
    -- only re-indexing the log gives its records back (``_rebuild``)."""
    cut = {t: p for t, p in topics.read_deleted(directory).items() if p >= end}
    if cut:
        raise RebuildNeeded(f"deleted topics noted past the commit log's end ({end}): {cut}")


def _starts_late(log_dir: str) -> bool:
    """The log's first segment is not the one at 0: older ones were deleted (retention)."""
    names = sorted(n for n in os.listdir(log_dir) if n.endswith(".log")) \
        if os.path.isdir(log_dir) else []
    return bool(names) and names[0] != f"{0:020d}.log"


def _delete_queue_files(root: str) -> None:
    """Delete every consume-queue file and topic directory under ``root`` (kept), durably."""
    for topic in sorted(os.listdir(root)):
        tdir = os.path.join(root, topic)
        if not os.path.isdir(tdir):
            os.unlink(tdir)
            continue
        for name in sorted(os.listdir(tdir)):
            os.unlink(os.path.join(tdir, name))
            crash_point("rebuild.deleting")
        os.rmdir(tdir)
    fsync_dir(root)


def _drop_entries_past_end(queues: QueueIndex, end: int) -> None:
    for cq in queues.queues.values():
        dropped = cq.truncate_past(end)
        if dropped:
            log.warning("consume queue %s: dropped %d entries past the commit log end %d",
                        cq.path, dropped, end)


def _queues_of(h: np.ndarray) -> list[tuple[tuple[int, int, int], np.ndarray]]:
    """The queues of a frame's records, in the order their first record comes: each
    ``(meta_off, topic_len, queue_id)`` with the indexes of its records.  A frame of one
    queue (a batch to one queue: the common case) is told at once, without sorting."""
    mo, tl, qi = h["meta_off"], h["topic_len"], h["queue_id"]
    if not len(mo):
        return []
    if (mo == mo[0]).all() and (tl == tl[0]).all() and (qi == qi[0]).all():
        return [((int(mo[0]), int(tl[0]), int(qi[0])), np.arange(len(mo)))]
    if int(qi.max()) < 1 << 20 and int(tl.max()) < 1 << 12:  # one integer a queue: sorted
        keys = (mo.astype(np.uint64) << np.uint64(32)) | (tl.astype(np.uint64) << np.uint64(20)) \
            | qi.astype(np.uint64)
        order = np.argsort(keys, kind="stable")
        ordered = keys[order]
        groups = np.split(order, np.flatnonzero(ordered[1:] != ordered[:-1]) + 1)
        groups.sort(key=lambda g: g[0])
        return [((int(mo[g[0]]), int(tl[g[0]]), int(qi[g[0]])), g) for g in groups]
    keys = np.stack([mo.astype(np.int64), tl.astype(np.int64), qi.astype(np.int64)], axis=1)
    uniq, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    return [(tuple(int(x) for x in uniq[u]), np.flatnonzero(inverse == u))
            for u in np.argsort(first)]


class Replay:
    """Re-indexes the frames found past the checkpoint, one put at a time.

    The frames of one put are applied together when its LAST frame is seen;
    frames of a put whose LAST frame never made it to disk are cut off after
    the scan (``cut_open_put``), so a put is all or nothing.
    """

    def __init__(self, queues: QueueIndex, producers: ProducerTable, *,
                 late_start: bool = False, directory: str | None = None):
        self.queues = queues
        self.producers = producers
        #: where tombstones of deleted topics are noted (``raymq.storage.topics``)
        self.directory = directory
        self._tombstones: list[tuple[str, int]] = []  # of the put being read
        #: the log's first segments were deleted (retention): a queue first seen in it
        #: starts at the queue offset its first record has, the offsets below aged out
        self.late_start = late_start
        self.recovered_records = 0
        self._open_entries: dict[ConsumeQueue, list] = {}
        self._open_frames: list = []

    def frame(self, frame_phys: int, buf, pos: int, frame_len: int, count: int) -> None:
        """``CommitLog.open``'s ``on_frame``: note one frame, apply its put if it is LAST."""
        h = frame_headers(buf, pos, count)
        phys = frame_phys + h["frame_delta"].astype(np.int64)
        sizes = record_sizes(h)
        producer_id, sequence, store_ms, attrs = frame_producer(buf, pos)
        self._note_entries(buf, pos, h, phys, sizes)
        self._open_frames.append((frame_phys, producer_id, sequence, phys,
                                  h["queue_offset"].copy(), sizes, frame_phys + frame_len,
                                  store_ms))
        if attrs & FRAME_ATTR_LAST:
            self._apply_open_put()

    def _note_entries(self, buf, pos: int, h: np.ndarray, phys: np.ndarray,
                      sizes: np.ndarray) -> None:
        """Queue the index entries of the frame's records the consume queues miss (a queue
        at a time: the records of one topic and queue in a frame share its name's bytes)."""
        pending = self._open_entries
        for (meta_off, topic_len, qid), idx in _queues_of(h):
            topic = bytes(buf[pos + meta_off:pos + meta_off + topic_len]).decode()
            if topic == TOPIC_DELETED:  # (applied with its put: ``_apply_open_put``)
                for k in idx:
                    off = pos + int(h["body_off"][k])
                    self._tombstones.append((bytes(buf[off:off + int(h["body_len"][k])])
                                             .decode(), int(phys[k])))
            cq = self.queues.get_or_create(topic, qid)
            idx = idx[phys[idx] > cq.last_phys]
            if not len(idx):
                continue
            waiting = pending.setdefault(cq, [])
            expected = cq.count + sum(len(w) for w in waiting)
            qoffs = h["queue_offset"][idx].astype(np.int64)
            if not expected and qoffs[0] > 0 and self.late_start:
                cq.pad_to(int(qoffs[0]))
                expected = cq.count
            wrong = np.flatnonzero(qoffs != expected + np.arange(len(idx)))
            if len(wrong):
                k = int(wrong[0])
                raise RebuildNeeded(f"{topic}/{qid}: record at {phys[idx[k]]} has queue offset "
                                    f"{qoffs[k]}, the index expects {expected + k}")
            entries = np.empty(len(idx), CQ_ENTRY)
            entries["phys"], entries["size"], entries["tag"] = \
                phys[idx], sizes[idx], h["tag_code"][idx]
            waiting.append(entries)

    def _apply_open_put(self) -> None:
        """The put's LAST frame is on disk: index its entries, note it for its producer."""
        for cq, parts in self._open_entries.items():
            if parts:
                entries = parts[0] if len(parts) == 1 else np.concatenate(parts)
                cq.append(entries.tobytes(), int(entries["phys"][-1]))
                self.recovered_records += len(entries)
        for (_fp, pid, seq, ph, qo, sz, end, ms) in self._open_frames:
            if pid:
                self.producers.record(pid, seq, ph, qo, sz, end, ms)
        self._open_entries = {}
        self._open_frames = []
        tombstones, self._tombstones = self._tombstones, []
        for topic, phys in tombstones:
            if self.directory is not None:
                topics.forget(self.directory, self.queues, topic, phys)

    @property
    def open_start(self) -> int | None:
        """Where the put whose last frame has not been seen starts (None: no such put)."""
        return self._open_frames[0][0] if self._open_frames else None

    def cut_open_put(self, commit_log: CommitLog, directory: str) -> None:
        """A put whose last frame is missing at the end of the log: cut its frames."""
        if not self._open_frames:
            return
        start = self._open_frames[0][0]
        log.warning("store %s: the last put was cut short (%d of its frames on disk, its last "
                    "frame missing); removing it from physical offset %d", directory,
                    len(self._open_frames), start)
        commit_log.truncate_to(start)
        crash_point("recovery.put_cut")
        self._open_frames = []
        self._open_entries = {}
        self._tombstones = []
