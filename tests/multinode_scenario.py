"""Run by test_multinode: 3 Ray nodes on this machine, shards spread, a node leaves and returns.

Exit status 0 when every check held; prints what it checks.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ["RAY_AUTH_MODE"] = "disabled"

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402


def main() -> int:
    data = tempfile.mkdtemp(prefix="raymq-multinode-")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"raymq_controller": 1, "raymq_shard_0": 1},
        "include_dashboard": False, "object_store_memory": 200 * 1024 * 1024})
    workers = [cluster.add_node(num_cpus=1, resources={f"raymq_shard_{i}": 1},
                                object_store_memory=200 * 1024 * 1024) for i in (1, 2)]
    ray.init(address=cluster.address, namespace="raymq", log_to_driver=False)
    from raymq import Message, connect, rpc
    mq = connect(data_dir=data, num_shards=3, heartbeat_interval_ms=200, session_timeout_ms=1500,
                 send_timeout_ms=3000, retry_backoff_ms=50)
    nodes = [rpc.call(mq.shard_handle(i).node_id, timeout_s=60) for i in range(3)]
    print("shard nodes:", nodes, flush=True)
    assert len(set(nodes)) == 3, "shards are not spread over the 3 nodes"
    mq.create_topic("spread", queues=3)
    assert mq.routes_for({"spread"})["spread"] == [0, 1, 2] or \
        sorted(mq.routes_for({"spread"})["spread"]) == [0, 1, 2]
    p = mq.producer("p")
    sent = p.send_batch([Message("spread", f"{i}".encode()) for i in range(300)])
    assert len(sent) == 300
    p.close()

    cluster.remove_node(workers[0])  # shard-1's node leaves
    print("removed the node of shard-1", flush=True)
    try:
        rpc.call(mq.shard_handle(1).ping, timeout_s=3)
        print("shard-1 still answered after its node left", flush=True)
        return 1
    except Exception as err:
        print("shard-1 unavailable as expected:", type(err).__name__, flush=True)
    cluster.add_node(num_cpus=1, resources={"raymq_shard_1": 1},
                     object_store_memory=200 * 1024 * 1024)
    print("a node with shard-1's resource is back", flush=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            rpc.call(mq.shard_handle(1).ping, timeout_s=10)
            break
        except Exception:
            if time.monotonic() > deadline:
                print("shard-1 did not come back", flush=True)
                return 1
    c = mq.consumer("g", ["spread"])
    got = set()
    deadline = time.monotonic() + 60
    while len(got) < 300 and time.monotonic() < deadline:
        got |= {m.body for m in c.poll(300, 1.0)}
    print("consumed after the node returned:", len(got), flush=True)
    c.close()
    mq.close()
    ray.shutdown()
    cluster.shutdown()
    return 0 if got == {f"{i}".encode() for i in range(300)} else 1


if __name__ == "__main__":
    sys.exit(main())
