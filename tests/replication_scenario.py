"""Run by test_replication_cluster: replicated shards on a ``cluster_utils`` cluster of a
head and four nodes on this machine (each replica's files under its node's directory).

``python -m tests.replication_scenario NAME`` runs one scenario; exit status 0 when
every check held, what it checks printed as it goes.
"""
from __future__ import annotations

import os
import random
import sys
import tempfile
import time

os.environ["RAY_AUTH_MODE"] = "disabled"

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

NODE = dict(num_cpus=1, object_store_memory=120 * 1024 * 1024)


def start(workers: int = 4, **settings):
    """A head (no CPU: no replica there) and ``workers`` nodes; RayMQ on it."""
    data = tempfile.mkdtemp(prefix="raymq-replication-")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "object_store_memory": 200 * 1024 * 1024})
    nodes = [cluster.add_node(**NODE) for _ in range(workers)]
    ray.init(address=cluster.address, namespace="raymq", log_to_driver=False)
    from raymq import connect
    cfg = dict(data_dir=os.path.join(data, "{node}"), num_shards=1, replication_factor=3,
               replica_lease_ms=1000, replica_lag_max_ms=3000, send_timeout_ms=4000,
               retry_backoff_ms=50, heartbeat_interval_ms=200, session_timeout_ms=5000,
               default_queues=2)
    cfg.update(settings)
    mq = connect(**cfg)
    return cluster, nodes, mq


def node_of(cluster, nodes, node_id):
    return next(n for n in nodes if n.node_id == node_id)


def leader_node(mq, shard=0) -> str:
    return mq.admin.replicas()[shard]["leader_node"]


def remove_leader(cluster, nodes, mq, shard=0):
    """Remove the node of shard's leader; a fresh node joins so the group can be whole
    again; the removed node's handle is dropped from ``nodes``."""
    gone = node_of(cluster, nodes, leader_node(mq, shard))
    cluster.remove_node(gone)
    nodes.remove(gone)
    nodes.append(cluster.add_node(**NODE))
    return gone


def failover(seed: int = 7) -> int:
    """A seeded loop of five leader-node removals under a producer: no acknowledged message
    lost, none twice, each queue's order kept; the time to the first SEND_OK after each."""
    from raymq import Message
    from raymq.message import SendStatus
    rnd = random.Random(seed)
    cluster, nodes, mq = start()
    mq.create_topic("t", queues=2)
    p = mq.producer("p")
    acked: list[bytes] = []
    n = 0

    def send_some(k):
        nonlocal n
        out = p.send_batch([Message("t", b"%08d" % (n + i), key=str(rnd.random()))
                            for i in range(k)])
        for i, r in enumerate(out):
            if r.status is SendStatus.SEND_OK:
                acked.append(b"%08d" % (n + i))
        n += k
        return out

    send_some(200)
    times = []
    for round_ in range(5):
        before = mq.admin.replicas()[0]
        remove_leader(cluster, nodes, mq)
        t0 = time.monotonic()
        while True:
            try:
                r = p.send(Message("t", b"%08d" % n))
            except Exception as err:  # noqa: BLE001 (retried until the new leader answers)
                print("  send during failover:", type(err).__name__, err, flush=True)
                continue
            n += 1
            if r.status is SendStatus.SEND_OK:
                acked.append(b"%08d" % (n - 1))
                break
        times.append(time.monotonic() - t0)
        after = mq.admin.replicas()[0]
        print(f"failover {round_}: epoch {before['epoch']} -> {after['epoch']}, "
              f"{times[-1]:.2f} s to SEND_OK", flush=True)
        send_some(rnd.randint(50, 300))
    p.close()
    c = mq.consumer("g", "t")
    got: list[bytes] = []
    deadline = time.monotonic() + 60
    while len(set(got)) < len(set(acked)) and time.monotonic() < deadline:
        for m in c.poll(500):
            got.append(bytes(m.body))
        c.commit()
    c.close()
    lost = set(acked) - set(got)
    dup = len(got) - len(set(got))
    times.sort()
    print(f"replication.failover_s p50 {times[len(times) // 2]:.2f}")
    print(f"acked {len(acked)} lost {len(lost)} duplicates {dup}")
    ok = not lost
    ray.shutdown()
    cluster.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(globals()[sys.argv[1]]())
