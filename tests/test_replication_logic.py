"""Replication's pure logic (issue 26, first part): a replica's leader-epoch file and the
truncation rule of a returning replica (Kafka KIP-101/279, RocketMQ 5's EpochFileCache),
and a shard group's in-sync set, confirmed offset, acknowledgement and election.  No Ray,
time given by hand."""
from __future__ import annotations

import pytest

from raymq.actors.replica_set import Ack, ReplicaSet
from raymq.storage.epochs import UNDEFINED, EpochCache
from raymq.storage.errors import (CorruptLogError, NotEnoughReplicasError, NotLeaderError,
                                  StorageError)


def cache(*entries) -> EpochCache:
    c = EpochCache()
    for e, s in entries:
        c.assign(e, s)
    return c


def test_entries_only_go_forward_and_the_latest_is_idempotent():
    c = cache((0, 0), (2, 100))
    assert c.assign(2, 150) is False and c.entries() == [(0, 0), (2, 100)]
    for bad in ((1, 200), (3, 50), (-1, 0)):
        with pytest.raises(StorageError):
            c.assign(*bad)
    assert c.assign(5, 100) and c.latest_epoch() == 5


def test_end_offset_for_is_kafkas():
    c = cache((1, 0), (3, 100), (5, 250))
    assert c.end_offset_for(5, 400) == (5, 400)       # the latest: the log's end
    assert c.end_offset_for(3, 400) == (3, 250)       # where the next epoch starts
    assert c.end_offset_for(4, 400) == (3, 250)       # unknown: the floor epoch's end
    assert c.end_offset_for(0, 400) == (0, 0)         # before the first: its start
    assert c.end_offset_for(6, 400) == (UNDEFINED, UNDEFINED)
    assert c.end_offset_for(UNDEFINED, 400) == (UNDEFINED, UNDEFINED)
    assert EpochCache().end_offset_for(1, 10) == (UNDEFINED, UNDEFINED)


def test_a_returning_replica_truncates_where_its_epochs_diverge_from_the_leaders():
    # A led epoch 1 (0..100), wrote on to 160 unreplicated, died; B led epoch 2 from 100
    leader = cache((1, 0), (2, 100))
    returning = cache((1, 0))
    e, end = leader.end_offset_for(returning.latest_epoch(), log_end=300)
    assert (e, end) == (1, 100)
    assert returning.truncation_offset(e, end, log_end=160) == 100  # its 60 bytes go
    # a follower behind in the same epoch keeps all it has
    behind = cache((1, 0), (2, 100))
    e, end = leader.end_offset_for(behind.latest_epoch(), log_end=300)
    assert behind.truncation_offset(e, end, log_end=180) == 180
    # KIP-279: the returning one led epoch 3 the leader never saw (leader: 1, 2, 4)
    leader = cache((1, 0), (2, 100), (4, 200))
    returning = cache((1, 0), (2, 100), (3, 170))
    e, end = leader.end_offset_for(returning.latest_epoch(), log_end=260)
    assert (e, end) == (2, 200)  # the leader's floor epoch of 3, and where it ends there
    assert returning.truncation_offset(e, end, log_end=230) == 170  # epoch 2 ends at 170 here
    returning.truncate_from_end(170)
    assert returning.entries() == [(1, 0), (2, 100)]
    # nothing the leader knows: nothing kept
    assert cache((7, 0)).truncation_offset(UNDEFINED, UNDEFINED, log_end=50) == 0


def test_the_file_survives_a_reopen_and_refuses_damage(tmp_path):
    path = str(tmp_path / "epochs")
    c = EpochCache(path)
    c.assign(0, 0)
    c.assign(3, 4096)
    c.assign(4, 8192)
    c.truncate_from_end(8192)
    assert EpochCache(path).entries() == [(0, 0), (3, 4096)]
    text = open(path).read().replace("3 4096", "3 4097")
    open(path, "w").write(text)
    with pytest.raises(CorruptLogError, match="line 3"):
        EpochCache(path)
    open(path, "w").write("garbage\n")
    with pytest.raises(CorruptLogError, match="not a RayMQ epoch file"):
        EpochCache(path)


