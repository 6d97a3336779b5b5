"""The schedules a review found to lose acknowledged writes, deliver a refused one or wedge
a group (issue 34), each scripted on the in-process replicated shard of
``tests.replication_sim`` (manual clock, followers stepped, calls held or failing)."""
from __future__ import annotations

import os

import pytest

from raymq.actors.replication.groups import ReplicaGroups, replica_name
from raymq.storage import MessageStore, RecordBatch
from raymq.storage.clock import ManualClock
from raymq.storage.config import StoreConfig
from raymq.storage.epochs import EpochCache
from raymq.storage.errors import NotEnoughReplicasError, NotLeaderError
from raymq.storage.replication import truncate_log
from tests.helpers import wait_for
from raymq.tools.nemesis import LEASE_MS, Sim

R0, R1, R2 = (replica_name(0, k) for k in range(3))


@pytest.fixture
def sim(tmp_path):
    s = Sim(tmp_path)
    s.settle()
    yield s
    s.close()


def lease_out(sim: Sim, *beating) -> None:
    """A lease passes; only ``beating`` heartbeat (each fifth of it, as replicas do) and
    fetch (the others are paused or gone)."""
    for _ in range(6):
        sim.clock.advance(LEASE_MS // 5 + 1)
        sim.beat(*beating)
        for name in beating:
            sim.fetch(name)
    sim.beat(*beating)


# ------------------------------------------------------------------ defect 1
def test_a_fetch_reply_from_a_deposed_leader_is_not_applied_and_nothing_acknowledged_is_lost(sim):
    """Leader A paused; B elected; the follower C, its fetch to A still in flight, follows
    B; a client's send reaches A; A resumed answers C's old fetch with that write.  C must
    not apply it, nor count towards B's acknowledgements with it; B's write R acknowledged
    must survive B's loss, and A's refused write must never be delivered."""
    a = sim.leader_name()
    b, c = sorted(n for n in sim.names if n != a)  # (b: elected first on a tie)
    assert sim.send(a, b"before") == "SEND_OK"
    stale = sim.hold(c, a)  # C's next fetch to A is delivered late
    import threading
    late = threading.Thread(target=sim.fetch, args=(c,), daemon=True)
    late.start()
    assert stale.entered.wait(10)
    sim.paused.add(a)
    lease_out(sim, b, c)
    assert sim.leader_name() == b
    assert sim.replicas[c].following.a.leader == b
    sim.paused.discard(a)  # A resumed: not told yet, it takes a client's send
    thread, out = sim.send(a, b"refused-by-A", wait=False)
    wait_for(lambda: sim.replicas[a].shard.store.max_phys_offset >
             sim.replicas[b].log_end(), 10, "A's write in its log")
    stale.release()  # C's old fetch reaches A now and is answered with that write
    late.join(10)
    sim.beat(a)  # A hears of B: steps down; its client gets an error
    thread.join(10)
    assert out["status"] != "SEND_OK"
    assert b"refused-by-A" not in sim.bodies(c)
    for _ in range(3):
        sim.pump(1)
    assert sim.send(b, b"R") == "SEND_OK"  # acknowledged: held by B and an in-sync C
    sim.kill(b)  # B's node lost; C is elected
    lease_out(sim, a, c)
    new = sim.leader_name()
    assert new in (a, c) and new != b, sim.controller.replicas()
    sim.settle()
    got = sim.bodies(new)
    assert b"R" in got and b"before" in got
    assert b"refused-by-A" not in got
    sim.check()


def test_a_leader_does_not_count_a_follower_past_its_own_end(sim):
    """A fetch from an offset past the leader's log end is answered as diverging and does
    not move the confirmed offset (Kafka: OFFSET_OUT_OF_RANGE)."""
    leader = sim.replicas[sim.leader_name()]
    follower = next(n for n in sim.names if n != leader.name)
    end = leader.log_end()
    before = leader.leader.confirmed()
    reply = leader.replica_fetch(follower, leader.leader.epoch, end + 4096, 0, 1 << 20, -1)
    assert reply.get("diverging") is not None
    assert leader.leader.rs.followers[follower].log_end <= end
    assert leader.leader.confirmed() == before


# ------------------------------------------------------------------ defect 2
def test_a_wiped_leader_never_leads_again_after_a_restart_of_everything(sim):
    """`raymq down`, the leader's disk replaced, `raymq up`: the wiped replica heartbeats
    first, yet leads nothing; it copies everything back."""
    leader = sim.leader_name()
    for i in range(5):
        assert sim.send(leader, b"m%d" % i) == "SEND_OK"
    for name in sim.names:
        sim.kill(name)
    sim.restart_controller()
    sim.start(leader, wipe=True)
    sim.beat(leader)  # first
    for name in sim.names:
        if name != leader:
            sim.start(name)
    sim.settle()
    new = sim.leader_name()
    assert new != leader
    assert sim.bodies(new) == [b"m%d" % i for i in range(5)]
    assert sim.bodies(leader) == [b"m%d" % i for i in range(5)]  # copied back
    sim.check()


def test_a_wiped_leader_alone_waits_for_an_in_sync_replica(sim):
    leader = sim.leader_name()
    assert sim.send(leader, b"kept") == "SEND_OK"
    for name in sim.names:
        sim.kill(name)
    sim.restart_controller()
    sim.start(leader, wipe=True)
    for _ in range(3):
        sim.beat(leader)
        sim.clock.advance(LEASE_MS + 1)
    assert sim.leader_name() != leader or sim.replicas[leader].leader is None
    other = next(n for n in sim.names if n != leader)
    sim.start(other)
    sim.settle()
    assert sim.leader_name() == other
    assert sim.bodies(other) == [b"kept"]


# ------------------------------------------------------------------ defect 3
def test_a_stale_heartbeat_does_not_grow_the_in_sync_set_again():
    clock = ManualClock()
    g = ReplicaGroups(1, 3, LEASE_MS, clock, lambda: None)
    for r in (R0, R1, R2):
        g.heartbeat(0, r, "n", 0, 100, None)
    version = g.describe()[0]["version"]
    g.heartbeat(0, R0, "n", 1, 100, [R0, R1, R2], isr_version=version)
    version = g.describe()[0]["version"]
    assert g.describe()[0]["in_sync"] == [R0, R1, R2]
    # the leader reads its set for a heartbeat, then asks to let R2 go (lagging); the
    # heartbeat, sent before, arrives after
    ok, doc = g.alter_isr(0, R0, 1, [R0, R1], version)
    assert ok and doc["in_sync"] == [R0, R1]
    g.heartbeat(0, R0, "n", 1, 100, [R0, R1, R2], isr_version=version)
    assert g.describe()[0]["in_sync"] == [R0, R1]
    with pytest.raises(NotEnoughReplicasError):
        g.elect(0, to=R2)
    # an in-sync change asked at a stale version is refused
    assert g.alter_isr(0, R0, 1, [R0, R1, R2], version)[0] is False
    assert g.alter_isr(0, R0, 1, [R0, R1, R2], doc["version"])[0] is True


# ------------------------------------------------------------------ defect 4
def _truncate_until_agreed(mine: EpochCache, leader: EpochCache, leader_end: int,
                           log_end: int) -> int:
    """The follower's side of fetches answered ``diverging`` until one is not."""
    for _ in range(10):
        diverging = leader.diverging(leader_end, mine.latest_epoch(), log_end)
        if diverging is None:
            return log_end
        log_end = min(log_end, mine.truncation_offset(*diverging, log_end))
        mine.truncate_from_end(log_end)
    raise AssertionError("never agreed")


def test_truncation_by_leader_epoch_takes_as_many_rounds_as_needed():
    mine = EpochCache()
    for e, s in ((1, 0), (3, 100)):
        mine.assign(e, s)
    leader = EpochCache()
    for e, s in ((1, 0), (2, 50), (4, 300)):
        leader.assign(e, s)
    assert _truncate_until_agreed(mine, leader, 400, 200) == 50
    assert mine.entries() == [(1, 0)]


def test_a_divergence_found_after_the_first_fetch_is_cut_too(sim):
    """A follower caught up and fetching is cut back when the leader's log turns out to
    differ from its own (the next fetch carries its last epoch)."""
    leader = sim.leader_name()
    assert sim.send(leader, b"a") == "SEND_OK"
    follower = next(n for n in sim.names if n != leader)
    r = sim.replicas[follower]
    # the follower's log grows by a frame the leader never wrote (a deposed epoch's)
    other = MessageStore(str(sim.tmp / "other"), sim.cfg.store_config(), sim.clock)
    other.put(RecordBatch("t", 0, [b"x"]))
    start, data = other.read_frames(r.store.max_phys_offset, 1 << 20)
    other.close()
    assert sim.send(leader, b"b") == "SEND_OK"
    sim.kill(follower)
    sim.start(follower)
    stranger = sim.replicas[follower]
    stranger.store.close()
    truncate_log(os.path.join(stranger.directory, "commitlog"),
                 sim.cfg.segment_size_bytes, sim.replicas[leader].log_end() - len(data))
    stranger.store = stranger.open_store()
    end = stranger.store.max_phys_offset
    stranger.store.append_replicated(end, data)  # (same size as "b"'s frame)
    stranger.epochs.assign(5, stranger.store.max_phys_offset)  # an epoch the leader lacks
    sim.settle()
    assert sim.bodies(follower) == sim.bodies(leader) == [b"a", b"b"]


# ------------------------------------------------------------------ defect 5
def test_a_deposed_leader_does_not_acknowledge_a_commit_of_offsets(sim):
    a = sim.leader_name()
    for i in range(3):
        assert sim.send(a, b"%d" % i) == "SEND_OK"
    sim.paused.add(a)
    lease_out(sim, *[n for n in sim.names if n != a])
    sim.paused.discard(a)
    with pytest.raises((NotLeaderError, NotEnoughReplicasError, TimeoutError)):
        commit(sim, a, 3)
    new = sim.leader_name()
    assert sim.replicas[new].serving().get_offsets("g", [("t", 0)]) == {("t", 0): -1}


def commit(sim: Sim, name: str, offset: int) -> None:
    """A consumer's commit of ``offset`` to replica ``name`` (the followers pumped)."""
    import threading
    err: list = []

    def run():
        try:
            sim.replicas[name].serving(write=True).commit_offsets("g", {("t", 0): offset})
        except Exception as e:  # noqa: BLE001
            err.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    for _ in range(400):
        t.join(0.005)
        if not t.is_alive():
            break
        sim.pump(1)
    if t.is_alive():
        sim.clock.advance(sim.cfg.send_timeout_ms)
        leader = sim.replicas[name].leader
        if leader is not None:
            with leader._cond:
                leader._acks.notify_all()
        t.join(10)
    if err:
        raise err[0]


def test_offsets_are_refused_like_a_send_when_too_few_replicas_are_in_sync(tmp_path):
    s = Sim(tmp_path, n=2, replica_lag_max_ms=300)
    try:
        s.settle()
        leader = s.leader_name()
        assert s.send(leader, b"x") == "SEND_OK"
        follower = next(n for n in s.names if n != leader)
        s.kill(follower)
        for _ in range(3):
            s.clock.advance(LEASE_MS + 1)
            s.beat(leader)
        assert s.in_sync() == [leader]
        with pytest.raises(NotEnoughReplicasError):
            commit(s, leader, 1)
    finally:
        s.close()


def test_an_acknowledged_commit_is_held_by_the_new_leader(sim):
    a = sim.leader_name()
    for i in range(3):
        assert sim.send(a, b"%d" % i) == "SEND_OK"
    commit(sim, a, 2)  # acknowledged: and then nothing more reaches the followers
    sim.kill(a)
    lease_out(sim, *[n for n in sim.names if n != a])
    new = sim.leader_name()
    assert new != a
    assert sim.replicas[new].serving().get_offsets("g", [("t", 0)]) == {("t", 0): 2}


# ------------------------------------------------------------------ defect 6
def test_a_put_copied_in_part_leaves_no_orphan_frames(tmp_path):
    cfg = StoreConfig(max_frame_bytes=140_000, max_message_bytes=4096)
    leader = MessageStore(str(tmp_path / "leader"), cfg)
    follower = MessageStore(str(tmp_path / "follower"), cfg)
    leader.put(RecordBatch("t", 0, [b"first"]))
    start, data = leader.read_frames(follower.max_phys_offset, 1 << 20)
    follower.append_replicated(start, data)
    put_start = follower.max_phys_offset
    leader.put(RecordBatch("t", 0, [bytes(4000)] * 100))  # several frames, one put
    start, data = leader.read_frames(put_start, 1)  # the first frame only
    assert start == put_start and start + len(data) < leader.max_phys_offset
    follower.append_replicated(start, data)
    assert follower.complete_end == put_start
    follower.checkpoint()  # (its flusher's): never in the middle of a put
    follower.close()
    again = MessageStore(str(tmp_path / "follower"), cfg)  # a new leader opens it
    assert again.max_phys_offset == put_start  # the unfinished put is cut
    assert [bytes(m.body) for m in again.read_queue("t", 0, 0, 100)] == [b"first"]
    again.close()
    os.unlink(tmp_path / "follower" / "checkpoint")  # a rebuild from the log: fine too
    rebuilt = MessageStore(str(tmp_path / "follower"), cfg)
    assert [bytes(m.body) for m in rebuilt.read_queue("t", 0, 0, 100)] == [b"first"]
    rebuilt.close()
    leader.close()


def test_a_follower_elected_in_the_middle_of_a_put_cuts_it(tmp_path):
    s = Sim(tmp_path)
    try:
        s.settle()
        a = s.leader_name()
        assert s.send(a, b"first") == "SEND_OK"
        b = next(n for n in s.names if n != a)
        put_start = s.replicas[b].log_end()
        store = s.replicas[a].serving().store
        # (never acknowledged: nobody copies all of it)
        _in_background(store.put, RecordBatch("t", 0, [bytes(1 << 20)] * 20))
        wait_for(lambda: store.max_phys_offset > put_start + (20 << 20), 20, "the put written")
        start, data = s.replicas[a].serving().store.read_frames(put_start, 1)
        s.replicas[b].store.append_replicated(start, data)  # one fetch's worth
        s.replicas[b].store.checkpoint()
        s.kill(a)
        lease_out(s, *[n for n in s.names if n != a])
        new = s.leader_name()
        assert new != a
        s.settle()
        assert s.bodies(new) == [b"first"]
        assert s.send(new, b"next") == "SEND_OK"
        assert s.bodies(new) == [b"first", b"next"]
        s.check()
    finally:
        s.close()


# ------------------------------------------------------------------ defect 7
@pytest.mark.parametrize("leader_too", [False, True], ids=["controller", "controller+leader"])
def test_the_controller_s_files_lost_nothing_lost_and_no_wedge(sim, leader_too):
    a = sim.leader_name()
    for i in range(3):
        assert sim.send(a, b"m%d" % i) == "SEND_OK"
    epoch = sim.controller.replica_groups.leader(0)[1]
    sim.restart_controller(wipe=True)
    if leader_too:
        sim.kill(a)
    sim.beat()
    sim.clock.advance(LEASE_MS + 1)
    sim.settle()
    new, new_epoch = sim.controller.replica_groups.leader(0)
    assert new_epoch >= epoch and (new != a or not leader_too)
    assert sim.bodies(new) == [b"m%d" % i for i in range(3)]
    assert sim.send(new, b"after") == "SEND_OK"
    sim.check()


def create_topic(sim: Sim, name: str, queues: int) -> dict:
    """``create_topic`` as a client asks it: answered once replicas keep the topic (they
    take it with their heartbeats, which go on meanwhile)."""
    import threading
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(
        doc=sim.controller.create_topic(name, queues)), daemon=True)
    t.start()
    while t.is_alive():
        sim.beat()
        t.join(0.01)
    return out["doc"]


