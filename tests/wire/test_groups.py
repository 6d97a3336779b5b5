"""The classic group protocol's coordinator (``raymq.wire.groups``) on its own: members
join (held until the rebalance completes), one leader hands the assignment out, a new
member, a member that leaves and one whose session ran out each start a rebalance, and
stale generations and unknown members are refused with Kafka's codes.  No sockets, no
Ray."""
from __future__ import annotations

import threading

from raymq.wire import groups as G

P = [("range", b"meta")]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def joined_together(g, *ids, **kw):
    """Each member's JoinGroup, sent at once (each held by the coordinator)."""
    out = {}

    def run(mid):
        out[mid] = g.join("grp", mid, "consumer", P, 6000, 1000, **kw)
    threads = [threading.Thread(target=run, args=(m,)) for m in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_members_join_one_leads_the_assignment_goes_out_and_changes_rebalance():
    g = G.ClassicGroups(initial_delay_s=0.2)
    first = g.join("grp", "", "consumer", P, 6000, 1000, require_known_id=True)
    assert first.error == G.MEMBER_ID_REQUIRED and first.member_id
    got = joined_together(g, "a", "b")
    assert {j.generation for j in got.values()} == {1} and {j.leader for j in got.values()} == {"a"}
    assert [m for m, _meta in got["a"].members] == ["a", "b"] and got["b"].members == ()
    sync_b = {}
    t = threading.Thread(target=lambda: sync_b.update(r=g.sync("grp", 1, "b", {})))
    t.start()  # (a follower waits for the leader's assignment)
    assert g.sync("grp", 1, "a", {"a": b"A", "b": b"B"}) == (G.NONE, b"A")
    t.join(10)
    assert sync_b["r"] == (G.NONE, b"B") and g.heartbeat("grp", 1, "b") == G.NONE
    # a join sent again unchanged by a follower: the current generation, no rebalance
    assert g.join("grp", "b", "consumer", P, 6000, 1000).generation == 1
    # a member leaves: the others rebalance (told by their heartbeat)
    assert g.leave("grp", ["b", "nobody"]) == [G.NONE, G.UNKNOWN_MEMBER_ID]
    assert g.heartbeat("grp", 1, "a") == G.REBALANCE_IN_PROGRESS
    again = g.join("grp", "a", "consumer", P, 6000, 1000)
    assert (again.generation, again.leader) == (2, "a")
    assert g.sync("grp", 1, "a", {})[0] == G.ILLEGAL_GENERATION       # a stale generation
    assert g.heartbeat("grp", 2, "b") == G.UNKNOWN_MEMBER_ID
    assert g.check_commit("grp", 1, "a") == G.ILLEGAL_GENERATION
    assert g.check_commit("grp", -1, "") == G.ILLEGAL_GENERATION       # not while members are


def test_a_member_silent_past_its_session_is_dropped_and_the_group_rebalances():
    clock = Clock()
    g = G.ClassicGroups(clock=clock, initial_delay_s=0.0)
    got = joined_together(g, "a")
    assert got["a"].generation == 1
    assert g.sync("grp", 1, "a", {"a": b"A"}) == (G.NONE, b"A")
    clock.t += 7.0  # (past the 6 s session)
    assert g.heartbeat("grp", 1, "a") == G.UNKNOWN_MEMBER_ID
    assert g.describe("grp")["state"] == G.EMPTY and g.check_commit("grp", -1, "") == G.NONE
    bad = g.join("grp", "c", "consumer", P, 10, 1000)
    assert bad.error == G.INVALID_SESSION_TIMEOUT
    other = g.join("grp", "d", "consumer", P, 6000, 1000)
    assert other.error == G.NONE and other.generation == 2
    assert g.join("grp", "e", "other-type", P, 6000, 1000).error == G.INCONSISTENT_GROUP_PROTOCOL


def test_a_member_that_died_holds_a_rebalance_only_for_its_session_not_the_rebalance_timeout():
    """A member killed (no LeaveGroup, no more heartbeats) while a new one joins: the join
    completes once the dead one's session ran out (6 s), not after the rebalance timeout
    its client asked for (librdkafka's max.poll.interval.ms: 5 minutes)."""
    import time
    g = G.ClassicGroups(initial_delay_s=0.0)
    first = g.join("grp", "dead", "consumer", P, 1000, 300_000)
    assert first.generation == 1
    assert g.sync("grp", 1, "dead", {"dead": b"A"}) == (G.NONE, b"A")
    t0 = time.monotonic()
    late = g.join("grp", "new", "consumer", P, 6000, 300_000)
    assert late.error == G.NONE and late.generation == 2 and late.leader == "new"
    assert time.monotonic() - t0 < 10  # (1 s session: not 300 s)
    assert g.describe("grp")["members"] == ["new"]


def test_a_group_whose_members_died_is_empty_to_every_view_and_goes_once_empty():
    """A consumer that dies never leaves: its member stayed in the group, seen only by a
    later join or heartbeat of the same group.  ListGroups and DescribeGroups showed it
    Stable with that member for good (and OffsetDelete refused: "subscribed"), and the
    coordinator kept every group id ever joined.  Views drop members past their session
    now, and a group empty for a day is forgotten (a later join starts it again)."""
    clock = Clock()
    g = G.ClassicGroups(clock=clock, initial_delay_s=0)
    for name in ("grp", "other"):
        assert g.join(name, "a", "consumer", P, 6000, 1000).generation == 1
        assert g.sync(name, 1, "a", {"a": b"A"}) == (G.NONE, b"A")
    assert g.describe("grp")["state"] == G.STABLE and g.describe("grp")["members"] == ["a"]
    clock.t += 10 * 86_400           # ten days: both consumers long dead
    assert g.describe("grp")["members"] == [] and g.members_of("grp") == []
    assert g.listed() == []          # both forgotten
    assert g.describe("other") is None
    assert g.join("grp", "b", "consumer", P, 6000, 1000).error == G.NONE   # started again


def test_an_offset_commit_while_the_assignment_is_being_handed_out_is_rebalance_in_progress():
    """Between the join's answer and the leader's SyncGroup (CompletingRebalance) a member
    does not know its partitions yet: Kafka refuses its OffsetCommit with
    REBALANCE_IN_PROGRESS (27); it was taken."""
    g = G.ClassicGroups(initial_delay_s=0)
    assert g.join("grp", "a", "consumer", P, 6000, 1000).generation == 1
    assert g.check_commit("grp", 1, "a") == G.REBALANCE_IN_PROGRESS
    assert g.sync("grp", 1, "a", {"a": b"A"}) == (G.NONE, b"A")
    assert g.check_commit("grp", 1, "a") == G.NONE
