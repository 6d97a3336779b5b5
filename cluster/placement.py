"""Custom resources that pin shards to nodes on a `ray up` cluster.

Node j of n (0 = head) gets ``raymq_shard_i`` for every shard i with
``i % n == j``, and the head also gets ``raymq_controller``.  A restarted
shard then comes back on a node with its resource, i.e. its own node and
files, even when the node rejoined with a new node id.

``python -m raymq.placement --num-shards 3 --nodes "HEAD W1 W2"`` prints the
``--resources`` JSON for the node it runs on (found by its addresses).
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys


def node_resources(node_index: int, num_nodes: int, num_shards: int) -> dict[str, float]:
    if not 0 <= node_index < num_nodes:
        raise ValueError(f"node index {node_index} is not in 0..{num_nodes - 1}")
    res = {f"raymq_shard_{i}": 1.0 for i in range(num_shards) if i % num_nodes == node_index}
    if node_index == 0:
        res["raymq_controller"] = 1.0
    return res


def local_addresses() -> set[str]:
    addrs = {"127.0.0.1", "localhost", socket.gethostname()}
    try:
        addrs.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout
        addrs.update(out.split())
    except (OSError, subprocess.SubprocessError):
        pass
    return addrs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m raymq.placement", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-shards", type=int, required=True)
    ap.add_argument("--nodes", required=True, help="head address first, then the workers'")
    ap.add_argument("--node-index", type=int, help="this node's index (default: by address)")
    args = ap.parse_args(argv)
    nodes = args.nodes.split()
    index = args.node_index
    if index is None:
        mine = local_addresses()
        matches = [i for i, n in enumerate(nodes) if n in mine]
        if not matches:
            print(f"none of {nodes} is an address of this host", file=sys.stderr)
            return 1
        index = matches[-1] if len(matches) > 1 and "127.0.0.1" in nodes else matches[0]
    print(json.dumps(node_resources(index, len(nodes), args.num_shards)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
