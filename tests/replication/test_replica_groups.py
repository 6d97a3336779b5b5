"""The controller's replica groups (``ReplicaGroups``): pure logic on a manual clock."""
from __future__ import annotations

import pytest

from raymq.actors.replication.groups import ReplicaGroups, replica_name
from raymq.storage.clock import ManualClock
from raymq.storage.errors import InvalidMessageError, NotEnoughReplicasError

LEASE = 1000
R0, R1, R2 = (replica_name(0, k) for k in range(3))


@pytest.fixture
def groups():
    saved = []
    clock = ManualClock()
    g = ReplicaGroups(1, 3, LEASE, clock, lambda: saved.append(1))
    g.saved, g.clock_ = saved, clock
    return g


def beat_all(g, ends=(100, 100, 100)):
    leader = g.leader(0)[0]
    for name, end in zip((R0, R1, R2), ends):
        report = [R0, R1, R2] if name == leader else None
        g.heartbeat(0, name, f"node-{name}", g.leader(0)[1], end, report,
                    isr_version=version(g))


def version(g, shard=0):
    """The group's current version (the leader asks for its in-sync set at it)."""
    return g.describe()[shard]["version"]


def test_the_first_replica_to_heartbeat_leads_and_the_leader_grows_the_set(groups):
    doc = groups.heartbeat(0, R1, "n1", 0, 0, None)
    assert doc["leader"] == R1 and doc["epoch"] == 1 and doc["in_sync"] == [R1]
    assert groups.saved  # durable before it is answered
    groups.heartbeat(0, R0, "n0", 1, 0, None)
    doc = groups.heartbeat(0, R1, "n1", 1, 0, [R0, R1], isr_version=version(groups))
    assert doc["in_sync"] == [R0, R1]


