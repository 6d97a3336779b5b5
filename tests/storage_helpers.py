"""Helpers shared by storage tests (no Ray)."""
from __future__ import annotations

import os

from raymq.storage import RecordBatch, StoreConfig

SMALL = StoreConfig(segment_size_bytes=256 * 1024, max_message_bytes=4096,
                    max_frame_bytes=4096 + 128 * 1024, flush_interval_ms=50)


def body(i: int, size: int = 200) -> bytes:
    head = f"msg-{i:08d}|".encode()
    return head + bytes((i + k) % 251 for k in range(size - len(head)))


def batch(topic: str, queue_id: int, start: int, n: int, size: int = 200) -> RecordBatch:
    return RecordBatch(topic, queue_id, [body(i, size) for i in range(start, start + n)])


def commitlog_files(directory: str) -> list[str]:
    cl = os.path.join(directory, "commitlog")
    return [os.path.join(cl, n) for n in sorted(os.listdir(cl))]