def test_a_topic_is_answered_only_once_replicas_keep_it(sim):
    from raymq.storage.errors import BrokerUnavailableError
    with pytest.raises(BrokerUnavailableError, match="fewer than 2 replicas took it"):
        sim.controller.create_topic("orders", 3)  # (nobody heartbeats)
    assert create_topic(sim, "orders", 3)["queues"] == 3  # (asked again: waits again)
    kept = [n for n in sim.names if sim.replicas[n]._meta.get("topics", {}).get("orders")]
    assert len(kept) >= 2


def test_a_controller_that_lost_its_files_takes_topics_back_from_the_replicas(sim):
    from raymq.storage.errors import BrokerUnavailableError
    routes = create_topic(sim, "orders", 3)["routes"]
    sim.restart_controller(wipe=True)
    with pytest.raises(BrokerUnavailableError, match="taking back its topics"):
        sim.controller.create_topic("other", 1)
    for _ in range(3):
        sim.beat()
    assert sim.controller.describe_topic("orders")["routes"] == routes
    create_topic(sim, "other", 1)  # (and it goes on from there)
    sim.restart_controller(wipe=True)
    for _ in range(3):
        sim.beat()
    assert set(sim.controller.topics()) == {"orders", "other"}


def test_a_new_group_waits_for_every_replica_before_its_first_leader(tmp_path):
    """Without the controller's record, one replica alone (a wiped disk?) does not start
    the group over at epoch 1."""
    s = Sim(tmp_path)
    try:
        s.beat(R0)
        assert s.leader_name() is None
        s.beat(R1, R2)
        s.settle()
        assert s.leader_name() is not None
    finally:
        s.close()


