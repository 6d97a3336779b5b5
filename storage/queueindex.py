"""The consume queues of one store, by (topic, queue id), created on first use.
Owns their directory layout, the queue offsets a put gets, and indexing a put's frames.

Layout: ``<root>/<topic>/<queue id>``, one ``ConsumeQueue`` file each.  A put
over several queues gets its queue offsets and index groups from
``assign_offsets`` and its entries appended, frame by frame, by ``dispatch``.
"""
from __future__ import annotations

import os
import struct

import numpy as np

from raymq.storage.consumequeue import CQ_ENTRY, ConsumeQueue
from raymq.storage.faults import crash_point
from raymq.storage.fileutil import fsync_dir
from raymq.storage.queuefiles import QueueFiles
from raymq.storage.records import EncodedFrame, RecordBatch

#: Puts of at most this many records to several queues index them record by record.
SMALL_PUT = 64
_CQ_PACK = struct.Struct("<qiq").pack  # one CQ_ENTRY
assert struct.calcsize("<qiq") == CQ_ENTRY.itemsize


class QueueIndex:
    """Consume queues by (topic, queue id), created on first use.

    Not thread-safe for writers: the store serialises ``get_or_create``,
    ``assign_offsets`` and ``dispatch`` under its write lock.
    """

    def __init__(self, root: str, max_open_files: int):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.queues: dict[tuple[str, int], ConsumeQueue] = {}
        self.files = QueueFiles(max_open_files)  # the queues' open files, LRU

    def load(self) -> None:
        for topic in sorted(os.listdir(self.root)):
            tdir = os.path.join(self.root, topic)
            if not os.path.isdir(tdir):
                continue
            for name in sorted(os.listdir(tdir)):
                if name.isdigit():
                    qid = int(name)
                    self.queues[(topic, qid)] = ConsumeQueue(os.path.join(tdir, name), topic,
                                                             qid, files=self.files)

    def get_or_create(self, topic: str, qid: int) -> ConsumeQueue:
        cq = self.queues.get((topic, qid))
        if cq is None:
            tdir = os.path.join(self.root, topic)
            fresh_dir = not os.path.isdir(tdir)
            os.makedirs(tdir, exist_ok=True)
            cq = ConsumeQueue(os.path.join(tdir, str(qid)), topic, qid, files=self.files)
            crash_point("queue.created")
            fsync_dir(tdir)
            if fresh_dir:
                fsync_dir(self.root)
            self.queues[(topic, qid)] = cq
        return cq

    def trim_to_checkpoint(self, checkpoint: int) -> int:
        """Cut every queue back to the entries a checkpoint at ``checkpoint`` vouches for
        (``ConsumeQueue.checkpointed_count``); return how many entries went."""
        dropped = 0
        for cq in self.queues.values():
            keep = cq.checkpointed_count(checkpoint)
            if keep < cq.count:
                dropped += cq.count - keep
                cq.truncate_to(keep)
        return dropped

    @property
    def sync_failed(self) -> bool:
        """An fsync of one of the queues failed: no checkpoint may be written any more."""
        return any(cq.sync_error is not None for cq in self.queues.values())

    def close(self) -> None:
        self.files.close_all()
        self.queues.clear()

    # ------------------------------------------------------------------ put
    def assign_offsets(self, batch: RecordBatch):
        """Queue offsets for the batch, and its per-queue index groups (None: one queue).

        Groups are lists of record indexes for a put of at most ``SMALL_PUT``
        records, index arrays for a bigger one.
        """
        n = len(batch)
        topics, qids = batch.topics, batch.queue_ids
        if not isinstance(topics, list) and not isinstance(qids, list):
            start = self.get_or_create(topics, qids).count
            return np.arange(start, start + n, dtype=np.int64), None
        keys = list(zip(batch.column("topics"), batch.column("queue_ids")))
        ids_of = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        if len(ids_of) == 1:
            start = self.get_or_create(*keys[0]).count
            return np.arange(start, start + n, dtype=np.int64), None
        if n <= SMALL_PUT:  # record by record: numpy costs more than it saves here
            next_offset, groups, qoffs = {}, {}, []
            for i, key in enumerate(keys):
                at = next_offset.get(key)
                if at is None:
                    at = self.get_or_create(*key).count
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
            start = self.get_or_create(*key).count
            qoffs[idx] = np.arange(start, start + len(idx))
            groups[key] = idx
        return qoffs, groups

    def dispatch(self, batch: RecordBatch, groups, lo: int, hi: int, phys: np.ndarray,
                 frame: EncodedFrame) -> None:
        """Index records ``[lo, hi)`` of ``batch``, written as ``frame`` at ``phys``."""
        if groups is not None and len(batch) <= SMALL_PUT:  # index groups are lists (a small put)
            phys_l, sizes, tags = phys.tolist(), frame.rec_lens.tolist(), frame.tag_codes.tolist()
            for key, idx in groups.items():
                part = [i - lo for i in idx if lo <= i < hi]
                if part:
                    self.get_or_create(*key).append(
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
            self.get_or_create(*key).append(entries.tobytes(), int(phys[-1]))
            return
        for key, idx in groups.items():
            part = idx[(idx >= lo) & (idx < hi)] - lo
            if len(part):
                self.get_or_create(*key).append(entries[part].tobytes(), int(phys[part[-1]]))
