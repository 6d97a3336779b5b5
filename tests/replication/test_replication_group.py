"""Replicated shards in one process (no Ray): three ``ShardReplica`` s of one shard, a real
``Controller`` on a manual clock (leases expire when the test moves it), replicas calling
each other directly.  A replica "dies" by being closed and cut off (its calls fail)."""
from __future__ import annotations

import pytest

from raymq.actors.config import ClusterConfig
from raymq.actors.controller import Controller
from raymq.actors.replication.replica import ShardReplica
from raymq.actors.replication.groups import replica_name
from raymq.actors.shard import BrokerShard
from raymq.storage import RecordBatch
from raymq.storage.clock import ManualClock
from raymq.storage.errors import (BrokerUnavailableError, NotEnoughReplicasError,
                                  NotLeaderError)
from tests.helpers import wait_for

LEASE_MS = 1000


class Group:
    def __init__(self, tmp_path, n: int = 3, **settings):
        self.tmp = tmp_path
        self.cfg = ClusterConfig(data_dir=str(tmp_path), num_shards=1, replication_factor=n,
                                 replica_lease_ms=LEASE_MS, send_timeout_ms=4000, **settings)
        self.clock = ManualClock()
        self.controller = Controller(self.cfg, clock=self.clock)
        self.replicas: dict[str, ShardReplica] = {}
        self.down: set[str] = set()
        self.names = [replica_name(0, k) for k in range(n)]
        for name in self.names:
            self.start(name)

    def start(self, name: str) -> ShardReplica:
        self.down.discard(name)
        r = ShardReplica(0, name, self.cfg, str(self.tmp / name), controller=self._control,
                         call_replica=self._call, make_shard=self._shard, node=f"node-{name}",
                         background=False)
        self.replicas[name] = r
        return r

    def _control(self, method, *args):
        return getattr(self.controller, method)(*args)

    def _call(self, name, method, args, timeout_s):
        if name in self.down:
            raise BrokerUnavailableError(f"{name} is down")
        return getattr(self.replicas[name], method)(*args)

    def _shard(self, directory):
        sh = BrokerShard(0, self.cfg, directory=directory)
        sh.set_routes([("t", 0), ("t", 1)])
        return sh

    def beat(self, *names):
        for name in names or self.names:
            if name not in self.down:
                self.replicas[name].heartbeat()

    def kill(self, name: str) -> None:
        self.down.add(name)
        self.replicas[name].close()

    @property
    def leader(self) -> ShardReplica:
        name, _epoch = self.controller.replica_leaders()[0]
        return self.replicas[name]

    def in_sync(self) -> list[str]:
        return self.controller.replicas()[0]["in_sync"]

    def settle(self):
        """Heartbeats until every live replica is in sync with the leader."""
        def done():
            self.beat()
            live = sorted(set(self.names) - self.down)
            return self.in_sync() == live
        wait_for(done, 20, "every live replica in sync")

    def close(self):
        for name, r in self.replicas.items():
            if name not in self.down:
                r.close()


@pytest.fixture
def group(tmp_path):
    g = Group(tmp_path)
    g.settle()
    yield g
    g.close()


def send(replica, bodies, pid=0, seq=0, queue=0):
    return replica.serving(write=True).send(RecordBatch("t", queue, bodies), pid, seq)


def bodies_of(replica, queue=0):
    got = replica.serving().pull([("t", queue, 0, 100_000)], 0)
    return [bytes(b) for b in got[0][2].bodies]


def test_first_replica_leads_and_a_send_is_acknowledged_once_every_in_sync_replica_holds_it(group):
    leader = group.leader
    assert group.controller.replicas()[0]["epoch"] == 1
    reply = send(leader, [b"a", b"b"])
    assert reply.status == "SEND_OK"
    ends = {n: group.replicas[n].log_end() for n in group.names}
    assert len(set(ends.values())) == 1 and ends[leader.name] > 0  # all hold it
    assert bodies_of(leader) == [b"a", b"b"]
    followers = [group.replicas[n] for n in group.names if n != leader.name]
    with pytest.raises(NotLeaderError, match="does not lead"):
        followers[0].serving()


