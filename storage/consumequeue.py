"""Consume queues: one file of fixed 20-byte entries per (topic, queue).
Owns one queue file: its entry format, appends, reads, truncation and fsync.

Entry i is the message at logical (queue) offset i: commit-log offset (i64),
record size (i32) and tag hash (i64) -- for scheduled messages the tag hash is
the deliver time in ms, as in RocketMQ.  The files are an index: they are
written without fsync and rebuilt from the commit log past the last
checkpoint on start.
"""
from __future__ import annotations

import logging
import os

import numpy as np

log = logging.getLogger("raymq.storage")

CQ_ENTRY = np.dtype([("phys", "<i8"), ("size", "<i4"), ("tag", "<i8")])
CQ_ENTRY_BYTES = CQ_ENTRY.itemsize  # 20


class ConsumeQueue:
    def __init__(self, path: str, topic: str, queue_id: int):
        self.path = path
        self.topic = topic
        self.queue_id = queue_id
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        size = os.fstat(self.fd).st_size
        if size % CQ_ENTRY_BYTES:
            keep = size - size % CQ_ENTRY_BYTES
            log.warning("consume queue %s: cutting a partial entry (%d bytes) at %d",
                        path, size - keep, keep)
            os.ftruncate(self.fd, keep)
            size = keep
        self.count = size // CQ_ENTRY_BYTES
        self.last_phys = -1
        if self.count:
            self.last_phys = int(self.read(self.count - 1, 1)["phys"][0])
        self.dirty = False

    def append(self, entries: bytes, last_phys: int) -> None:
        written = os.write(self.fd, entries)
        if written != len(entries):  # keep the file whole entries only
            os.ftruncate(self.fd, self.count * CQ_ENTRY_BYTES)
            raise OSError(f"short write to consume queue {self.path}: {written} of "
                          f"{len(entries)} bytes")
        self.count += len(entries) // CQ_ENTRY_BYTES
        self.last_phys = last_phys
        self.dirty = True

    def read(self, start: int, max_entries: int) -> np.ndarray:
        """Entries [start, start + max_entries) that exist (a copy)."""
        start = max(0, start)
        n = min(max_entries, self.count - start)
        if n <= 0:
            return np.empty(0, CQ_ENTRY)
        data = os.pread(self.fd, n * CQ_ENTRY_BYTES, start * CQ_ENTRY_BYTES)
        return np.frombuffer(data, CQ_ENTRY, len(data) // CQ_ENTRY_BYTES)

    def truncate_past(self, log_end: int) -> int:
        """Drop entries whose record does not end within ``log_end``; return how many."""
        if not self.count or self.last_phys < 0:
            return 0
        tail = self.read(max(0, self.count - 4096), 4096)
        ends = tail["phys"] + tail["size"]
        if ends[-1] <= log_end:
            return 0
        allp = self.read(0, self.count)
        keep = int(np.searchsorted(allp["phys"] + allp["size"], log_end, side="right"))
        dropped = self.count - keep
        self.truncate_to(keep)
        return dropped

    def truncate_to(self, count: int) -> None:
        os.ftruncate(self.fd, count * CQ_ENTRY_BYTES)
        self.count = count
        self.last_phys = int(self.read(count - 1, 1)["phys"][0]) if count else -1
        self.dirty = True

    def sync(self) -> None:
        if self.dirty:
            self.dirty = False
            os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)
