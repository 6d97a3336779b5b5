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


def forget(directory: str, queues: QueueIndex, topic: str, phys: int) -> dict[str, int]:
    """A tombstone of ``topic`` at ``phys``: note it durably, then drop the topic's consume
    queues (files and directory).  Idempotent; the tombstones now."""
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
    """(on open) Apply every tombstone of the log not noted yet: a deletion whose record a
    checkpoint covered before its queues were dropped (a crash in between)."""
    deleted = read_deleted(store.directory)
    for m in store.scan_queue(TOPIC_DELETED, 0):
        topic = bytes(m.body).decode()
        if deleted.get(topic, -1) < m.phys_offset:
            deleted = forget(store.directory, store._cq, topic, m.phys_offset)