# ------------------------------------------------------------------ defect 8
def test_when_every_in_sync_replica_was_lost_the_first_back_leads(sim):
    a = sim.leader_name()
    for i in range(3):
        assert sim.send(a, b"m%d" % i) == "SEND_OK"
    for name in sim.names:
        sim.paused.add(name)
    for _ in range(3):
        sim.clock.advance(LEASE_MS + 1)
        sim.controller.replica_leaders()  # (the controller's ticks)
    back = next(n for n in sim.names if n != a)
    sim.paused.discard(back)
    sim.clock.advance(LEASE_MS + 1)
    sim.beat(back)
    sim.beat(back)
    assert sim.leader_name() == back
    assert sim.bodies(back) == [b"m%d" % i for i in range(3)]


def test_an_operator_s_unclean_election_says_what_may_be_lost(sim):
    a = sim.leader_name()
    follower = next(n for n in sim.names if n != a)
    g = sim.controller.replica_groups
    ok, _doc = g.alter_isr(0, a, g.leader(0)[1], [a], None)  # the follower lags out
    assert ok
    sim.kill(a)
    sim.clock.advance(LEASE_MS + 1)
    sim.beat(follower)
    with pytest.raises(NotEnoughReplicasError) as err:
        sim.controller.replica_elect(0)
    assert "not in sync" in str(err.value) and "\n" not in str(err.value)
    doc = sim.controller.replica_elect(0, unclean=True)
    assert doc["leader"] != a


