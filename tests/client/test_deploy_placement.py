"""Where ``deploy`` places each shard (README, Architecture): by the custom resource
``raymq_shard_<i>`` when the cluster defines it, else by node affinity to the node it
was first placed on -- and, when that node is gone, on an alive node instead of
waiting for ever for one that will not come back.  No Ray: ``tests.deploy_fakes``."""
from __future__ import annotations

from tests.deploy_fakes import shard_actor_options


def placement(opts: dict):
    return opts.get("resources"), opts.get("scheduling_strategy")


def test_a_shard_goes_back_to_the_node_it_was_first_placed_on(monkeypatch):
    opts = shard_actor_options(monkeypatch, 2, alive=("node-a", "node-b"),
                               remembered={0: "node-b", 1: "node-a"})
    assert [placement(o) for o in opts] == [(None, ("pinned", "node-b")),
                                            (None, ("pinned", "node-a"))]


def test_a_shard_whose_node_is_gone_falls_back_to_an_alive_node(monkeypatch):
    opts = shard_actor_options(monkeypatch, 3, alive=("node-a", "node-b"),
                               remembered={0: "node-gone", 1: "node-a", 2: "node-gone"})
    # shard i whose node is gone: alive node i mod (alive nodes), spread, never the dead one
    assert [placement(o) for o in opts] == [(None, ("pinned", "node-a")),
                                            (None, ("pinned", "node-a")),
                                            (None, ("pinned", "node-a"))]


def test_a_new_shard_with_no_node_remembered_is_spread_over_the_alive_nodes(monkeypatch):
    opts = shard_actor_options(monkeypatch, 3, alive=("node-a", "node-b"), remembered={})
    assert [placement(o) for o in opts] == [(None, ("pinned", "node-a")),
                                            (None, ("pinned", "node-b")),
                                            (None, ("pinned", "node-a"))]


def test_a_cluster_that_defines_shard_resources_places_by_them(monkeypatch):
    opts = shard_actor_options(monkeypatch, 2, alive=("node-a",),
                               resources={"raymq_shard_0": 1.0, "raymq_shard_1": 1.0})
    assert [placement(o) for o in opts] == [({"raymq_shard_0": 0.001}, None),
                                            ({"raymq_shard_1": 0.001}, None)]