def test_failover_keeps_every_acknowledged_message_and_the_group_offsets(group):
    old = group.leader
    for i in range(20):
        assert send(old, [b"m%d" % i], pid=7, seq=i + 1).status == "SEND_OK"
    old.serving().commit_offsets("g", {("t", 0): 15})
    send(old, [b"after-commit"], pid=7, seq=21)  # (the offsets ride on the next fetch)
    group.kill(old.name)
    group.clock.advance(LEASE_MS + 1)
    group.beat()
    new = group.leader
    assert new.name != old.name
    assert group.controller.replicas()[0]["epoch"] == 2
    assert bodies_of(new) == [b"m%d" % i for i in range(20)] + [b"after-commit"]
    assert new.serving().get_offsets("g", [("t", 0)]) == {("t", 0): 15}
    # a producer's retry of its last acknowledged send is a duplicate on the new leader
    again = send(new, [b"after-commit"], pid=7, seq=21)
    assert again.duplicate and again.status == "SEND_OK"
    assert bodies_of(new).count(b"after-commit") == 1


def test_a_follower_down_past_the_lag_limit_leaves_the_set_and_sends_fail_with_not_enough(tmp_path):
    g = Group(tmp_path, n=2, replica_lag_max_ms=300)
    try:
        g.settle()
        leader = g.leader
        follower = next(n for n in g.names if n != leader.name)
        assert send(leader, [b"x"]).status == "SEND_OK"
        g.kill(follower)

        def shrunk():
            g.beat(leader.name)
            return g.in_sync() == [leader.name]
        wait_for(shrunk, 10, "the in-sync set to shrink")
        with pytest.raises(NotEnoughReplicasError) as err:
            send(leader, [b"y"])
        text = str(err.value)
        assert "\n" not in text and "shard-0" in text and "min_insync_replicas is 2" in text
        # it comes back (same directory), catches up and rejoins
        g.start(follower)
        g.settle()
        assert send(leader, [b"z"]).status == "SEND_OK"
        assert g.replicas[follower].log_end() == leader.log_end()
    finally:
        g.close()


def test_a_deposed_leader_acknowledges_nothing_and_is_cut_back_when_it_rejoins(group):
    old = group.leader
    assert send(old, [b"kept"]).status == "SEND_OK"
    # the old leader stops heartbeating (paused): its lease runs out, another is elected
    group.clock.advance(LEASE_MS + 1)
    others = [n for n in group.names if n != old.name]
    group.beat(*others)
    new = group.leader
    assert new.name != old.name
    # the old leader, not yet told, takes a write: it cannot be acknowledged, since the
    # new leader (in its in-sync set) no longer copies from it
    reply = send(old, [b"lost"])
    assert reply.status != "SEND_OK"
    assert send(new, [b"new"]).status == "SEND_OK"
    group.beat(old.name)  # told: it follows the new leader and cuts its unacknowledged write
    group.settle()
    follower_view = group.replicas[old.name]
    wait_for(lambda: follower_view.log_end() == new.log_end(), 10, "the old leader to catch up")
    assert bodies_of(new) == [b"kept", b"new"]
    # and it leads with exactly the new leader's records when elected back
    group.controller.replica_elect(0, old.name)
    group.beat()
    assert group.leader.name == old.name
    assert bodies_of(old) == [b"kept", b"new"]


def test_a_wiped_follower_copies_everything_back(group):
    leader = group.leader
    for i in range(50):
        send(leader, [b"%d" % i] * 10, queue=i % 2)
    victim = next(n for n in group.names if n != leader.name)
    group.kill(victim)
    import shutil
    shutil.rmtree(group.tmp / victim)
    group.start(victim)
    group.settle()
    assert group.replicas[victim].log_end() == leader.log_end()
    group.kill(leader.name)
    group.clock.advance(LEASE_MS + 1)
    group.beat()
    new = group.leader
    assert sum(len(bodies_of(new, q)) for q in (0, 1)) == 500


