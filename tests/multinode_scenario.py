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
    from raymq.message import key_queue
    mq = connect(data_dir=data, num_shards=3, heartbeat_interval_ms=200, session_timeout_ms=5000,
                 send_timeout_ms=3000, retry_backoff_ms=50)
    nodes = [rpc.call(mq.shard_handle(i).node_id, timeout_s=60) for i in range(3)]
    print("shard nodes:", nodes, flush=True)
    assert len(set(nodes)) == 3, "shards are not spread over the 3 nodes"
    mq.create_topic("spread", queues=3)
    routes = mq.routes_for({"spread"})["spread"]
    assert sorted(routes) == [0, 1, 2], routes  # a queue on each shard, so on each node
    pids = [rpc.call(mq.shard_handle(i).ping, timeout_s=60)["pid"] for i in range(3)]
    p = mq.producer("p")
    # a key per queue: 100 messages in each
    keys = {}
    k = 0
    while len(keys) < 3:
        keys.setdefault(key_queue(f"k{k}", 3), f"k{k}")
        k += 1
    sent = p.send_batch([Message("spread", f"{i}".encode(), key=keys[i % 3]) for i in range(300)])
    assert len(sent) == 300 and sorted(r.queue_id for r in sent) == [q for q in range(3)
                                                                     for _ in range(100)]
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
            back = rpc.call(mq.shard_handle(1).ping, timeout_s=10)
            break
        except Exception:
            if time.monotonic() > deadline:
                print("shard-1 did not come back", flush=True)
                return 1
    node = rpc.call(mq.shard_handle(1).node_id, timeout_s=60)
    others = [rpc.call(mq.shard_handle(i).ping, timeout_s=60)["pid"] for i in (0, 2)]
    print("shard-1 back in a new process:", back["pid"] != pids[1],
          "on the returned node:", node not in nodes,
          "the others untouched:", others == [pids[0], pids[2]], flush=True)
    if back["pid"] == pids[1] or node in nodes or others != [pids[0], pids[2]]:
        return 1
    c = mq.consumer("g", ["spread"])
    got = []
    deadline = time.monotonic() + 60
    while len(got) < 300 and time.monotonic() < deadline:
        got += c.poll(300, 1.0)
    # every queue read to its end (100 each) and all it fetched handed out: nothing more
    # can come (no quiet window to outlast)
    at_end = not c._buffered and all(
        ("spread", q) in c._queues and c._queues[("spread", q)].fetch == 100 for q in range(3))
    bodies = sorted(int(m.body) for m in got)
    print("consumed after the node returned:", len(got), flush=True)
    print("each once:", bodies == list(range(300)) and at_end, flush=True)
    c.close()
    mq.close()
    ray.shutdown()
    cluster.shutdown()
    return 0 if bodies == list(range(300)) else 1


if __name__ == "__main__":
    sys.exit(main())
