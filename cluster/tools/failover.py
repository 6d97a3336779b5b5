"""Replicated shards on a ``ray.cluster_utils`` cluster of this machine: the harness the
multi-node tests and the ``replication`` bench suite share (a head without CPUs, so no
replica lands there, and worker nodes that tests remove and add), and the suite.

Each replica keeps its files under its own node's directory (``data_dir`` ends in
``{node}``), as on machines of their own.
"""
from __future__ import annotations

import os
import random
import shutil
import tempfile
import time

from raymq.tools.bench import Bench, suite

#: A worker node: one CPU (a replica's bundle takes a thousandth), a small object store.
NODE = dict(num_cpus=1, object_store_memory=120 * 1024 * 1024)

#: Settings that make a failover quick on one machine (a lease of 1 s).
FAST = dict(replica_lease_ms=1000, replica_lag_max_ms=3000, send_timeout_ms=4000,
            retry_backoff_ms=50, heartbeat_interval_ms=200, session_timeout_ms=5000)


class Harness:
    """A head and ``workers`` nodes, Ray joined, nothing deployed yet (``deploy``)."""

    def __init__(self, workers: int = 4, *, workdir: str | None = None):
        import ray
        from ray.cluster_utils import Cluster
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        self.data = tempfile.mkdtemp(prefix="raymq-replication-", dir=workdir)
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": False,
            "object_store_memory": 200 * 1024 * 1024})
        self.nodes = [self.cluster.add_node(**NODE) for _ in range(workers)]
        ray.init(address=self.cluster.address, namespace="raymq", log_to_driver=False,
                 logging_level="ERROR")
        self.mq = None

    def deploy(self, name: str = "raymq", **settings):
        """RayMQ with ``settings`` (3 replicas, ``FAST``), its files under ``name``."""
        from raymq import connect
        cfg = dict(data_dir=os.path.join(self.data, name, "{node}"), num_shards=1,
                   replication_factor=3, default_queues=2, **FAST)
        cfg.update(settings)
        self.mq = connect(**cfg)
        return self.mq

    def undeploy(self) -> None:
        from raymq.deploy import undeploy
        self.mq.close()
        undeploy()
        self.mq = None

    def leader_node(self, shard: int = 0) -> str:
        return self.mq.admin.replicas()[shard]["leader_node"]

    def node(self, node_id: str):
        return next(n for n in self.nodes if n.node_id == node_id)

    def remove(self, node_id: str, *, replace: bool = True) -> None:
        """Remove a node (a machine lost); with ``replace`` a fresh one joins, where Ray
        puts the lost replica again (its placement-group bundle) to copy from the leader."""
        gone = self.node(node_id)
        self.cluster.remove_node(gone)
        self.nodes.remove(gone)
        if replace:
            self.add()

    def add(self, **options):
        """A fresh worker node (``NODE``, with ``options`` over it: ``resources=...``,
        ``num_cpus=0`` for a node no replica's bundle fits on)."""
        node = self.cluster.add_node(**{**NODE, **options})
        self.nodes.append(node)
        return node

    def wait_in_sync(self, count: int, shard: int = 0, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            g = self.mq.admin.replicas()[shard]
            if len(g["in_sync"]) >= count:
                return g
            if time.monotonic() > deadline:
                raise AssertionError(f"shard-{shard}: {len(g['in_sync'])} in sync after "
                                     f"{timeout_s} s, not {count}: {g}")
            time.sleep(0.1)

    def close(self) -> None:
        import ray
        if self.mq is not None:
            self.mq.close()
        ray.shutdown()
        self.cluster.shutdown()
        shutil.rmtree(self.data, ignore_errors=True)


def produce_rate(mq, topic: str, n: int, batch: int = 500, size: int = 256,
                 threads: int = 4, acks: str = "all") -> float:
    """Messages/s of ``n`` messages sent in batches of ``batch`` by ``threads`` threads
    sharing one producer (each waits for its batch: ``threads`` batches in flight)."""
    import threading
    from raymq import Message
    p = mq.producer(f"rate-{topic}", acks=acks)
    body = b"x" * size
    per = n // threads

    def run():
        for start in range(0, per, batch):
            p.send_batch([Message(topic, body) for _ in range(min(batch, per - start))])
    workers = [threading.Thread(target=run) for _ in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    rate = per * threads / (time.perf_counter() - t0)
    p.close()
    return rate


class AckedLog:
    """What a producer got ``SEND_OK`` for, to check after failovers."""

    def __init__(self, mq, topic: str, seed: int):
        self.mq = mq
        self.p = mq.producer(f"acked-{topic}")
        self.topic, self.rnd = topic, random.Random(seed)
        self.acked: list[bytes] = []
        self.sent = 0

    def send(self, k: int) -> None:
        from raymq import Message
        from raymq.message import SendStatus
        bodies = [b"%09d" % (self.sent + i) for i in range(k)]
        self.sent += k
        out = self.p.send_batch([Message(self.topic, b, key=str(self.rnd.random()))
                                 for b in bodies])
        self.acked += [b for b, r in zip(bodies, out) if r.status is SendStatus.SEND_OK]

    def send_again(self, k: int) -> int:
        """Send ``k`` more; how many of them were acknowledged."""
        before = len(self.acked)
        self.send(k)
        return len(self.acked) - before

    def checked(self, mq, group: str = "check", timeout_s: float = 60) -> tuple[int, str]:
        """``missing`` as the scenarios print it: (lost, "acked A/S lost L duplicates D
        ordered O")."""
        lost, dup, ordered = self.missing(mq, group, timeout_s)
        return lost, (f"acked {len(self.acked)}/{self.sent} lost {lost} duplicates {dup} "
                      f"ordered {ordered}")

    def until_acked(self, past_epoch: int | None = None, since: float | None = None) -> float:
        """Send one message at a time until one is acknowledged (with ``past_epoch``: by a
        leader elected after that epoch -- a node being removed may answer a little
        longer); the seconds it took (from ``since``, a ``time.monotonic()``)."""
        t0 = time.monotonic() if since is None else since
        while True:
            if past_epoch is not None and self.mq.admin.replicas()[0]["epoch"] <= past_epoch:
                self._send_one()
                continue
            if self._send_one():
                return time.monotonic() - t0

    def _send_one(self) -> bool:
        from raymq import Message
        from raymq.message import SendStatus
        body = b"%09d" % self.sent
        self.sent += 1
        try:
            r = self.p.send(Message(self.topic, body))
        except Exception as err:  # noqa: BLE001 -- retried until the new leader answers
            print(f"  (send during the failover: {type(err).__name__}: {err})", flush=True)
            return False
        if r.status is SendStatus.SEND_OK:
            self.acked.append(body)
            return True
        return False

    def missing(self, mq, group: str, timeout_s: float = 60) -> tuple[int, int, bool]:
        """(acknowledged messages never consumed, consumed twice, each queue in order)."""
        self.p.close()
        c = mq.consumer(group, self.topic)
        got: dict[int, list[int]] = {}
        want = set(self.acked)
        seen: set[bytes] = set()
        dup = 0
        deadline = time.monotonic() + timeout_s
        while not want <= seen and time.monotonic() < deadline:
            for m in c.poll(500):
                body = bytes(m.body)
                if not body.isdigit():
                    continue  # (a test's own message, not this log's)
                dup += body in seen
                seen.add(body)
                got.setdefault(m.queue_id, []).append(int(body))
            c.commit()
        c.close()
        ordered = all(q == sorted(q) for q in got.values())
        return len(want - seen), dup, ordered


def failovers(h: Harness, rounds: int, log: AckedLog, *, per_round=None) -> list[float]:
    """``rounds`` times: remove the leader's node (a fresh node joins), time the first
    ``SEND_OK`` after it, then let the group be whole again (``per_round(k)`` runs load
    in between).  The seconds of each."""
    times = []
    for k in range(rounds):
        before = h.mq.admin.replicas()[0]
        t0 = time.monotonic()
        h.remove(before["leader_node"], replace=False)
        times.append(log.until_acked(past_epoch=before["epoch"], since=t0))
        h.add()  # a fresh node: Ray puts the lost replica there, and it copies the log
        after = h.mq.admin.replicas()[0]
        print(f"failover {k}: epoch {before['epoch']} -> {after['epoch']}, "
              f"{times[-1]:.2f} s to SEND_OK", flush=True)
        if per_round is not None:
            per_round(k)
        h.wait_in_sync(3)
    return times


@suite("replication")
def bench_replication(b: Bench) -> None:
    """R = 3 (min in sync 2) against R = 1, batched produce, three nodes sharing this
    machine's cores; then five failovers of the leader's node."""
    h = Harness(workers=3, workdir=b.workdir)
    try:
        n = b.n(60_000, 5_000)
        rates = {}
        for r in (1, 3):
            b.progress(f"replication: R = {r}, {n} messages in batches of 500, 4 threads")
            mq = h.deploy(f"r{r}", replication_factor=r)
            mq.create_topic("bench", queues=2)
            produce_rate(mq, "bench", n // 10)  # warm-up
            rates[r] = produce_rate(mq, "bench", n)
            b.emit(f"replication.produce_r{r}", rates[r], "msgs/s", n=n, batch=500, size=256,
                   threads=4,
                   replication_factor=r, min_insync_replicas=min(2, r))
            if r == 1:
                h.undeploy()
        b.ratio("replication.produce_ratio", "replication.produce_r3", "replication.produce_r1")
        _bench_acks_and_follower_cpu(b, h.mq, n)
        b.progress("replication: five failovers of the leader's node")
        mq = h.mq
        mq.create_topic("bench-failover", queues=2)
        log = AckedLog(mq, "bench-failover", seed=5)
        log.send(500)
        times = failovers(h, 5, log, per_round=lambda _k: log.send(200))
        times.sort()
        b.emit("replication.failover_s", times[len(times) // 2], "s", failovers=len(times),
               max=round(times[-1], 3), lease_ms=FAST["replica_lease_ms"])
        lost, dup, ordered = log.missing(mq, "bench-check")
        b.emit("replication.lost_acked", lost, "messages", acked=len(log.acked),
               duplicates=dup, ordered=ordered)
    finally:
        h.close()
    _bench_nemesis(b)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has spent (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _bench_acks_and_follower_cpu(b: Bench, mq, n: int) -> None:
    """On the R = 3 deployment: the same load with ``acks="leader"`` (the price of waiting
    for the in-sync replicas), and the CPU a follower's process spends per MB it copies
    over what its leader's spends for the same data."""
    from raymq import rpc
    from raymq.deploy import NAMESPACE
    group = mq.admin.replicas()[0]
    pids = {r["name"]: rpc.call(rpc.get_actor(r["name"], NAMESPACE).ping, timeout_s=30)["pid"]
            for r in group["replicas"]}
    leader = next(r["name"] for r in group["replicas"] if r["role"] == "leader")
    follower = next(r["name"] for r in group["replicas"] if r["role"] != "leader")
    slices, each = 4, 2 * n
    b.progress(f"replication: R = 3, acks of every in-sync replica and of the leader only, "
               f"{slices} alternating slices of {each} messages each")
    seconds = {"all": 0.0, "leader": 0.0}
    spent = dict.fromkeys(pids, 0.0)
    for _ in range(slices):  # (alternating: a change of the machine's pace hits both)
        for acks in ("all", "leader"):
            before = {name: _cpu_s(pid) for name, pid in pids.items()}
            seconds[acks] += each / produce_rate(mq, "bench", each, acks=acks)
            if acks == "all":  # (the followers copy the same either way: counted once)
                for name, pid in pids.items():
                    spent[name] += _cpu_s(pid) - before[name]
    total = slices * each
    b.emit("replication.produce_r3_acks_all", total / seconds["all"], "msgs/s", n=total,
           batch=500, size=256, threads=4, replication_factor=3, acks="all", slices=slices)
    b.emit("replication.produce_r3_leader_acks", total / seconds["leader"], "msgs/s",
           n=total, batch=500, size=256, threads=4, replication_factor=3, acks="leader",
           slices=slices)
    b.ratio("replication.acks_all_ratio", "replication.produce_r3_acks_all",
            "replication.produce_r3_leader_acks")
    mb = total * 256 / 1e6
    b.emit("replication.leader_cpu_ms_per_mb", 1000 * spent[leader] / mb, "ms/MB",
           replica=leader, mb=round(mb, 1))
    b.emit("replication.follower_cpu_ms_per_mb", 1000 * spent[follower] / mb, "ms/MB",
           replica=follower, mb=round(mb, 1))
    b.ratio("replication.follower_cpu_ratio", "replication.follower_cpu_ms_per_mb",
            "replication.leader_cpu_ms_per_mb")


def _bench_nemesis(b: Bench) -> None:
    """The in-process random search of replication schedules (``raymq.tools.nemesis``):
    steps a second, every check holding."""
    from raymq.tools.nemesis import search
    seeds, steps = max(2, int(b.n(20, 4))), 500
    b.progress(f"replication: nemesis, {seeds} seeds of {steps} steps")
    t0, done, faults = time.perf_counter(), 0, 0
    for seed in range(seeds):
        result = search(10_000 + seed, steps)
        done += result.steps
        faults += sum(result.faults.values())
    b.emit("replication.nemesis_steps_per_s", done / (time.perf_counter() - t0), "steps/s",
           seeds=seeds, steps=done, faults=faults)