def test_readers_see_only_what_the_in_sync_replicas_hold(group):
    leader = group.leader
    assert send(leader, [b"one"]).status == "SEND_OK"
    for n in group.names:
        if n != leader.name:
            group.kill(n)  # nobody copies what follows
    reply = send(leader, [b"two"])
    assert reply.status == "FLUSH_SLAVE_TIMEOUT"
    assert bodies_of(leader) == [b"one"]  # written, not confirmed: not read


def test_committed_offsets_are_held_by_the_followers_before_the_commit_returns(group):
    leader = group.leader
    send(leader, [b"a", b"b", b"c"])
    leader.serving().commit_offsets("g", {("t", 0): 2})  # (a record: answered once held)
    group.kill(leader.name)
    group.clock.advance(LEASE_MS + 1)
    group.beat()
    assert group.leader.serving().get_offsets("g", [("t", 0)]) == {("t", 0): 2}


def test_a_slow_take_over_keeps_the_lease(tmp_path):
    """A new leader whose recovery takes longer than the lease keeps heartbeating (the role
    thread recovers), so the controller does not elect another meanwhile."""
    import threading
    from raymq.storage.clock import SystemClock
    cfg = ClusterConfig(data_dir=str(tmp_path), num_shards=1, replication_factor=2,
                        replica_lease_ms=400, send_timeout_ms=4000)
    controller = Controller(cfg, clock=SystemClock())
    release = threading.Event()
    replicas = {}

    def make_shard(directory):
        release.wait(10)  # recovery of a big log: three leases long
        sh = BrokerShard(0, cfg, directory=directory)
        sh.set_routes([("t", 0)])
        return sh

    def call(name, method, args, timeout_s):
        return getattr(replicas[name], method)(*args)
    names = [replica_name(0, k) for k in range(2)]
    # (a new group is led once every replica reported: the other one, new and silent after)
    controller.replica_heartbeat(0, names[1], "node-1", 0, 0)
    replicas[names[0]] = ShardReplica(0, names[0], cfg, str(tmp_path / names[0]),
                                      controller=lambda m, *a: getattr(controller, m)(*a),
                                      call_replica=call, make_shard=make_shard)
    try:
        wait_for(lambda: controller.replica_leaders()[0][0] == names[0], 10, "a leader")
        beats_then = dict(controller.replica_groups._seen)
        # the recovery is under way for three leases: the heartbeats go on meanwhile
        wait_for(lambda: controller.replica_groups._seen[names[0]] - beats_then[names[0]]
                 > 3 * 400, 10, "heartbeats during the take-over")
        assert controller.replica_leaders()[0] == (names[0], 1)
        release.set()
        wait_for(lambda: replicas[names[0]].shard is not None, 10, "the take-over to end")
        assert controller.replica_leaders()[0] == (names[0], 1)
    finally:
        release.set()
        replicas[names[0]].close()


def _files(directory):
    import os
    out = {}
    for d, _dirs, names in os.walk(directory):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), directory)] = f.read()
    return out


