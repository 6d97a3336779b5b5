"""Child process for crash tests: writes until killed, reporting what was acknowledged.

python -m tests.crash_writer store DIR SEED   -> lines "ACK <batch> <first queue offset> <n>"
python -m tests.crash_writer offsets PATH     -> lines "ACK <i>"
python -m tests.crash_writer points DIR SEED PUTS -> lines "ACK <put> <queue offset of each
    record, comma-separated>" for the puts of ``plan_puts(SEED, PUTS)``, a checkpoint every
    ``CHECKPOINT_EVERY`` puts, then "DONE"
python -m tests.crash_writer open DIR         -> opens (recovers) the store, "OPENED", closes

The ``points`` and ``open`` modes are run with ``RAYMQ_STORAGE_CRASH_AT`` set
(``raymq.storage.faults``): the process dies at that point of the production code.
"""
from __future__ import annotations

import random
import sys

from raymq.storage import MessageStore, RecordBatch, StoreConfig
from raymq.storage.offsets import OffsetStore

CHECKPOINT_EVERY = 5
POINTS_CONFIG = StoreConfig(flush_mode="sync", segment_size_bytes=256 * 1024,
                            max_message_bytes=4096, max_frame_bytes=4096 + 128 * 1024)


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


def put_body(p: int, i: int, n: int) -> bytes:
    return f"p{p}-{i}-{n}|".encode() + bytes(150)


def plan_puts(seed: int, count: int) -> list[list[tuple[str, int]]]:
    """(topic, queue id) of every record of every put: mostly small puts to one queue,
    some over several queues, some of several frames (600 records), a new topic every
    ninth put."""
    rng = random.Random(seed)
    plan = []
    for p in range(count):
        kind = rng.random()
        if p % 9 == 8:
            plan.append([(f"N{p}", 0)] * rng.randint(1, 5))
        elif kind < 0.7:
            plan.append([(rng.choice("AB"), rng.randint(0, 1))] * rng.randint(1, 20))
        elif kind < 0.9:
            plan.append([(rng.choice("ABC"), rng.randint(0, 1))
                         for _ in range(rng.randint(2, 30))])
        else:
            plan.append([("BIG", 0)] * 600)
    return plan


def write_points(directory: str, seed: int, puts: int) -> None:
    store = MessageStore(directory, POINTS_CONFIG, background=False)
    for p, keys in enumerate(plan_puts(seed, puts)):
        n = len(keys)
        res = store.put(RecordBatch([t for t, _ in keys], [q for _, q in keys],
                                    [put_body(p, i, n) for i in range(n)]))
        if res.status.name != "PUT_OK":
            raise SystemExit(f"unexpected status {res.status}")
        sys.stdout.write(f"ACK {p} {','.join(map(str, res.queue_offsets))}\n")
        sys.stdout.flush()
        if p % CHECKPOINT_EVERY == CHECKPOINT_EVERY - 1:
            store.checkpoint()
    sys.stdout.write("DONE\n")
    store.close()


def open_store(directory: str) -> None:
    MessageStore(directory, POINTS_CONFIG, background=False).close()
    sys.stdout.write("OPENED\n")


def cut(directory: str, phys: int) -> None:
    from raymq.storage.replication import cut_store
    cut_store(directory, POINTS_CONFIG.segment_size_bytes, phys)
    sys.stdout.write("CUT\n")


def retain(directory: str) -> None:
    """Ten days later, retention of a day deletes every segment but the last."""
    import time
    from raymq.storage.clock import ManualClock
    from raymq.storage.retention import RetentionPolicy, TopicRetention
    clock = ManualClock(int(time.time() * 1000) + 10 * 24 * 3600_000)
    with MessageStore(directory, POINTS_CONFIG, clock, background=False) as store:
        store.checkpoint()
        verdict = store.retention.apply(RetentionPolicy(TopicRetention(24 * 3600_000)),
                                        clock.now_ms())
    sys.stdout.write(f"RETAINED {verdict.count}\n")


if __name__ == "__main__":
    if sys.argv[1] == "store":
        write_store(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "points":
        write_points(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "open":
        open_store(sys.argv[2])
    elif sys.argv[1] == "retain":
        retain(sys.argv[2])
    elif sys.argv[1] == "cut":
        cut(sys.argv[2], int(sys.argv[3]))
    else:
        write_offsets(sys.argv[2])
