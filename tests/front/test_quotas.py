"""Documented quotas (issue 12 C12): nothing let a client grow the cluster's topics or
groups without bound.  ``max_topics`` and ``max_groups`` (``ClusterConfig``) are
enforced where topics and groups come into being, with one ``QUOTA_EXCEEDED`` line, and
nothing is created past them.  In-process controller and shard: no Ray."""
from __future__ import annotations

import pytest

from raymq import QuotaExceededError
from raymq.actors.controller import Controller
from raymq.actors.shard import BrokerShard
from raymq.storage.clock import ManualClock

CONFIG = {"num_shards": 1, "heartbeat_interval_ms": 200, "session_timeout_ms": 1500}


def test_topics_past_max_topics_are_refused_and_not_created(tmp_path):
    c = Controller({**CONFIG, "data_dir": str(tmp_path), "max_topics": 3}, clock=ManualClock())
    for t in ("a", "b", "c"):
        c.create_topic(t, 1)
    c.ensure_group_topics("g")  # a group's own retry and dead-letter topics are not counted
    with pytest.raises(QuotaExceededError, match="max_topics") as err:
        c.create_topic("d", 1)
    assert err.value.code == "QUOTA_EXCEEDED" and "\n" not in str(err.value)
    assert c.create_topic("a", 1)["topic"] == "a"  # an existing one is still answered
    assert sorted(c.topics()) == ["a", "b", "c"]
    again = Controller({**CONFIG, "data_dir": str(tmp_path), "max_topics": 3},
                       clock=ManualClock())  # also after a restart
    with pytest.raises(QuotaExceededError):
        again.create_topic("d", 1)


def test_groups_with_members_past_max_groups_are_refused_and_empty_ones_make_room(tmp_path):
    clock = ManualClock()
    c = Controller({**CONFIG, "data_dir": str(tmp_path), "max_groups": 2}, clock=clock)
    c.create_topic("t", 2)
    c.heartbeat("g1", "m1", ["t"], [])
    c.heartbeat("g2", "m2", ["t"], [])
    with pytest.raises(QuotaExceededError, match="max_groups"):
        c.heartbeat("g3", "m3", ["t"], [])
    assert set(c.groups()) == {"g1", "g2"}
    c.heartbeat("g1", "m1", ["t"], [])  # a known group is never refused
    c.leave("g2", "m2")
    assert c.heartbeat("g3", "m3", ["t"], [])["members"] == ["m3"]  # g2 was empty
    assert set(c.groups()) == {"g1", "g3"}
    clock.advance(10_000)  # g1's and g3's members time out: their groups are empty
    c.heartbeat("g4", "m4", ["t"], [])
    assert "g4" in c.groups()


def test_offsets_of_groups_past_max_groups_are_refused_and_not_stored(tmp_path):
    cfg = {"data_dir": str(tmp_path), "num_shards": 1, "max_groups": 2}
    sh = BrokerShard(0, cfg, background=False)
    try:
        sh.set_routes([("t", 0)])
        sh.commit_offsets("g1", {("t", 0): 0})
        sh.commit_offsets("g2", {("t", 0): 0})
        before = sh.store.offsets.snapshot()
        with pytest.raises(QuotaExceededError, match="max_groups"):
            sh.commit_offsets("g3", {("t", 0): 0})
        assert sh.store.offsets.snapshot() == before
        sh.commit_offsets("g1", {("t", 0): 0})  # known groups go on
    finally:
        sh.close()
    sh = BrokerShard(0, cfg, background=False)  # the groups are known after a restart
    try:
        sh.set_routes([("t", 0)])
        with pytest.raises(QuotaExceededError):
            sh.commit_offsets("g3", {("t", 0): 0})
        sh.commit_offsets("g2", {("t", 0): 0})
    finally:
        sh.close()
