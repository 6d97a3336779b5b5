"""Retention on a replicated shard (issue 35), in one process (no Ray): three replicas of
shard 0 and a real controller (``tests.replication.test_replication_group.Group``).
Segments the leader deletes go on the followers; a follower whose next record aged out on
the leader (a wiped one) starts again from the leader's log start and holds what the
leader holds from there; a failover after a deletion keeps the log start."""
from __future__ import annotations

import shutil

import pytest

from tests.helpers import wait_for
from tests.replication.test_replication_group import LEASE_MS, Group, send

MB = 1 << 20


def fill(leader, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        assert send(leader, [b"%08d" % i + bytes(256 * 1024 - 8)]).status == "SEND_OK"


def starts(group) -> dict:
    out = {}
    for name, r in group.replicas.items():
        if name not in group.down:
            store = r.shard.store if r.shard is not None else r.store
            out[name] = (store.min_phys_offset, store.retention.log_start("t", 0))
    return out


@pytest.fixture
def group(tmp_path):
    g = Group(tmp_path, segment_size_bytes=9 * MB, retention_ms=1)
    g.settle()
    yield g
    g.close()


def test_followers_delete_what_the_leader_deleted_and_a_wiped_one_starts_from_its_log_start(
        group):
    leader = group.leader
    fill(leader, 120)                         # ~30 MiB: three sealed segments
    leader.shard.store.checkpoint()
    assert leader.shard.janitor.run_once().count >= 2
    log_start = leader.shard.store.min_phys_offset
    assert log_start > 24 and leader.shard.store.retention.log_start("t", 0) > 0
    fill(leader, 1, 120)                      # the next fetches tell the followers
    for r in group.replicas.values():
        r.store is not None and r.store.checkpoint()
    fill(leader, 1, 121)
    wait_for(lambda: len(set(starts(group).values())) == 1, 20, "followers at the log start")
    # a follower wiped (its disk replaced) starts again from the leader's log start
    wiped = next(n for n in group.names if n != leader.name)
    group.kill(wiped)
    shutil.rmtree(group.tmp / wiped)
    group.start(wiped)
    group.settle()
    fill(leader, 1, 122)
    w = group.replicas[wiped]
    wait_for(lambda: w.log_end() == leader.log_end(), 20, "the wiped follower to catch up")
    first = leader.shard.store.retention.log_start("t", 0)
    assert w.store.min_phys_offset == log_start and w.store.retention.log_start("t", 0) == first
    want = [m.body for m in leader.shard.store.read_queue("t", 0, first, 1000)]
    assert [m.body for m in w.store.read_queue("t", 0, first, 1000)] == want
    assert len(want) == 123 - first
    # the leader lost: the new one keeps the log start
    group.kill(leader.name)
    group.clock.advance(LEASE_MS + 1)
    group.beat()
    new = group.leader
    assert new.name != leader.name
    assert new.shard.store.min_phys_offset >= log_start
    assert new.shard.store.retention.log_start("t", 0) >= first
    assert send(new, [b"after"]).status == "SEND_OK"