# ------------------------------------------------------------------ also
def test_look_ups_and_check_backs_see_only_what_is_confirmed(sim):
    from raymq.actors.protocol import HALF_TOPIC, Prop
    from raymq.storage.errors import InvalidMessageError
    a = sim.leader_name()
    assert sim.send(a, b"confirmed") == "SEND_OK"
    for name in sim.names:
        if name != a:
            sim.paused.add(name)  # nobody copies what follows
    shard = sim.replicas[a].serving()
    batch = RecordBatch("t", 0, [b"unconfirmed"], keys=["k"])
    sent = _in_background(shard.send, batch, 0, 0)
    wait_for(lambda: shard.store.max_queue_offset("t", 0) == 2, 10, "the write")
    first, second = shard.store.read_queue("t", 0, 0, 2)
    assert shard.get_message(first.phys_offset).body == b"confirmed"
    with pytest.raises(InvalidMessageError, match="not confirmed"):
        shard.get_message(second.phys_offset)
    assert shard.find_by_key("t", "k") == []
    # a half written but not confirmed is not checked back yet
    half = RecordBatch(HALF_TOPIC, 0, [b"half"], properties=[{
        Prop.TRAN_MSG: "true", Prop.PRODUCER_GROUP: "pg", Prop.REAL_TOPIC: "t",
        Prop.REAL_QID: "0"}])
    halved = _in_background(shard.store.put, half)
    wait_for(lambda: shard.store.max_queue_offset(HALF_TOPIC, 0) == 1, 10, "the half")
    sim.clock.advance(3_600_000)
    checks = shard.checks.run(["pg"], now_ms=sim.clock.now_ms(), window=100,
                              max_checks_per_group=100, checks_used=None)
    assert checks == []
    assert sent == [] and halved == []  # neither answered while nobody copies them


