"""``raymq.deploy`` with Ray's calls replaced: which actors it would create, and how.

``shard_actor_options`` runs ``deploy._create_shards`` against a fake cluster (its
alive nodes, its custom resources, the node the controller remembers for each
shard) and returns the Ray options each shard actor (the one replica of a group of
one) was created with.
"""
from __future__ import annotations

from raymq import deploy, rpc
from raymq.actors.config import ClusterConfig


def shard_actor_options(monkeypatch, num_shards: int = 2, *, alive=("node-0",),
                        remembered: dict | None = None, resources: dict | None = None
                        ) -> list[dict]:
    """The options of each shard actor ``deploy`` creates (in shard order).

    ``alive``: the cluster's alive node ids; ``remembered``: shard -> the node the
    controller says it was first placed on (default: ``alive[0]`` for every shard);
    ``resources``: the cluster's resources (e.g. ``raymq_shard_0``)."""
    made = []

    class Pinged:
        def __init__(self, handle):
            pass

        def call(self, *args, **kwargs):
            return {}

    class Control:
        handle = None

        def call(self, method, *args, **kwargs):
            if method == "replicas":  # (every group of one in sync at once)
                return [{"shard": i, "in_sync": ["node"]} for i in range(num_shards)]
            assert method == "shard_node"
            return alive[0] if remembered is None else remembered.get(args[0])

    monkeypatch.setattr(rpc, "cluster_resources", lambda: dict(resources or {}))
    monkeypatch.setattr(rpc, "alive_nodes", lambda: list(alive))
    monkeypatch.setattr(rpc, "pin_to_node", lambda node: ("pinned", node))
    monkeypatch.setattr(rpc, "create_actor",
                        lambda cls, *args, **opts: made.append((cls, opts)) or object())
    monkeypatch.setattr(rpc, "ShardClient", Pinged)
    deploy._create_shards(Control(), ClusterConfig(num_shards=num_shards))
    return [opts for cls, opts in made if cls is deploy.ShardActor]