def test_a_silent_leader_is_replaced_by_the_in_sync_replica_holding_the_most(groups):
    groups.heartbeat(0, R0, "n0", 0, 0, None)
    beat_all(groups, ends=(300, 200, 250))
    groups.clock_.advance(LEASE // 2)
    groups.heartbeat(0, R1, "n1", 1, 200, None)
    groups.heartbeat(0, R2, "n2", 1, 250, None)
    groups.clock_.advance(LEASE // 2 + 1)  # R0 silent for more than a lease
    assert groups.tick() == [0]
    leader, epoch = groups.leader(0)
    assert (leader, epoch) == (R2, 2)
    assert groups.describe()[0]["in_sync"] == [R1, R2]


def test_no_election_outside_the_in_sync_set_unless_asked(groups):
    groups.heartbeat(0, R0, "n0", 0, 0, None)  # leads alone: nobody else in sync
    groups.heartbeat(0, R1, "n1", 1, 0, None)
    groups.clock_.advance(LEASE + 1)
    groups.heartbeat(0, R1, "n1", 1, 0, None)
    assert groups.leader(0) == (R0, 1)  # R1 is alive but was never in sync
    with pytest.raises(NotEnoughReplicasError, match="no alive in-sync replica"):
        groups.elect(0)
    assert groups.elect(0, unclean=True)["leader"] == R1


def test_only_the_current_leader_shrinks_the_set_and_a_dead_follower_leaves_it(groups):
    groups.heartbeat(0, R0, "n0", 0, 0, None)
    beat_all(groups)
    assert groups.alter_isr(0, R1, 1, [R1])[0] is False       # not the leader
    assert groups.alter_isr(0, R0, 0, [R0])[0] is False       # a stale epoch
    ok, doc = groups.alter_isr(0, R0, 1, [R0, R1])
    assert ok and doc["in_sync"] == [R0, R1]
    beat_all(groups)
    groups.clock_.advance(LEASE + 1)
    groups.heartbeat(0, R0, "n0", 1, 100, [R0, R1, R2], isr_version=version(groups))
    groups.heartbeat(0, R2, "n2", 1, 100, None)
    assert R1 not in groups.describe()[0]["in_sync"]  # its lease ran out


def test_a_restarted_follower_leaves_the_set_until_it_holds_what_the_leader_held(groups):
    groups.heartbeat(0, R0, "n0", 0, 0, None)
    beat_all(groups, ends=(500, 500, 500))
    groups.heartbeat(0, R2, "n2", 1, 0, None, True)  # fresh: its disk may be new
    assert R2 not in groups.describe()[0]["in_sync"]
    groups.heartbeat(0, R0, "n0", 1, 500, [R0, R1, R2],  # the leader has not noticed yet
                     isr_version=version(groups))
    assert R2 not in groups.describe()[0]["in_sync"]
    groups.heartbeat(0, R2, "n2", 1, 500, None)
    groups.heartbeat(0, R0, "n0", 1, 500, [R0, R1, R2], isr_version=version(groups))
    assert R2 in groups.describe()[0]["in_sync"]


def test_operator_election_to_a_named_replica_and_bad_names(groups):
    groups.heartbeat(0, R0, "n0", 0, 0, None)
    beat_all(groups)
    assert groups.elect(0, to=R2)["leader"] == R2
    assert groups.leader(0)[1] == 2
    with pytest.raises(InvalidMessageError, match="not a replica"):
        groups.elect(0, to="shard-0-r9")
    with pytest.raises(InvalidMessageError, match="not a replica"):
        groups.heartbeat(0, "shard-1-r0", "n", 0, 0, None)
    with pytest.raises(InvalidMessageError, match="no shard"):
        groups.leader(3)


def test_the_groups_survive_a_controller_restart(groups):
    groups.heartbeat(0, R0, "n0", 0, 0, None)
    beat_all(groups)
    again = ReplicaGroups(1, 3, LEASE, ManualClock(), lambda: None, groups.to_doc())
    assert again.leader(0) == (R0, 1)
    assert again.describe()[0]["in_sync"] == [R0, R1, R2]


def test_a_restarted_leader_hands_over_to_an_in_sync_replica(groups):
    groups.heartbeat(0, R0, "n0", 0, 0, None)
    beat_all(groups, ends=(500, 500, 400))
    doc = groups.heartbeat(0, R0, "n9", 1, 24, None, True)  # back on a new node, empty
    assert doc["leader"] == R1 and doc["epoch"] == 2  # the one holding the most
    assert R0 not in doc["in_sync"]


def test_a_restarted_leader_alone_leads_again_only_holding_what_it_had(groups):
    groups.heartbeat(0, R0, "n0", 0, 0, None)
    groups.heartbeat(0, R0, "n0", 1, 500, None)
    doc = groups.heartbeat(0, R0, "n0", 1, 500, None, True)  # same disk: leads, new epoch
    assert doc["leader"] == R0 and doc["epoch"] == 2
    doc = groups.heartbeat(0, R0, "n9", 2, 24, None, True)  # a new disk: nobody leads
    assert doc["leader"] is None and doc["in_sync"] == []
    groups.heartbeat(0, R1, "n1", 0, 0, None)  # not "the first of a new group"
    assert groups.leader(0) == (None, 2)
    assert groups.elect(0, unclean=True)["leader"] in (R0, R1)


def test_a_follower_the_leader_adds_is_electable_before_its_own_next_heartbeat(groups):
    """(The multi-node paused-leader scenario elected a rejoined replica right after the
    leader added it: the epoch its log holds had not been reported yet.)"""
    groups.heartbeat(0, R0, "n0", 0, 0, None, log_epoch=1)
    for r in (R1, R2):
        groups.heartbeat(0, r, f"n-{r}", 1, 0, None, log_epoch=-1)  # (not copied yet)
    groups.heartbeat(0, R0, "n0", 1, 100, [R0, R1], isr_version=version(groups), log_epoch=1)
    assert groups.elect(0, to=R1)["leader"] == R1
    # its own heartbeat says what its log holds: a new disk makes it ineligible again
    groups.heartbeat(0, R1, "n-r1", 2, 24, None, True, log_epoch=-1)
    assert groups.describe()[0]["candidacy"][R1] != "electable"
