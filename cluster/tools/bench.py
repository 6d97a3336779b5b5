"""``raymq bench``: the benchmark suites (storage, produce, consume, txmsg, ...) and their
reporting, one JSON object per line on stdout; Ray is reached through ``raymq.rpc``.

Every figure with a baseline is printed with that baseline measured in the
same run and their ratio, because absolute figures drift on shared machines.
Progress goes to stderr.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile
import threading
import time
from typing import Callable

from raymq.actors.protocol import SendReply

SUITES: dict[str, Callable[["Bench"], None]] = {}


#: Suites a bare ``raymq bench`` leaves out (long runs: name them to run them).
LONG_SUITES: set[str] = set()


def suite(name: str, *, long: bool = False):
    def register(fn):
        SUITES[name] = fn
        if long:
            LONG_SUITES.add(name)
        return fn
    return register


class Bench:
    def __init__(self, *, scale: float = 1.0, workdir: str | None = None, out=None):
        self.scale = scale
        self.workdir = workdir
        self.out = out or sys.stdout
        self.results: dict[str, float] = {}

    def n(self, count: int, minimum: int = 1) -> int:
        return max(minimum, int(count * self.scale))

    def emit(self, metric: str, value: float, unit: str, **params) -> None:
        self.results[metric] = value
        line = {"metric": metric, "value": round(float(value), 3), "unit": unit, "params": params}
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()

    def ratio(self, metric: str, num: str, den: str, **params) -> None:
        self.emit(metric, self.results[num] / self.results[den], "ratio",
                  numerator=num, denominator=den, **params)

    @staticmethod
    def progress(text: str) -> None:
        print(f"[bench] {text}", file=sys.stderr, flush=True)

    def tempdir(self, name: str) -> str:
        return tempfile.mkdtemp(prefix=f"raymq-bench-{name}-", dir=self.workdir)


def threads_timed(work: Callable[[int], object], threads: int) -> float:
    """Seconds for ``threads`` threads to run ``work(k)`` each (k: the thread's number)."""
    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class MachineCpu:
    """The whole machine's CPU time over a stretch (Linux ``/proc/stat``; zero elsewhere).

    ``busy_s``: CPU seconds spent by every process and the kernel (the client,
    the shards and Ray's own processes alike); ``steal_s``: time the
    hypervisor gave the machine's CPUs to someone else.  On a shared VM,
    steal explains a slow run, and CPU per message stays comparable when
    throughput does not.
    """

    def __init__(self):
        self.busy_s = self.steal_s = 0.0

    @staticmethod
    def _read() -> tuple[float, float]:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return 0.0, 0.0
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        tick = os.sysconf("SC_CLK_TCK")
        return (user + nice + system + irq + softirq) / tick, steal / tick

    def timed(self, fn: Callable[[], None]) -> float:
        """``timed(fn)``, adding the machine's CPU and steal over it."""
        busy, steal = self._read()
        dt = timed(fn)
        busy2, steal2 = self._read()
        self.busy_s += busy2 - busy
        self.steal_s += steal2 - steal
        return dt

    def params(self, messages: int, seconds: float) -> dict:
        if not self.busy_s:
            return {}
        cpus = os.cpu_count() or 1
        return {"cpu_us_per_msg": round(self.busy_s / messages * 1e6, 1),
                "steal_pct": round(100 * self.steal_s / (seconds * cpus), 1)}


@suite("storage")
def bench_storage(b: Bench) -> None:
    from raymq.storage import MessageStore, RecordBatch, StoreConfig

    size = 256
    bodies = [os.urandom(size) for _ in range(1000)]
    cases = [(1, b.n(3000, 100)), (100, b.n(60_000, 1000)), (1000, b.n(200_000, 10_000))]
    for batch_size, n in cases:
        path = b.tempdir("storage")
        try:
            batch = RecordBatch("bench", 0, bodies[:batch_size])
            raw = b"".join(bodies[:batch_size])
            rounds = n // batch_size
            slices = 5  # store and raw baseline alternate, so drift hits both alike
            per_slice = max(1, rounds // slices)
            t_store = t_raw = 0.0
            fd = os.open(os.path.join(path, "raw"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            b.progress(f"storage: sync appends, batches of {batch_size}, {n} records "
                       "(and the raw write+fsync baseline)")
            try:
                with MessageStore(os.path.join(path, "store"),
                                  StoreConfig(flush_mode="sync")) as store:
                    store.put(batch)  # warm up
                    for _ in range(slices):
                        t_store += timed(lambda: [store.put(batch) for _ in range(per_slice)])

                        def raw_rounds():
                            for _ in range(per_slice):
                                os.write(fd, raw)
                                os.fsync(fd)
                        t_raw += timed(raw_rounds)
            finally:
                os.close(fd)
            total = slices * per_slice * batch_size
            b.emit(f"storage.append_sync_b{batch_size}", total / t_store, "appends/s",
                   size=size, n=total, batch=batch_size, flush="sync")
            b.emit(f"storage.raw_write_fsync_b{batch_size}", total / t_raw,
                   "appends/s", size=size, n=total, batch=batch_size)
        finally:
            shutil.rmtree(path, ignore_errors=True)
    for batch_size in (1, 100):
        b.ratio(f"storage.append_sync_b{batch_size}_ratio", f"storage.append_sync_b{batch_size}",
                f"storage.raw_write_fsync_b{batch_size}")
    b.ratio("storage.append_sync_ratio", "storage.append_sync_b1000",
            "storage.raw_write_fsync_b1000")

    n = b.n(300_000, 10_000)
    path = b.tempdir("storage")
    try:
        batch = RecordBatch("bench", 0, bodies)
        rounds = n // 1000
        with MessageStore(path, StoreConfig(flush_mode="async")) as store:
            b.progress(f"storage: async appends, batches of 1000, {n} records")
            dt = timed(lambda: [store.put(batch) for _ in range(rounds)])
            b.emit("storage.append_async", rounds * 1000 / dt, "appends/s", size=size,
                   n=rounds * 1000, batch=1000, flush="async")
            b.progress(f"storage: consume-queue range reads of 1000, {rounds * 1000} records")
            got = [0]

            def read_all():
                for r in range(rounds):
                    got[0] += len(store.read_batch("bench", 0, r * 1000, 1000))
            dt = timed(read_all)
            if got[0] != rounds * 1000:
                raise RuntimeError(f"read {got[0]} of {rounds * 1000} records")
            b.emit("storage.read_cq", got[0] / dt, "entries/s", size=size, n=got[0], batch=1000,
                   what="consume-queue entries resolved to decoded messages")
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _alternating_with_raw(directory: str, record: bytes, n: int,
                          send: Callable[[], object], slices: int = 5) -> tuple[float, float]:
    """``n`` calls of ``send`` and ``n`` raw appends + fsyncs of ``record`` in a file of
    ``directory``, in alternating slices (drift hits both alike): their seconds."""
    per = max(1, n // slices)
    t_send = t_raw = 0.0
    fd = os.open(os.path.join(directory, "bench-raw"), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                 0o644)
    try:
        def raw_rounds():
            for _ in range(per):
                os.write(fd, record)
                os.fsync(fd)
        for _ in range(slices):
            t_send += timed(lambda: [send() for _ in range(per)])
            t_raw += timed(raw_rounds)
    finally:
        os.close(fd)
        os.unlink(os.path.join(directory, "bench-raw"))
    scale = n / (per * slices)
    return t_send * scale, t_raw * scale


def _step_times(b: Bench, mq, metric: str, n: int, send: Callable[[], list]) -> None:
    """Where one request's time goes: ``n`` requests with step stamps on
    (``raymq.storage.steps``, here and in every shard); ``send()`` makes one and returns
    its stamps.  The median microseconds of each step, in the order they come, and of the
    whole request."""
    from statistics import median

    from raymq import rpc
    from raymq.storage import steps
    shards = [mq.shard_handle(i) for i in range(mq.num_shards)]

    def switch(on: bool) -> None:
        for h in shards:
            rpc.call(h.debug_step_times, on, timeout_s=30)
        steps.enable(on)
    switch(True)
    per_step: dict[str, list[float]] = {}
    totals = []
    try:
        for _ in range(n):
            marks = send()
            if marks:
                d = steps.durations(marks)
                for name, us in d.items():
                    per_step.setdefault(name, []).append(us)
                totals.append(sum(d.values()))
    finally:
        switch(False)
    if not totals:
        raise RuntimeError(f"{metric}: no request carried its step stamps")
    b.emit(metric, median(totals), "us", n=len(totals),
           steps_us={k: round(median(v), 1) for k, v in per_step.items()})


def _e2e_consumer(address: str, n: int) -> None:
    """Child process of the e2e benchmark: consume and commit ``n`` messages, print the count."""
    from raymq import rpc
    from raymq.client import connect
    rpc.init(address, logging_level="ERROR")
    mq = connect()
    c = mq.consumer("bench-e2e", ["e2e"])
    print("ready", flush=True)
    got = 0
    while got < n:
        got += len(c.poll(5000, 1.0))
        c.commit()
    print(got, flush=True)
    c.close()


def run(names: list[str], *, scale: float = 1.0, workdir: str | None = None,
        out=None) -> dict[str, float]:
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise SystemExit(f"raymq bench: unknown suite(s) {', '.join(unknown)}; "
                         f"known: {', '.join(SUITES)}")
    bench = Bench(scale=scale, workdir=workdir, out=out)
    for name in names or [n for n in SUITES if n not in LONG_SUITES]:
        bench.progress(f"suite {name}")
        SUITES[name](bench)
    return bench.results


class _Sink:
    """The bare-actor ceiling: receives the same requests and only appends them to a list."""

    def __init__(self):
        from raymq import rpc
        from raymq.actors.channel import Endpoint
        self.items: list = []
        self._endpoint = Endpoint(self, host=rpc.node_ip())

    def endpoint(self):
        return self._endpoint.address, self._endpoint.authkey

    def send(self, batch, *_args):
        start = len(self.items)
        self.items.extend(batch.bodies)
        if len(self.items) > 1_000_000:
            self.items.clear()
        offsets = list(range(start, start + len(batch)))
        return SendReply("SEND_OK", offsets, offsets)

    def put(self, batch, *_args):
        return len(batch)


def _bench_cluster(b: Bench, name: str, **overrides):
    """An embedded local Ray with a fresh RayMQ deployment of its own."""
    from raymq import rpc
    from raymq.client import connect
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rpc.init("local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    data = b.tempdir(name)
    b.progress(f"{name}: RayMQ with {overrides.get('num_shards', 2)} shards, sync flush, "
               f"data in {data}")
    return connect(data_dir=data, **{"num_shards": 2, "flush_mode": "sync", **overrides}), data


def _teardown_cluster(data: str) -> None:
    from raymq import rpc
    from raymq.deploy import undeploy
    undeploy()
    rpc.shutdown()
    shutil.rmtree(data, ignore_errors=True)


@suite("produce")
def bench_produce(b: Bench) -> None:
    import threading

    from raymq import rpc
    from raymq.message import Message, to_batch
    mq, data = _bench_cluster(b, "produce")
    try:
        size = 256
        body = os.urandom(size)
        mq.create_topic("bench", queues=8)
        p = mq.producer("bench")
        n1 = b.n(3000, 200)
        b.progress(f"produce: {n1} single sends, one at a time, and as many raw writes + "
                   "fsyncs of the same record on the same disk (alternating slices)")
        one = Message("bench", body)
        p.send(one)
        t_send, t_raw = _alternating_with_raw(data, body, n1, lambda: p.send(one))
        b.emit("produce.sync_b1", n1 / t_send, "msgs/s", size=size, n=n1, batch=1,
               producers=1)
        b.emit("produce.raw_write_fsync_b1", n1 / t_raw, "appends/s", size=size, n=n1,
               what="os.write + os.fsync of the record, in the cluster's data directory")
        b.ratio("produce.sync_b1_ratio", "produce.sync_b1", "produce.raw_write_fsync_b1")
        _step_times(b, mq, "produce.sync_b1_steps", b.n(1000, 100),
                    lambda: (p.send(one), p.last_steps)[1])

        batch = [Message("bench", body) for _ in range(1000)]
        rounds = b.n(200_000, 10_000) // 1000
        p.send_batch(batch)
        b.progress(f"produce: {rounds} batches of 1000, one producer")
        dt = timed(lambda: [p.send_batch(batch) for _ in range(rounds)])
        b.emit("produce.sync_b1000", rounds * 1000 / dt, "msgs/s", size=size, n=rounds * 1000,
               batch=1000, producers=1)

        producers = [mq.producer(f"bench{k}") for k in range(4)]
        per = max(1, rounds // 4)
        b.progress(f"produce: 4 producers x {per} batches of 1000")

        def run4():
            ts = [threading.Thread(target=lambda q=q: [q.send_batch(batch) for _ in range(per)])
                  for q in producers]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        dt = timed(run4)
        b.emit("produce.sync_b1000_p4", 4 * per * 1000 / dt, "msgs/s", size=size,
               n=4 * per * 1000, batch=1000, producers=4)
        for q in producers:
            q.close()

        # the ceiling: the same producer sending the same batches to bare actors that only
        # append them to a list (no storage, no fsync) -- what the broker side costs; over
        # the producer's own transport, and over Ray calls for reference
        from types import SimpleNamespace

        from raymq.producer import Producer
        from raymq.transport import make_transport
        sinks = [rpc.create_actor(_Sink, num_cpus=0,
                                  max_concurrency=mq.config.shard_max_concurrency)
                 for _ in range(mq.num_shards)]
        sink_calls = [rpc.ActorClient(s) for s in sinks]
        for started in [s.submit("endpoint") for s in sink_calls]:
            started.result()  # all started before anything is timed
        for kind, metric in ((mq.transport.name, "produce.ceiling_b1000"),
                             ("ray", "produce.ceiling_ray_b1000")):
            bare = SimpleNamespace(config=mq.config, routes_for=mq.routes_for,
                                   shard_handle=lambda i: sinks[i],
                                   transport=make_transport(kind, lambda i: sinks[i]))
            sink_producer = Producer(bare, "bench-ceiling")
            sink_producer.send_batch(batch)
            b.progress(f"produce: ceiling, {rounds} batches of 1000 to {len(sinks)} bare actors "
                       f"over the {kind} transport")
            dt = timed(lambda: [sink_producer.send_batch(batch) for _ in range(rounds)])
            sink_producer.close()
            bare.transport.close()
            b.emit(metric, rounds * 1000 / dt, "msgs/s", size=size, n=rounds * 1000,
                   batch=1000, actors=len(sinks), transport=kind,
                   what="same producer, bare actors")
        # and the bare transport: prebuilt request batches, one call at a time
        request = to_batch(batch, [0] * 1000, 0)
        for warmed in [s.submit("put", request) for s in sink_calls]:
            warmed.result()

        def transport():
            for r in range(rounds):
                sink_calls[r % len(sinks)].call("put", request, 1, r + 1)
        dt = timed(transport)
        b.emit("produce.transport_b1000", rounds * 1000 / dt, "msgs/s", size=size,
               n=rounds * 1000, batch=1000, what="prebuilt batches, bare ray calls")
        b.ratio("produce.ceiling_ratio", "produce.sync_b1000", "produce.ceiling_b1000")
        for s in sink_calls:
            s.kill()

        # end to end: a producer (this process) and a consumer that commits (its own
        # process, as applications run them) at the same time
        import subprocess

        n = b.n(200_000, 10_000)
        mq.create_topic("e2e", queues=8)
        msgs = [Message("e2e", body) for _ in range(1000)]
        b.progress(f"e2e: {n} messages produced here, consumed and committed by another process")
        consumer = subprocess.Popen(
            [sys.executable, "-m", "raymq.tools.bench", "e2e-consumer",
             rpc.gcs_address(), str(n)],
            stdout=subprocess.PIPE, text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            env={**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")})
        if consumer.stdout.readline().strip() != "ready":
            raise RuntimeError("the e2e consumer did not start")
        t0 = time.perf_counter()
        for _ in range(n // 1000):
            p.send_batch(msgs)
        consumed = int(consumer.stdout.readline())
        dt = time.perf_counter() - t0
        consumer.wait(60)
        b.emit("e2e.produce_consume", consumed / dt, "msgs/s", size=size, n=consumed,
               consumer="separate process, commit after every poll")
        p.close()
    finally:
        mq.close()
        _teardown_cluster(data)


@suite("txmsg")
def bench_txmsg(b: Bench) -> None:
    import threading

    from raymq.message import Message
    from raymq.transaction_producer import LocalTransactionState, TransactionListener
    mq, data = _bench_cluster(b, "txmsg", txn_timeout_ms=1000, txn_check_interval_ms=500)
    size = 256
    body = os.urandom(size)

    class NoOp(TransactionListener):
        def execute_local_transaction(self, msg, arg):
            return arg

        def check_local_transaction(self, msg):
            return LocalTransactionState.COMMIT_MESSAGE

    try:
        mq.create_topic("tx", queues=8)
        tp = mq.transaction_producer("bench-tx", NoOp())
        commit = LocalTransactionState.COMMIT_MESSAGE
        tp.send_in_transaction(Message("tx", body), commit)
        n1 = b.n(1500, 100)
        b.progress(f"txmsg: {n1} transactions, one producer thread")
        dt = timed(lambda: [tp.send_in_transaction(Message("tx", body), commit)
                            for _ in range(n1)])
        b.emit("txmsg.p1", n1 / dt, "msgs/s", size=size, n=n1, threads=1)
        plain1 = mq.producer("bench-plain1")
        plain1.send(Message("tx", body))
        dt = timed(lambda: [plain1.send(Message("tx", body)) for _ in range(n1)])
        plain1.close()
        b.emit("txmsg.plain_p1", n1 / dt, "msgs/s", size=size, n=n1, threads=1)
        b.ratio("txmsg.p1_ratio", "txmsg.p1", "txmsg.plain_p1")
        _step_times(b, mq, "txmsg.p1_steps", b.n(1000, 100),
                    lambda: (tp.send_in_transaction(Message("tx", body), commit),
                             tp.last_steps)[1])

        def concurrently(fn, per_thread: int, threads: int = 8) -> float:
            return threads_timed(lambda _k: [fn() for _ in range(per_thread)], threads)

        # transactional and plain sends alternate in slices, so that a change in the
        # machine's speed (a shared VM's steal) hits both figures of the ratio alike
        per = b.n(1500, 50)  # ~10 s of sends per figure: steadier than a few seconds
        slices = 5
        per_slice = max(10, per // slices)
        per = per_slice * slices
        p = mq.producer("bench-plain")
        p.send(Message("tx", body))
        b.progress(f"txmsg: 8 threads x {per} transactions on one transaction producer, "
                   f"and 8 x {per} plain single-message sends, in {slices} alternating slices")
        tx_cpu, plain_cpu = MachineCpu(), MachineCpu()
        dt_tx = dt_plain = 0.0
        tx_requests = plain_requests = 0
        for _ in range(slices):
            before = tp._producer.requests
            dt_tx += tx_cpu.timed(lambda: concurrently(
                lambda: tp.send_in_transaction(Message("tx", body), commit), per_slice))
            tx_requests += tp._producer.requests - before
            before = p.requests
            dt_plain += plain_cpu.timed(lambda: concurrently(
                lambda: p.send(Message("tx", body)), per_slice))
            plain_requests += p.requests - before
        b.emit("txmsg.p8", 8 * per / dt_tx, "msgs/s", size=size, n=8 * per, threads=8,
               requests=tx_requests, per_request=round(8 * per / max(tx_requests, 1), 2),
               **tx_cpu.params(8 * per, dt_tx))
        b.emit("txmsg.plain_p8", 8 * per / dt_plain, "msgs/s", size=size, n=8 * per, threads=8,
               requests=plain_requests, per_request=round(8 * per / max(plain_requests, 1), 2),
               **plain_cpu.params(8 * per, dt_plain))
        b.ratio("txmsg.vs_plain_ratio", "txmsg.p8", "txmsg.plain_p8")
        _redis_outbox(b, body, n1, per)

        # the asynchronous API: one thread, up to 256 transactions in flight
        na = b.n(4000, 200)
        b.progress(f"txmsg: {na} transactions from one thread with send_in_transaction_async "
                   "(256 in flight)")

        def async_run():
            window = []
            for _ in range(na):
                window.append(tp.send_in_transaction_async(Message("tx", body), commit))
                if len(window) >= 256:
                    window.pop(0).result()
            for f in window:
                f.result()
        dt = timed(async_run)
        b.emit("txmsg.async_p1", na / dt, "msgs/s", size=size, n=na, threads=1, in_flight=256)

        # check-back: transactions left UNKNOW, settled by the broker asking the producer
        k = 20
        mq.create_topic("txcheck", queues=2)
        c = mq.consumer("bench-check", ["txcheck"])
        sent_at = {}
        b.progress(f"txmsg: {k} UNKNOW transactions settled by check-back "
                   f"(txn_timeout_ms={mq.config.txn_timeout_ms}, "
                   f"check interval {mq.config.txn_check_interval_ms} ms)")
        for i in range(k):
            sent_at[str(i).encode()] = time.time()
            tp.send_in_transaction(Message("txcheck", str(i).encode()),
                                   LocalTransactionState.UNKNOW)
        resolved = {}
        deadline = time.monotonic() + 120
        while len(resolved) < k and time.monotonic() < deadline:
            for m in c.poll(100, 0.2):
                resolved.setdefault(m.body, time.time())
        if len(resolved) < k:  # no figure for a check-back that does not work
            raise RuntimeError(f"txmsg: check-back settled {len(resolved)} of {k} UNKNOW "
                               "transactions in 120 s")
        waits = sorted((resolved[x] - sent_at[x]) * 1000 for x in resolved)
        b.emit("txmsg.checkback_resolution_ms", waits[len(waits) // 2], "ms",
               n=len(waits), txn_timeout_ms=mq.config.txn_timeout_ms,
               check_interval_ms=mq.config.txn_check_interval_ms,
               max_ms=round(waits[-1], 1), statistic="median")
        c.close()
        p.close()
        tp.close()
    finally:
        mq.close()
        _teardown_cluster(data)


# ---------------------------------------------------------------------- delay

def _redis_outbox(b: Bench, body: bytes, n1: int, per: int) -> None:
    """Redis's outbox transaction (``bench_redis``) as txmsg's baseline, with one caller
    and eight: ``txmsg.vs_redis_p1`` / ``_p8`` (skipped, saying why, without Redis)."""
    from raymq.tools.bench_redis import RedisOutbox, unavailable
    why = unavailable()
    if why:
        b.progress(f"txmsg: the Redis outbox baseline is skipped: {why}")
        return
    redis = RedisOutbox(b.workdir)
    try:
        b.progress(f"txmsg: Redis outbox (MULTI HSET + XADD, appendfsync always): {n1} "
                   f"transactions from one caller, 8 x {per} from eight")
        redis.outbox(50, body)  # (warm: connections made)
        dt = redis.outbox(n1, body)
        b.emit("txmsg.redis_outbox_p1", n1 / dt, "msgs/s", size=len(body), n=n1, threads=1,
               appendfsync="always")
        dt = redis.outbox(per, body, threads=8)
        b.emit("txmsg.redis_outbox_p8", 8 * per / dt, "msgs/s", size=len(body), n=8 * per,
               threads=8, appendfsync="always")
    finally:
        redis.close()
    b.ratio("txmsg.vs_redis_p1", "txmsg.p1", "txmsg.redis_outbox_p1")
    b.ratio("txmsg.vs_redis_p8", "txmsg.p8", "txmsg.redis_outbox_p8")

@suite("delay")
def bench_delay(b: Bench) -> None:
    """Timer messages: ``delay.schedule`` msgs/s of batched sends with ``deliver_after_ms``
    over plain batched sends (alternating slices); then 10,000 messages due within the
    same 2 seconds: lateness p50/p99/max (the delivered copy's store time minus its due
    time, both on this machine's clock) and ``delay.early`` (must be 0)."""
    from raymq.message import Message
    mq, data = _bench_cluster(b, "delay", num_shards=2)
    body = os.urandom(256)
    try:
        for t in ("timed", "plain", "burst"):
            mq.create_topic(t, queues=4)
        p = mq.producer("bench-delay")
        per = 100
        slices = 20
        n_batches = max(2, b.n(40_000) // per // slices)  # per slice
        sched = [Message("timed", body, deliver_after_ms=3_600_000) for _ in range(per)]
        plain = [Message("plain", body) for _ in range(per)]
        p.send_batch(sched), p.send_batch(plain)  # warm-up: the timer's first bucket file
        b.progress(f"delay: {slices * n_batches * per} scheduled and as many plain messages, "
                   f"batches of {per}, {slices} alternating slices")
        dt_s, dt_p = _alternating(slices,
                                  lambda: [p.send_batch(sched) for _ in range(n_batches)],
                                  lambda: [p.send_batch(plain) for _ in range(n_batches)])
        n = slices * n_batches * per
        b.emit("delay.schedule", n / dt_s, "msgs/s", n=n, batch=per, size=256,
               deliver_after_ms=3_600_000)
        b.emit("delay.plain", n / dt_p, "msgs/s", n=n, batch=per, size=256)
        b.ratio("delay.schedule_ratio", "delay.schedule", "delay.plain", target=0.8)
        k = b.n(10_000, 1_000)
        b.progress(f"delay: {k} messages due within the same 2 seconds, 3 s from now")
        c = mq.consumer("bench-delay-burst", ["burst"])
        c.poll(1, 0.5)  # joined, queues taken
        first_due = int(time.time() * 1000) + 3_000
        dues = [first_due + (i * 2_000) // k for i in range(k)]
        for lo in range(0, k, 1_000):
            p.send_batch([Message("burst", body, deliver_at_ms=d, key=str(i % 64))
                          for i, d in enumerate(dues[lo:lo + 1_000], lo)])
        late, early, seen = [], 0, set()
        deadline = time.monotonic() + 120
        while len(seen) < k and time.monotonic() < deadline:
            got = c.poll(2_000, 0.5)
            now = int(time.time() * 1000)
            for m in got:
                due = int(m.properties["DELIVER_AT_MS"])
                if m.msg_id in seen:
                    continue
                seen.add(m.msg_id)
                late.append(m.store_ms - due)
                early += (m.store_ms < due) + (now < due)  # (stored, or polled, early)
        c.close()
        if len(seen) < k:
            raise RuntimeError(f"delay: {len(seen)} of {k} due messages delivered in 120 s")
        late.sort()
        b.emit("delay.lateness_p50_ms", late[len(late) // 2], "ms", n=k, window_ms=2_000)
        b.emit("delay.lateness_p99_ms", late[min(k - 1, int(k * 0.99))], "ms", n=k,
               window_ms=2_000, target=50)
        b.emit("delay.lateness_max_ms", late[-1], "ms", n=k, window_ms=2_000)
        b.emit("delay.early", early, "count", n=k)
        p.close()
    finally:
        mq.close()
        _teardown_cluster(data)


# -------------------------------------------------------------------- kafkatx
def _alternating(slices: int, a: Callable[[], None], b_: Callable[[], None]) -> tuple:
    """Total seconds of ``a`` and of ``b_``, run in ``slices`` alternating slices."""
    ta = tb = 0.0
    for _ in range(slices):
        ta += timed(a)
        tb += timed(b_)
    return ta, tb


def _drain_seconds(mq, group: str, topic: str, n: int, isolation: str) -> float:
    """Seconds for a new consumer of ``group`` to poll ``n`` messages of ``topic``, from
    its first message on (joining the group and taking its queues is not reading)."""
    c = mq.consumer(group, [topic], isolation=isolation, read_only=True)
    deadline = time.monotonic() + 300
    got = 0
    while not got and time.monotonic() < deadline:
        got = len(c.poll(1, 1.0))
    t0 = time.perf_counter()
    while got < n and time.monotonic() < deadline:
        got += len(c.poll(10_000, 1.0))
    dt = time.perf_counter() - t0
    c.close()
    if got < n:
        raise RuntimeError(f"kafkatx: {isolation} read {got} of {n} messages in 300 s")
    return dt


@suite("kafkatx")
def bench_kafkatx(b: Bench) -> None:
    """Kafka-style transactions: msgs/s at 10, 100 and 1000 messages a transaction, and at
    a 100 ms commit interval (Kafka's own figure's), over plain batched produce of the
    same batches (alternating slices), read_committed over read_uncommitted consumption,
    and the commit latency of 10 messages over 3 shards."""
    from raymq.message import Message
    mq, data = _bench_cluster(b, "kafkatx", num_shards=3)
    body = os.urandom(256)
    try:
        mq.create_topic("ktx", queues=6)
        kp = mq.transactional_producer("bench-ktx")
        p = mq.producer("bench-plain")
        total = 0
        for per_txn in (10, 100, 1000):
            msgs = [Message("ktx", body) for _ in range(per_txn)]
            n, plain_rate = _txns_vs_batches(b, kp, p, msgs, f"b{per_txn}", size=256)
            total += 2 * n
        # Kafka's own figure (~0.97) is at 100 ms commit intervals: a transaction of as
        # many 1000-message batches as plain batched produce sends in about 100 ms
        per_batch = 1000
        batches = max(1, round(0.1 * plain_rate / per_batch))
        msgs = [Message("ktx", body) for _ in range(per_batch)]
        n_txn = max(1, b.n(3))  # per slice; 4 slices
        b.progress(f"kafkatx: {4 * n_txn} transactions of {batches} batches of {per_batch} "
                   f"(~100 ms of plain produce each) and as many plain batches, in 4 "
                   f"alternating slices")

        def transactional():
            for _ in range(n_txn):
                with kp.transaction():
                    for _ in range(batches):
                        kp.send_batch(msgs)

        def plain():
            for _ in range(n_txn * batches):
                p.send_batch(msgs)
        dt_tx, dt_plain = _alternating(4, transactional, plain)
        n = 4 * n_txn * batches * per_batch
        total += 2 * n
        b.emit("kafkatx.interval100ms", n / dt_tx, "msgs/s", per_txn=batches * per_batch,
               batch=per_batch, n=n, commit_interval_ms=round(dt_tx / (4 * n_txn) * 1000))
        b.emit("kafkatx.plain_interval100ms", n / dt_plain, "msgs/s", batch=per_batch, n=n)
        b.ratio("kafkatx.interval100ms_ratio", "kafkatx.interval100ms",
                "kafkatx.plain_interval100ms")
        b.progress(f"kafkatx: {total} committed messages read with each isolation, 3 times "
                   f"(after a warm-up read), in alternating order")
        _drain_seconds(mq, "bench-read-warm", "ktx", total, "read_uncommitted")
        order = ["read_committed", "read_uncommitted", "read_uncommitted", "read_committed",
                 "read_committed", "read_uncommitted"]
        secs = {"read_committed": 0.0, "read_uncommitted": 0.0}
        for i, iso in enumerate(order):
            secs[iso] += _drain_seconds(mq, f"bench-read-{i}-{iso}", "ktx", total, iso)
        for iso, dt in secs.items():
            b.emit(f"kafkatx.{iso}", 3 * total / dt, "msgs/s", n=total, reads=3)
        b.ratio("kafkatx.read_committed_ratio", "kafkatx.read_committed",
                "kafkatx.read_uncommitted")
        k = b.n(200, 20)
        b.progress(f"kafkatx: commit latency of {k} transactions of 10 messages over 3 shards")
        ten = [Message("ktx", body, key=str(i)) for i in range(10)]
        lat = []
        for _ in range(k):
            kp.begin()
            kp.send_batch(ten)
            t0 = time.perf_counter()
            kp.commit()
            lat.append((time.perf_counter() - t0) * 1000)
        lat.sort()
        shards = len({mq.routes_for({"ktx"})["ktx"][int(r)] for r in range(6)})
        b.emit("kafkatx.commit_p50_ms", lat[len(lat) // 2], "ms", n=k, shards=shards)
        b.emit("kafkatx.commit_p99_ms", lat[min(len(lat) - 1, int(len(lat) * 0.99))], "ms",
               n=k, shards=shards)
        _kafkatx_more(b, mq, kp, p, body, shards)
        kp.close()
        p.close()
    finally:
        mq.close()
        _teardown_cluster(data)


def _txns_vs_batches(b: Bench, kp, p, msgs: list, name: str, **params) -> tuple:
    """Transactions of ``msgs`` against plain batches of them, in 4 alternating slices:
    ``kafkatx.<name>``, ``kafkatx.plain_<name>`` and their ratio; (messages each, the
    plain rate)."""
    per_txn = len(msgs)
    n_txn = max(2, b.n(20_000) // per_txn // 4)  # per slice; 4 slices
    b.progress(f"kafkatx: {4 * n_txn} transactions of {per_txn} messages ({name}) and as many "
               f"plain batches, in 4 alternating slices")

    send = kp.send_batch if os.environ.get("RAYMQ_KTX_SYNC_SENDS") == "1" else kp.send_batch_async

    def transactional():  # (as Kafka's producers send: asynchronously, commit flushes)
        for _ in range(n_txn):
            with kp.transaction():
                send(msgs)

    def plain():
        for _ in range(n_txn):
            p.send_batch(msgs)
    dt_tx, dt_plain = _alternating(4, transactional, plain)
    n = 4 * n_txn * per_txn
    b.emit(f"kafkatx.{name}", n / dt_tx, "msgs/s", per_txn=per_txn, n=n, **params)
    b.emit(f"kafkatx.plain_{name}", n / dt_plain, "msgs/s", batch=per_txn, n=n, **params)
    b.ratio(f"kafkatx.{name}_ratio", f"kafkatx.{name}", f"kafkatx.plain_{name}")
    return n, n / dt_plain


def _kafkatx_more(b: Bench, mq, kp, p, body: bytes, shards: int) -> None:
    """Transactions of 100 messages over every shard, a 1-message transaction's latency,
    and a consume-transform-produce loop, each against its plain counterpart."""
    from raymq.message import Message
    spread = [Message("ktx", body, key=str(i)) for i in range(100)]  # (keys: every queue)
    _txns_vs_batches(b, kp, p, spread, "b100_3shards", shards=shards)

    k = b.n(400, 40)
    b.progress(f"kafkatx: latency of {k} one-message transactions and {k} plain sends, "
               f"alternating")
    one = Message("ktx", body)
    tx_lat, plain_lat = [], []
    send = kp.send if os.environ.get("RAYMQ_KTX_SYNC_SENDS") == "1" else kp.send_async
    for _ in range(k):
        t0 = time.perf_counter()
        with kp.transaction():
            send(one)
        t1 = time.perf_counter()
        p.send(one)
        tx_lat.append(t1 - t0)
        plain_lat.append(time.perf_counter() - t1)
    tx_lat.sort()
    plain_lat.sort()
    b.emit("kafkatx.p1_latency_ms", tx_lat[k // 2] * 1000, "ms", n=k, statistic="p50")
    b.emit("kafkatx.plain_p1_latency_ms", plain_lat[k // 2] * 1000, "ms", n=k,
           statistic="p50")
    b.ratio("kafkatx.p1_latency_ratio", "kafkatx.p1_latency_ms", "kafkatx.plain_p1_latency_ms")

    rounds = max(4, b.n(200, 8))
    b.progress(f"kafkatx: consume-transform-produce, {rounds} rounds of 100 messages with "
               f"and without transactions, alternating")
    mq.create_topic("eos-in", queues=2)
    mq.create_topic("eos-out", queues=2)
    for _ in range(2 * rounds + 2):
        p.send_batch([Message("eos-in", body) for _ in range(100)])
    eos = mq.consumer("bench-eos", ["eos-in"], auto_commit=False)
    loop = mq.consumer("bench-loop", ["eos-in"], auto_commit=False)

    def polled(c):
        msgs = []
        while len(msgs) < 100:
            msgs += c.poll(100 - len(msgs), 1.0)
        return msgs

    def with_txn():
        msgs = polled(eos)
        kp.begin()
        kp.send_batch([Message("eos-out", m.body) for m in msgs])
        kp.send_offsets({(m.topic, m.queue_id): m.queue_offset + 1 for m in msgs}, "bench-eos")
        kp.commit()

    def without():
        msgs = polled(loop)
        p.send_batch([Message("eos-out", m.body) for m in msgs])
        loop.commit()
    dt_tx, dt_plain = _alternating(rounds, with_txn, without)
    eos.close()
    loop.close()
    b.emit("kafkatx.eos_b100", rounds * 100 / dt_tx, "msgs/s", rounds=rounds, per_txn=100)
    b.emit("kafkatx.plain_eos_b100", rounds * 100 / dt_plain, "msgs/s", rounds=rounds,
           what="poll, send_batch, commit: no transaction")
    b.ratio("kafkatx.eos_b100_ratio", "kafkatx.eos_b100", "kafkatx.plain_eos_b100")


# ---------------------------------------------------------------------- spark
@suite("spark")
def bench_spark(b: Bench) -> None:
    """Committed messages -> Spark: ``spark.committed_rows_per_s`` of read_committed +
    ``to_spark`` + ``count()`` for 1M 256-byte messages, over ``spark.raw_rows_per_s``,
    the same rows already in memory as the same Ray blocks -> Spark ``count()``
    (``spark.handoff_ratio``, target >= 0.5); and the order-income job end to end
    (``spark.order_income_rows_per_s``)."""
    import json

    import ray

    from raymq.jobs import read_committed, spark_session
    from raymq.jobs.order_income import run_once
    from raymq.message import Message
    mq, data = _bench_cluster(b, "spark", flush_mode="async")
    try:
        n = b.n(1_000_000, 10_000)
        mq.create_topic("spark", queues=4)
        p = mq.producer("bench-spark")
        body = os.urandom(256)
        b.progress(f"spark: {n} committed messages of 256 bytes")
        for lo in range(0, n, 10_000):
            p.send_batch([Message("spark", body) for _ in range(min(10_000, n - lo))])
        with spark_session(mq) as spark:
            def committed() -> float:
                t0 = time.perf_counter()
                batch = read_committed(mq, ["spark"], start="earliest")
                counted = batch.dataset.to_spark(spark).count()
                if counted != n:
                    raise RuntimeError(f"spark: counted {counted} of {n} committed messages")
                return time.perf_counter() - t0, batch

            # warm-up, twice: the JVM, Ray's workers and their memory, the page cache (a
            # read's first rounds fault in the buffers it fills; later ones reuse them)
            committed()
            _dt, batch = committed()
            raw = ray.data.from_arrow_refs([ray.put(ray.get(r)) for r in batch._refs])
            raw.to_spark(spark).count()
            raw.to_spark(spark).count()
            rounds = 3
            b.progress(f"spark: committed and raw hand-offs, {rounds} rounds each, alternating")
            dt_committed = dt_raw = 0.0
            for _ in range(rounds):
                dt, _b = committed()
                dt_committed += dt
                t0 = time.perf_counter()
                raw.to_spark(spark).count()
                dt_raw += time.perf_counter() - t0
            b.emit("spark.committed_rows_per_s", rounds * n / dt_committed, "rows/s", n=n,
                   size=256, blocks=len(batch._refs), rounds=rounds)
            b.emit("spark.raw_rows_per_s", rounds * n / dt_raw, "rows/s", n=n,
                   blocks=len(batch._refs), rounds=rounds)
            b.ratio("spark.handoff_ratio", "spark.committed_rows_per_s", "spark.raw_rows_per_s",
                    target=0.5)
            k = b.n(200_000, 2_000)
            b.progress(f"spark: the order-income job over {k} orders")
            mq.create_topic("orders", queues=4)
            for lo in range(0, k, 10_000):
                p.send_batch([Message("orders", json.dumps(
                    {"amount": i % 100, "shop": f"s{i % 20}", "ts_ms": 60_000 * (i % 30)}
                ).encode()) for i in range(lo, min(k, lo + 10_000))])
            t0 = time.perf_counter()
            stats = run_once(mq, spark)
            dt = time.perf_counter() - t0
            b.emit("spark.order_income_rows_per_s", stats["orders_read"] / dt, "rows/s",
                   n=stats["orders_read"], messages=stats["messages"])
        p.close()
    finally:
        mq.close()
        _teardown_cluster(data)


if __name__ == "__main__":
    if sys.argv[1:2] == ["e2e-consumer"]:
        _e2e_consumer(sys.argv[2], int(sys.argv[3]))