def test_a_new_leader_starts_from_the_snapshots_the_old_one_shipped_not_the_whole_history(tmp_path):
    """The Kafka-style index's snapshot and the timer wheel reach the followers, so a new
    leader replays only what follows them (and still has every transaction and timer)."""
    import json
    import time
    from raymq.actors.protocol import Prop
    from raymq.actors.replication.parts import KTX_SNAPSHOT, TIMER_DIR
    g = Group(tmp_path, state_log_compact_records=5, timer_bucket_ms=1000,
              replica_timer_ship_ms=0)
    try:
        g.settle()
        old = g.leader
        shard = old.serving(write=True)
        followers = [n for n in g.names if n != old.name]
        # a checkpoint of the empty wheel reaches the followers first (under load it
        # did now and then; with the wheel shipped once a minute its successor then
        # waited a minute): the checkpoint of the send below must still follow it
        wait_for(lambda: all((tmp_path / n / TIMER_DIR / "checkpoint.json").exists()
                             for n in followers), 20, "an empty wheel's checkpoint shipped")
        for i in range(10):  # committed transactions of ten producers
            shard.ktx_register(100 + i, 0, [("t", 0)])
            shard.ktx_send(RecordBatch("t", 0, [b"tx%d" % i]), 100 + i, 0, 1, 0)
            shard.ktx_end(100 + i, 0, "COMMIT")
        assert shard.ktx.compact()
        now = int(time.time() * 1000)
        batch = RecordBatch("t", 1, [b"soon", b"later"], properties=[
            {Prop.DELIVER_AT: str(now)}, {Prop.DELIVER_AT: str(now + 3_600_000)}])
        assert shard.send(batch, 0, 0).status == "SEND_OK"
        # (the timer wheel's checkpoint comes once "soon"'s bucket is over)
        def indexed(name):  # (a bucket over before the send checkpoints nothing indexed)
            path = tmp_path / name / TIMER_DIR / "checkpoint.json"
            return path.exists() and json.loads(path.read_bytes()).get("indexed", 0)

        wait_for(lambda: indexed(old.name), 20, "the leader's timer checkpoint of the send")
        shard.ktx_register(200, 0, [("t", 0)])  # one more after the snapshot
        shard.ktx_send(RecordBatch("t", 0, [b"tx-tail"]), 200, 0, 1, 0)
        shard.ktx_end(200, 0, "COMMIT")
        snapshot = (tmp_path / old.name / KTX_SNAPSHOT).read_bytes()

        def shipped():
            return all((tmp_path / n / KTX_SNAPSHOT).exists()
                       and (tmp_path / n / KTX_SNAPSHOT).read_bytes() == snapshot
                       and indexed(n)  # (the checkpoint of the send, not an earlier one)
                       for n in followers)
        wait_for(shipped, 20, "the snapshots on the followers")
        for n in followers:
            wheel = json.loads((tmp_path / n / TIMER_DIR / "checkpoint.json").read_bytes())
            assert wheel["indexed"] >= 1
        g.kill(old.name)
        g.clock.advance(LEASE_MS + 1)
        g.beat()
        new = g.leader.serving()
        assert new.ktx.replayed < 5  # the tail after the snapshot, not all 30-odd records
        got = new.pull([("t", 0, 0, 1000)], 0, None, None, "read_committed")[0][2]
        assert [m.body for m in got.messages()] == [b"tx%d" % i for i in range(10)] + \
            [b"tx-tail"]
        assert new.timers.status()["scheduled"] == 1  # "later" still waits
        delivered = [m.body for m in new.store.read_queue("t", 1, 0, 100)]
        assert delivered == [b"soon"]
    finally:
        g.close()


def test_a_replica_cut_back_drops_the_snapshots_of_what_it_lost(group):
    """A deposed leader's snapshot may cover records the new leader never had: cut back,
    it keeps no snapshot of them (the new leader's arrives instead)."""
    from raymq.actors.replication.parts import KTX_SNAPSHOT
    old = group.leader
    assert send(old, [b"kept"]).status == "SEND_OK"
    group.clock.advance(LEASE_MS + 1)
    group.beat(*[n for n in group.names if n != old.name])
    new = group.leader
    assert new.name != old.name
    # the deposed leader, not yet told, takes a transaction and snapshots it
    shard = old.shard
    shard.ktx.compact_records = 1
    shard.ktx_register(7, 0, [("t", 0)])  # (written, never acknowledged)
    shard.ktx.compact()  # (or its own thread did)
    stale = (group.tmp / old.name / KTX_SNAPSHOT).read_bytes()
    group.beat(old.name)  # told: it follows the new leader and cuts its log back
    group.settle()
    wait_for(lambda: group.replicas[old.name].log_end() == new.log_end(), 10, "caught up")
    path = group.tmp / old.name / KTX_SNAPSHOT
    assert not path.exists() or path.read_bytes() != stale
    group.controller.replica_elect(0, old.name)
    group.beat()
    assert group.leader.name == old.name
    got = old.serving().pull([("t", 0, 0, 1000)], 0, None, None, "read_uncommitted")[0][2]
    assert [m.body for m in got.messages()] == [b"kept"]
    assert old.serving().ktx.state.open == {}  # no trace of the lost transaction