def _in_background(call, *args) -> list:
    """Run ``call(*args)`` on a thread of its own; the list it returns gets the answer or
    the error (a write left waiting is refused with NotLeaderError when the group closes)."""
    import threading
    outcome: list = []

    def run():
        try:
            outcome.append(call(*args))
        except NotLeaderError as e:
            outcome.append(e)
    threading.Thread(target=run, daemon=True).start()
    return outcome


def test_a_producer_may_ask_for_the_leader_s_write_only(sim):
    """``acks="leader"``: answered once written on the leader, even while nobody copies
    it and too few replicas are in sync; the default waits for the in-sync replicas."""
    from raymq.actors.shard import BrokerShard
    a = sim.leader_name()
    replica = sim.replicas[a]
    for name in sim.names:
        if name != a:
            sim.paused.add(name)
    reply = replica.call(BrokerShard, "send", (RecordBatch("t", 0, [b"fast"]), 0, 0, None,
                                               "leader"), {})
    assert reply.status == "SEND_OK"
    assert sim.send(a, b"all", pump=False) != "SEND_OK"  # (nobody copies it)
    with pytest.raises(Exception, match="acks must be one of all, leader"):
        replica.call(BrokerShard, "send", (RecordBatch("t", 0, [b"x"]), 0, 0, None, "two"), {})