def group(**kw) -> ReplicaSet:
    args = dict(shard=0, replicas=["a", "b", "c"], leader="a", epoch=1, min_insync=2,
                lag_max_ms=10_000)
    args.update(kw)
    return ReplicaSet(**args)


def test_the_confirmed_offset_is_the_least_in_sync_end_and_never_goes_back():
    g = group()
    g.appended(100)
    assert g.confirmed == 0 and g.ack(100) is Ack.WAIT
    g.fetched("b", 100, 100, now_ms=1)
    assert g.confirmed == 0  # c, in sync, holds nothing yet
    g.fetched("c", 60, 100, now_ms=1)
    assert g.confirmed == 60 and g.ack(60) is Ack.OK and g.ack(61) is Ack.WAIT
    g.shrink(now_ms=10_002)  # c never caught up: out; b caught up at 1: out too
    assert g.in_sync == {"a"} and g.confirmed == 60  # never back
    assert g.ack(60) is Ack.NOT_ENOUGH
    with pytest.raises(NotEnoughReplicasError, match="min_insync_replicas is 2"):
        g.refuse_if_short()


def test_a_slow_follower_leaves_the_set_and_rejoins_once_caught_up():
    g = group()
    g.appended(100)
    g.fetched("b", 100, 100, now_ms=1_000)
    g.fetched("c", 100, 100, now_ms=1_000)
    assert g.confirmed == 100
    g.appended(300)
    g.fetched("b", 300, 300, now_ms=9_000)
    g.fetched("c", 200, 300, now_ms=9_000)  # behind: not caught up
    assert g.shrink(now_ms=11_001) == ["c"] and g.in_sync == {"a", "b"}
    assert g.confirmed == 300 and g.ack(300) is Ack.OK  # b and a hold it: 2 in sync
    g.fetched("c", 300, 300, now_ms=11_500)  # holds the confirmed offset again
    assert g.in_sync == {"a", "b", "c"}


def test_election_only_from_the_in_sync_set_with_the_epoch_bumped_and_old_epochs_fenced():
    g = group()
    g.appended(100)
    g.fetched("b", 100, 100, now_ms=1)
    g.fetched("c", 10, 100, now_ms=1)
    g.shrink(now_ms=20_000)
    g.in_sync = {"a", "b"}
    assert g.elect(alive={"b", "c"}, now_ms=20_000) == "b" and g.epoch == 2
    assert g.in_sync == {"b"}
    with pytest.raises(NotLeaderError):
        g.check_epoch(1)  # the deposed leader's requests
    g.check_epoch(2)
    assert g.elect(alive={"c"}, now_ms=20_001) is None and g.epoch == 2  # c is not in sync
    assert g.elect(alive={"c"}, now_ms=20_001, unclean=True) == "c" and g.epoch == 3
    g2 = group()
    assert g2.elect(alive={"a", "b", "c"}, now_ms=5, prefer="c") == "c"  # preferred leader
    assert g2.in_sync == {"a", "b", "c"} and g2.shrink(now_ms=5) == []  # in sync as of it


def test_a_returning_follower_rejoins_only_holding_the_current_epoch_s_start():
    g = group()
    assert g.elect(alive={"b"}, now_ms=0) == "b" and g.in_sync == {"b"}
    g.took_over(500)  # epoch 2 starts at 500 on b
    g.fetched("a", 400, 500, now_ms=1)  # under the epoch's start: not yet
    g.fetched("c", 450, 500, now_ms=1)
    assert g.in_sync == {"b"}
    g.fetched("c", 500, 500, now_ms=2)
    assert g.in_sync == {"b", "c"}


def test_the_candidate_holding_the_most_is_elected():
    g = group()
    assert g.elect(alive={"b", "c"}, now_ms=0, ends={"b": 2**40, "c": 2**40 + 1}) == "c"
    assert group().elect(alive={"a", "b"}, now_ms=0, ends={"a": 7, "b": 7}) == "a"  # by name


def test_a_group_is_built_valid():
    with pytest.raises(ValueError):
        group(leader="z")
    with pytest.raises(ValueError):
        group(min_insync=4)
