"""Child process for crash tests: writes until killed, reporting what was acknowledged.

python -m tests.crash_writer store DIR SEED   -> lines "ACK <batch> <first queue offset> <n>"
python -m tests.crash_writer offsets PATH     -> lines "ACK <i>"
"""
from __future__ import annotations

import random
import sys

from raymq.storage import MessageStore, RecordBatch, StoreConfig
from raymq.storage.offsets import OffsetStore


def batch_body(b: int, i: int, n: int) -> bytes:
    return f"b{b}-{i}-{n}|".encode() + bytes(200)


def write_store(directory: str, seed: int) -> None:
    rng = random.Random(seed)
    cfg = StoreConfig(flush_mode="sync", segment_size_bytes=1024 * 1024,
                      max_message_bytes=4096, max_frame_bytes=4096 + 128 * 1024)
    store = MessageStore(directory, cfg)
    b = 0
    while True:
        n = rng.randint(1, 300)
        res = store.put(RecordBatch("crash", 0, [batch_body(b, i, n) for i in range(n)]))
        if res.status.name != "PUT_OK":
            raise SystemExit(f"unexpected status {res.status}")
        sys.stdout.write(f"ACK {b} {res.queue_offsets[0]} {n}\n")
        sys.stdout.flush()
        b += 1


def write_offsets(path: str) -> None:
    store = OffsetStore(path)
    i = store.get("g", 0)
    while True:
        i += 1
        store.update({"g": i, "h": -i, **{f"pad{k}": i for k in range(50)}})
        sys.stdout.write(f"ACK {i}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1] == "store":
        write_store(sys.argv[2], int(sys.argv[3]))
    else:
        write_offsets(sys.argv[2])
