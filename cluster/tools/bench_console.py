"""``raymq bench console``: a console page must not slow the broker, and every page must
answer quickly on a large cluster.

- ``console.produce_ratio``: plain batched produce while a console polls every page once
  a second, over the same produce without it (6 alternating slices of ~3 s each at scale
  1, one run); the console runs as an operator runs it, ``raymq console`` in a process of
  its own.
- ``console.slowest_page_ms``: on a cluster with 1,000 topics and 100 groups (committed
  offsets on ten topics each), each page's JSON read three times; the slowest page's
  median.  Also ``console.page_ms`` per page.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from raymq.tools.bench import Bench, _alternating, _bench_cluster, _teardown_cluster, suite
from raymq.tools.console import PAGES


class _ConsoleProcess:
    """``raymq console --read-only --port 0`` in a process of its own, as an operator runs
    it, attached to the benchmark's cluster."""

    def __init__(self, address: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "raymq.tools.cli", "--address", address, "console",
             "--read-only", "--port", "0"], stdout=subprocess.PIPE, text=True,
            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        first = self.proc.stdout.readline()
        if not first.startswith("RayMQ console: "):
            self.stop()
            raise RuntimeError(f"raymq console did not start: {first!r}")
        self.url = first.split(": ", 1)[1].strip()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)  # (as Ctrl-C: it stops its server and leaves)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class _Poller:
    """Reads every page of a console once a second while ``on`` is set."""

    def __init__(self, url: str):
        self.url, self.on, self.reads = url, threading.Event(), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.on.wait(0.1):
                continue
            began = time.monotonic()
            for page in PAGES:
                with urllib.request.urlopen(f"{self.url}api/{page}", timeout=60) as r:
                    r.read()
                self.reads += 1
            self._stop.wait(max(0.0, 1.0 - (time.monotonic() - began)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def page_ms(url: str, page: str, reads: int = 3) -> float:
    """The median of ``reads`` reads of a page's JSON, in ms."""
    times = []
    for _ in range(reads):
        began = time.perf_counter()
        with urllib.request.urlopen(f"{url}api/{page}", timeout=120) as r:
            r.read()
        times.append((time.perf_counter() - began) * 1000)
    return sorted(times)[len(times) // 2]


@suite("console")
def bench_console(b: Bench) -> None:
    from raymq.message import Message
    from raymq import rpc
    mq, data = _bench_cluster(b, "console")
    console = _ConsoleProcess(rpc.gcs_address())
    try:
        url = console.url
        mq.create_topic("bench", queues=4)
        p = mq.producer("bench-console")
        batch = [Message("bench", os.urandom(256)) for _ in range(100)]
        began = time.perf_counter()
        for _ in range(20):  # warm-up, and how many batches make a 2-second slice
            p.send_batch(batch)
        per_s = 20 / (time.perf_counter() - began)
        poller = _Poller(url)
        slices, per_slice = 6, max(2, int(per_s * 3.0 * b.scale))
        b.progress(f"console: {slices * per_slice * 100} messages produced with and as many "
                   f"without the console polling every page once a second")

        def polled():
            poller.on.set()
            for _ in range(per_slice):
                p.send_batch(batch)
            poller.on.clear()
        with_s, without_s = _alternating(slices, polled, lambda: [
            p.send_batch(batch) for _ in range(per_slice)])
        poller.stop()
        n = slices * per_slice * 100
        b.emit("console.produce_polled", n / with_s, "msgs/s", n=n, batch=100,
               page_reads=poller.reads)
        b.emit("console.produce_alone", n / without_s, "msgs/s", n=n, batch=100)
        b.ratio("console.produce_ratio", "console.produce_polled", "console.produce_alone",
                target=0.95)
        _large_cluster(b, mq, url)
        p.close()
    finally:
        console.stop()
        mq.close()
        _teardown_cluster(data)


def _large_cluster(b: Bench, mq, url: str) -> None:
    topics, groups = b.n(1_000, 50), b.n(100, 10)
    b.progress(f"console: {topics} topics and {groups} groups, then every page read 3 times")
    names = [f"bt{i:04d}" for i in range(topics)]
    for name in names:
        mq.create_topic(name, queues=1)
    routes = mq.routes_for(set(names))
    for g in range(groups):
        by_shard: dict[int, dict] = {}
        for name in names[g * 10 % topics:][:10]:
            by_shard.setdefault(routes[name][0], {})[(name, 0)] = 0
        for shard, offsets in by_shard.items():
            mq.shard(shard).call("commit_offsets", f"bg{g:03d}", offsets, timeout_s=60)
    worst = 0.0
    for page in PAGES:
        ms = page_ms(url, page)
        b.emit("console.page_ms", ms, "ms", page=page, topics=topics, groups=groups)
        worst = max(worst, ms)
    b.emit("console.slowest_page_ms", worst, "ms", topics=topics, groups=groups, target=500)
