"""Deleting a topic from a store: a tombstone record in the log, its queues dropped.
Owns the tombstone topic, the deleted-topics file and dropping a topic's consume queues.

A deletion is a record (``TOPIC_DELETED``, its body the topic's name) written like any
other: a follower copying the log, and a recovery replaying it, meet it at the same place
and drop the topic's queues there (``forget``).  What the topic held before the tombstone
is garbage from then on: retention gives its segments back (``RetentionPolicy.deleted``),
and a topic created again with the name starts empty at offset 0 -- a new incarnation,
whose records lie after the tombstone (Kafka's topic ids, KIP-516, by position).  The
tombstones are also kept in ``deleted_topics.json`` while any segment before them is.
"""
from __future__ import annotations

import json
import os

from raymq.storage.fileutil import atomic_write, fsync_dir
from raymq.storage.queueindex import QueueIndex
from raymq.storage.records import Record, RecordBatch

#: The tombstones' queue (queue 0): a record per deletion, its body the topic's name.
TOPIC_DELETED = "RMQ_SYS_TOPIC_DELETED"
_FILE = "deleted_topics.json"


def read_deleted(directory: str) -> dict[str, int]:
    """topic -> the log offset of its last tombstone ({} before any deletion)."""
    try:
        with open(os.path.join(directory, _FILE), "rb") as f:
            return {str(t): int(p) for t, p in json.loads(f.read()).items()}
    except FileNotFoundError:
        return {}


def write_deleted(directory: str, deleted: dict[str, int]) -> None:
    atomic_write(os.path.join(directory, _FILE), json.dumps(deleted, sort_keys=True).encode())


def tombstone(topic: str, also=()) -> RecordBatch:
    """The put deleting ``topic``: its tombstone, then ``also`` (records that must go with
    it, all or nothing: a shard's own note of the deletion)."""
    return RecordBatch.from_records([Record(TOPIC_DELETED, 0, topic.encode()), *also])


def delete(store, topic: str, also=(), then=None) -> bool:
    """Delete ``topic`` from ``store`` (a ``MessageStore``): its tombstone put (with
    ``also``), then its queues dropped (``forget``) and ``then()`` -- all before any write
    of the topic is taken again: its writes are refused meanwhile (one landing between
    the tombstone and the forget was acknowledged, then lost with its queue, and left a
    record the store could not be opened with).  A count per topic: two deletions of it
    at once (the janitor's and a client's) both hold it off.  Whether it had queues."""
    if not any(t == topic for t, _q in store._cq.queues):  # (nothing to write then)
        return False
    deleting = store._deleting
    with store._write_lock:
        deleting[topic] = deleting.get(topic, 0) + 1
    try:
        phys = store.put(tombstone(topic, also)).phys_offsets[0]
        with store._write_lock:
            store.retention.tombstones = forget(store.directory, store._cq, topic, phys)
        if then is not None:
            then()
    finally:
        with store._write_lock:
            deleting[topic] -= 1
            if not deleting[topic]:
                del deleting[topic]
    store.retention.forget_queues(topic)
    return True


def forget(directory: str, queues: QueueIndex, topic: str, phys: int) -> dict[str, int]:
    """A tombstone of ``topic`` at ``phys``: note it durably, then drop the topic's consume
    queues (files and directory).  Idempotent; the tombstones now.  A crash anywhere in
    it is finished by ``settle`` when the store opens again."""
    deleted = read_deleted(directory)
    if deleted.get(topic, -1) < phys:
        deleted[topic] = phys
        write_deleted(directory, deleted)
    for key in [k for k in queues.queues if k[0] == topic]:
        cq = queues.queues.pop(key)
        cq.close()
        if os.path.exists(cq.path):
            os.unlink(cq.path)
    tdir = os.path.join(queues.root, topic)
    if os.path.isdir(tdir):
        for name in os.listdir(tdir):
            os.unlink(os.path.join(tdir, name))
        os.rmdir(tdir)
        fsync_dir(queues.root)
    return deleted


def settle(store) -> None:
    """(on open) Finish every tombstone of the log a crash left unfinished: one not noted
    yet (its record covered by a checkpoint before its queues were dropped), or one noted
    whose topic still has queues, all of them older than it (a crash after the note, in
    the middle of ``forget``).  A topic with a record after its tombstone was created
    again: its queues are the new topic's and stay.  The store's retention is told."""
    deleted = read_deleted(store.directory)
    for m in store.scan_queue(TOPIC_DELETED, 0):
        topic, phys = bytes(m.body).decode(), m.phys_offset
        held = [cq for (t, _q), cq in store._cq.queues.items() if t == topic]
        # (the note alone does not say its queues are gone: noted first, they may not be)
        if any(cq.last_phys > phys for cq in held):
            continue
        if held or deleted.get(topic, -1) < phys:
            deleted = forget(store.directory, store._cq, topic, phys)
            store.retention.forget_queues(topic)
    store.retention.tombstones = deleted
