"""``raymq bench retention``: a producer at full rate with a retention of 30 s (issue 35).

Two shards in this process (no Ray: what is measured is the shard and its store), one
with ``retention_ms`` 30 s and its janitor running every second, one that keeps
everything; a producer thread sends to them in alternating slices (so drift hits both
alike) for ``3 min x scale`` in all.  Reported:

- ``retention.disk_bound_ratio``: the most disk the retained shard used over the most it
  sent in any 30 s (target <= 2);
- ``retention.produce_ratio``: its throughput over the other's (target >= 0.95);
- ``retention.send_p99_ratio``: its p99 send latency over the other's (target <= 1.5);
- ``retention.reset_by_time_ms``: finding, for a group of 100 queues of 10,000 messages
  each, the offsets at a time (what ``reset-offsets --to-datetime`` asks each shard)
  (target <= 500).
"""
from __future__ import annotations

import os
import shutil
import threading
import time

import numpy as np

from raymq.tools.bench import Bench, suite

RETENTION_MS = 30_000
SLICE_S = 15.0
_BODY = 1024
_BATCH = 64


def _disk_bytes(path: str) -> int:
    total = 0
    for d, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(d, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


@suite("retention", long=True)
def bench_retention(b: Bench) -> None:
    from raymq.actors.shard import BrokerShard
    from raymq.storage import RecordBatch

    root = b.tempdir("retention")
    # (no disk watermark: this machine's disk may be fuller than the clean ratio, and what is
    # measured is retention by time)
    common = {"num_shards": 1, "segment_size_bytes": 16 << 20, "retention_check_ms": 1000,
              "disk_clean_ratio": 1.0, "disk_full_ratio": 1.0}
    shards = {name: BrokerShard(0, {**common, "retention_ms": ms},
                                directory=os.path.join(root, name))
              for name, ms in (("retained", RETENTION_MS), ("kept", 10 * 24 * 3600_000))}
    for sh in shards.values():
        sh.set_routes([("bench", 0)])
    batch = RecordBatch("bench", 0, [os.urandom(_BODY) for _ in range(_BATCH)])
    sent = {k: 0 for k in shards}
    busy = {k: 0.0 for k in shards}
    lat = {k: [] for k in shards}
    peak = [0]
    marks: list[tuple[float, int]] = [(time.perf_counter(), 0)]  # (when, retained bytes sent)
    stop = threading.Event()

    def sample() -> None:
        path = os.path.join(root, "retained")
        while not stop.wait(0.25):
            peak[0] = max(peak[0], _disk_bytes(path))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    total_s = 180.0 * b.scale
    slices = max(2, int(total_s / SLICE_S) // 2 * 2)
    b.progress(f"retention: {slices} slices of {SLICE_S:.0f} s, sends of {_BATCH} x {_BODY} B, "
               f"retention {RETENTION_MS // 1000} s on one shard, none on the other")
    try:
        for k in range(slices):
            name = "retained" if k % 2 == 0 else "kept"
            sh = shards[name]
            t_end = time.perf_counter() + SLICE_S
            t0 = time.perf_counter()
            while True:
                s0 = time.perf_counter()
                sh.send(batch)
                s1 = time.perf_counter()
                lat[name].append(s1 - s0)
                sent[name] += _BATCH * _BODY
                if name == "retained" and len(lat[name]) % 64 == 0:
                    marks.append((s1, sent[name]))
                if s1 >= t_end:
                    break
            busy[name] += time.perf_counter() - t0
            b.progress(f"retention: slice {k + 1}/{slices} ({name}): "
                       f"{sent[name] / busy[name] / 1e6:.1f} MB/s so far; the retained shard "
                       f"deleted {shards['retained'].store.retention.deleted_segments} segments, "
                       f"uses {peak[0] / 1e6:.0f} MB at most")
    finally:
        stop.set()
        sampler.join()
    rate = {k: sent[k] / busy[k] for k in shards}
    deleted = shards["retained"].store.retention.deleted_segments
    b.emit("retention.produce_retained", rate["retained"] / 1e6, "MB/s",
           segments_deleted=deleted)
    b.emit("retention.produce_kept", rate["kept"] / 1e6, "MB/s")
    b.ratio("retention.produce_ratio", "retention.produce_retained", "retention.produce_kept")
    b.emit("retention.disk_peak", peak[0] / 1e6, "MB")
    # the most the retained shard sent in any 30 s (it sends every other slice)
    t, c = np.array([m[0] for m in marks]), np.array([m[1] for m in marks])
    before = np.interp(t - RETENTION_MS / 1000, t, c, left=0)
    b.emit("retention.bytes_in_retention", float((c - before).max()) / 1e6, "MB",
           note="the most the retained shard sent in 30 s")
    b.ratio("retention.disk_bound_ratio", "retention.disk_peak", "retention.bytes_in_retention")
    for k in shards:
        b.emit(f"retention.send_p99_{k}", float(np.percentile(lat[k], 99)) * 1000, "ms",
               sends=len(lat[k]))
    b.ratio("retention.send_p99_ratio", "retention.send_p99_retained", "retention.send_p99_kept")
    for sh in shards.values():
        sh.close()
    shutil.rmtree(root, ignore_errors=True)
    _bench_reset_by_time(b)


def _bench_reset_by_time(b: Bench) -> None:
    from raymq.actors.shard import BrokerShard
    from raymq.storage import RecordBatch

    root = b.tempdir("reset")
    queues = [("bench", q) for q in range(100)]
    n = b.n(10_000, 1000)
    sh = BrokerShard(0, {"num_shards": 1, "flush_mode": "async"}, directory=root)
    try:
        sh.set_routes(queues)
        b.progress(f"retention: 100 queues of {n} messages, then their offsets at a time")
        t_first = int(time.time() * 1000)
        for start in range(0, n, 1000):
            for t, q in queues:
                sh.send(RecordBatch(t, q, [b"x" * 100] * 1000))
        t_mid = t_first + (int(time.time() * 1000) - t_first) // 2
        sh.queue_bounds(queues, [t_mid] * 100)  # (warm: the files opened once)
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            got = sh.queue_bounds(queues, [t_mid] * 100)
            runs.append(time.perf_counter() - t0)
        assert all(0 < v[2] < n for v in got.values())
        b.emit("retention.reset_by_time_ms", float(np.median(runs)) * 1000, "ms", queues=100,
               messages_per_queue=n, runs=len(runs))
    finally:
        sh.close()
        shutil.rmtree(root, ignore_errors=True)
