"""Replication's pure logic (issue 26, first part): a replica's leader-epoch file and the
truncation rule of a returning replica (Kafka KIP-101/279, RocketMQ 5's EpochFileCache),
and a shard group's in-sync set, confirmed offset, acknowledgement and election.  No Ray,
time given by hand."""
from __future__ import annotations

import pytest

from raymq.actors.replication.in_sync import Ack, ReplicaSet, choose_leader
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


def test_a_deposed_leader_s_epoch_is_fenced():
    g = group(leader="b", epoch=2)  # (the controller elected b: epoch 2)
    with pytest.raises(NotLeaderError):
        g.check_epoch(1)  # the deposed leader's requests
    g.check_epoch(2)


def test_a_returning_follower_rejoins_only_holding_the_current_epoch_s_start():
    g = group(leader="b", epoch=2)
    g.in_sync = {"b"}  # (a and c were not alive at the election)
    g.took_over(500)  # epoch 2 starts at 500 on b
    g.fetched("a", 400, 500, now_ms=1)  # under the epoch's start: not yet
    g.fetched("c", 450, 500, now_ms=1)
    assert g.in_sync == {"b"}
    g.fetched("c", 500, 500, now_ms=2)
    assert g.in_sync == {"b", "c"}


def test_the_candidate_holding_the_most_is_elected():
    ends = {"b": 2**40, "c": 2**40 + 1}
    assert choose_leader({"b", "c"}, ends.get) == "c"  # whole 64-bit offsets compared
    assert choose_leader({"a", "b"}, {"a": 7, "b": 7}.get) == "a"  # then by name


def test_a_group_is_built_valid():
    with pytest.raises(ValueError):
        group(leader="z")
    with pytest.raises(ValueError):
        group(min_insync=4)


# ------------------------------------------------ parts shipped beside the log
def test_a_part_is_shipped_when_its_version_changes_and_a_slow_part_at_most_every_so_often(tmp_path):
    from raymq.actors.replication.parts import Part, Shipper, file_part
    from raymq.storage.clock import ManualClock
    clock = ManualClock()
    (tmp_path / "snap").write_bytes(b"v1")
    wheel = {"v": 1}
    parts = [file_part("snap", str(tmp_path), "snap"),
             Part("wheel", lambda: wheel["v"], lambda: {"w/x": b"%d" % wheel["v"]},
                  directory="w", every_ms=60_000)]
    s = Shipper(parts, clock)
    first = s.due("f", {})
    assert first["snap"]["files"] == {"snap": b"v1"} and first["wheel"]["files"] == {"w/x": b"1"}
    s.sent("f", first)
    held = {n: p["version"] for n, p in first.items()}
    assert s.due("f", held) == {}  # nothing changed
    wheel["v"] = 2
    (tmp_path / "snap").write_bytes(b"v2-longer")
    again = s.due("f", held)
    assert list(again) == ["snap"]  # the wheel changed too, but was sent under a minute ago
    clock.advance(60_001)
    assert set(s.due("f", held)) == {"snap", "wheel"}
    assert set(s.due("other", {})) == {"snap", "wheel"}  # (per follower)


def test_installed_parts_replace_the_old_whole_and_a_cut_log_forgets_them(tmp_path):
    from raymq.actors.replication import parts as rs
    (tmp_path / "timer" / "b" / "0").mkdir(parents=True)
    (tmp_path / "timer" / "b" / "0" / "5").write_bytes(b"stale bucket")
    rs.install(str(tmp_path), {
        "wheel": {"version": 3, "directory": "timer",
                  "files": {"timer/checkpoint.json": b"{}", "timer/b/0/7": b"pairs"}},
        "ktx-index": {"version": [1, 2, 3], "directory": None,
                      "files": {"ktx-index.snapshot": b"snap"}}})
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) \
        == ["ktx-index.snapshot", "timer/b/0/7", "timer/checkpoint.json"]
    (tmp_path / "commitlog").mkdir()
    rs.forget(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["commitlog"]


def test_the_parts_are_where_their_owners_write_them(tmp_path):
    import os
    from raymq.actors.kafka_tx import log as txn_log, shard_side as ktx
    from raymq.actors.replication import parts as replica_state
    from raymq.actors.kafka_tx.coordinator import TransactionCoordinator
    from raymq.actors.shard import BrokerShard
    assert replica_state.KTX_SNAPSHOT == ktx.SNAPSHOT_FILE
    assert replica_state.TXN_SNAPSHOT == txn_log.SNAPSHOT_FILE
    sh = BrokerShard(0, {"data_dir": str(tmp_path / "s"), "num_shards": 1}, background=False)
    try:
        assert sh.timers.wheel.directory == os.path.join(sh.directory, replica_state.TIMER_DIR)
        assert [p.name for p in replica_state.parts_of(sh)] == ["ktx-index", "timer"]
    finally:
        sh.close()
    co = TransactionCoordinator(0, {"data_dir": str(tmp_path / "c"), "num_shards": 1},
                                call_shard=lambda *a, **k: None, background=False)
    try:
        [part] = replica_state.parts_of(co)
        assert part.name == "txn-log" and part.version() is None  # (no snapshot yet)
    finally:
        co.close()


def test_status_names_the_in_sync_replicas_even_those_a_restarted_controller_has_not_heard(
        capsys):
    """A controller restarted from what the replicas keep knows the in-sync set before each
    replica's heartbeat tells it that replica's node: ``raymq status`` names the replicas
    (it printed an empty node id for such a one), and the admin API's node is None."""
    from raymq.replica_view import group_doc
    from raymq.tools.cli import _print_replicas
    names = ["shard-0-r0", "shard-0-r1", "shard-0-r2"]
    doc = group_doc({"shard": 0, "leader": names[0], "epoch": 4, "in_sync": names,
                     "replicas": names, "nodes": {names[0]: "a" * 56, names[1]: "b" * 56, names[2]: ""},
                     "alive": names[:2], "log_end": {n: 10 for n in names}})
    assert doc["in_sync"] == ["a" * 56, "b" * 56, None]
    assert doc["in_sync_replicas"] == names
    _print_replicas([doc])
    line = capsys.readouterr().out.splitlines()[1]
    assert line.endswith("in sync 3/3 (shard-0-r0, shard-0-r1, shard-0-r2)"), line