def test_a_new_leader_starts_from_the_confirmed_offset_it_learned_never_lower(sim):
    """A follower that learned confirmed offset X from one leader keeps X when the next
    leader (which knows less at first: its in-sync followers have not fetched from it
    yet) answers with a lower one; elected, it starts from X -- what readers saw is never
    taken back from them."""
    a = sim.leader_name()
    assert sim.send(a, b"one") == "SEND_OK"
    assert sim.send(a, b"two") == "SEND_OK"
    b, c = sorted(n for n in sim.names if n != a)
    sim.fetch(c)  # c learns the confirmed offset of both; b does not
    known = sim.replicas[c]._confirmed
    assert known == sim.replicas[a].leader.confirmed() > sim.replicas[b]._confirmed
    sim.controller.replica_elect(0, to=b)  # (a stays alive and in sync: it has not
    sim.beat(b, c)                         # fetched from b yet)
    assert sim.replicas[b].leader is not None
    sim.fetch(c)  # b answers with what it knows confirmed
    assert sim.replicas[c]._confirmed >= known
    sim.controller.replica_elect(0, to=c)
    sim.beat(c)
    assert sim.replicas[c].leader.confirmed() >= known
    assert [bytes(m.body) for m in sim.replicas[c].serving().pull(
        [("t", 0, 0, 100)], 0)[0][2].messages()] == [b"one", b"two"]


def test_a_commit_of_offsets_is_a_durable_record_in_every_flush_mode(tmp_path):
    """(A shard of one replica too.) The commit is a record of the log, durable when
    ``commit_offsets`` returns even with ``flush_mode="async"`` (the table was fsynced
    before offsets became records), and replayed into the table when the shard opens."""
    from raymq.actors.config import ClusterConfig
    from raymq.actors.protocol import OFFSETS_TOPIC
    from raymq.actors.shard import BrokerShard
    cfg = ClusterConfig(data_dir=str(tmp_path), num_shards=1, flush_mode="async")
    shard = BrokerShard(0, cfg, background=False)
    shard.set_routes([("t", 0)])
    shard.send(RecordBatch("t", 0, [b"a", b"b"]), 0, 0)
    shard.commit_offsets("g", {("t", 0): 2})
    assert shard.store.flushed_offset >= shard.store.max_phys_offset
    assert shard.store.max_queue_offset(OFFSETS_TOPIC, 0) == 1
    import shutil
    crashed = str(tmp_path / "crashed")  # (as a power cut leaves it: the table not written)
    shutil.copytree(shard.directory, crashed)
    shard.close()
    again = BrokerShard(0, cfg, background=False, directory=crashed)
    assert again.get_offsets("g", [("t", 0)]) == {("t", 0): 2}
    again.close()