def test_a_closed_replica_has_no_heartbeat_in_flight(tmp_path):
    """``close`` returns only once the heartbeat thread is done: RayMQ's teardown closes the
    replicas before it kills the controller, and a heartbeat still in flight there would
    end in a task killed by ``ray.kill`` (a line Ray prints on the user's terminal)."""
    import threading
    from raymq.storage.clock import SystemClock
    cfg = ClusterConfig(data_dir=str(tmp_path), num_shards=1, replication_factor=1,
                        replica_lease_ms=400, send_timeout_ms=4000)
    controller = Controller(cfg, clock=SystemClock())
    entered, in_flight = threading.Event(), []

    def control(method, *args):
        if method != "replica_heartbeat":
            return getattr(controller, method)(*args)
        in_flight.append(1)
        entered.set()
        try:
            threading.Event().wait(0.3)  # the controller answers slowly
            return controller.replica_heartbeat(*args)
        finally:
            in_flight.pop()

    name = replica_name(0, 0)
    replica = ShardReplica(0, name, cfg, str(tmp_path / name), controller=control,
                           call_replica=lambda *a: None, make_shard=lambda d: None)
    assert entered.wait(10)
    replica.close()
    assert in_flight == []


def test_deleted_offsets_stay_deleted_on_a_new_leader_and_after_a_restart(group, tmp_path):
    """(Kafka's OffsetDelete) A delete is a record of the offsets log as a commit is: a new
    leader, and a shard opened again from its files, hold what the log says last."""
    from tests.helpers import open_shard
    old = group.leader
    for i in range(5):
        assert send(old, [b"m%d" % i], pid=7, seq=i + 1).status == "SEND_OK"
    shard = old.serving()
    shard.commit_offsets("g", {("t", 0): 3, ("t", 1): 0})
    shard.delete_offsets("g", [("t", 0), ("t", 1)])
    shard.commit_offsets("g", {("t", 1): 0})  # (committed again after its delete)
    assert shard.get_offsets("g", [("t", 0), ("t", 1)]) == {("t", 0): -1, ("t", 1): 0}
    send(old, [b"after"], pid=7, seq=6)
    group.kill(old.name)
    group.clock.advance(LEASE_MS + 1)
    group.beat()
    new = group.leader
    assert new.name != old.name
    assert new.serving().get_offsets("g", [("t", 0), ("t", 1)]) == {("t", 0): -1, ("t", 1): 0}
    sh = open_shard(tmp_path / "one", [("t", 0), ("t", 1)])
    try:
        sh.send(RecordBatch("t", 0, [b"x"] * 4))
        sh.commit_offsets("h", {("t", 0): 4})
        sh.delete_offsets("h", [("t", 0)])
        sh.commit_offsets("h", {("t", 0): 2})
        sh.delete_offsets("h", [("t", 0)])
        sh.store.offsets.update({"offsets-log@applied": 0})  # (as a crash before applying)
    finally:
        sh.close()
    again = open_shard(tmp_path / "one", [("t", 0), ("t", 1)])
    try:
        assert again.get_offsets("h", [("t", 0)]) == {("t", 0): -1}
    finally:
        again.close()
