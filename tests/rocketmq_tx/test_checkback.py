"""Check-back rounds end to end in this process (no Ray): a real shard, a real
registry and a real checker on one manual clock, so that "due", "leased" and
"backed off" are exact instants rather than sleeps."""
from __future__ import annotations

import pytest

from raymq.actors.rocketmq_tx.checker import CheckerWorker
from raymq.actors.rocketmq_tx.registry import ProducerGroupRegistry
from raymq.actors.protocol import CheckRequest
from raymq.actors.shard import BrokerShard
from raymq.message import Prop
from raymq.storage import RecordBatch
from raymq.storage.clock import ManualClock

TIMEOUT_MS = 1000


@pytest.fixture
def world(tmp_path):
    """(clock, shard, registry, checker) with a per-group limit of 10 checks a round."""
    clock = ManualClock()
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1, "txn_timeout_ms": TIMEOUT_MS,
                         "txn_max_checks": 15, "txn_check_backoff_max_ms": 60_000},
                     clock=clock, background=False)
    sh.set_routes([("orders", 0)])
    registry = ProducerGroupRegistry(lease_ms=6000, clock=clock)
    checker = CheckerWorker(0, [0], call_shard=lambda _i, m, *a, **k: getattr(sh, m)(*a, **k),
                            call_registry=lambda _i, m, *a: getattr(registry, m)(*a),
                            num_registries=1, interval_ms=10**6, max_checks_per_group=10,
                            background=False)
    yield clock, sh, registry, checker
    sh.close()


def halves(sh, group: str, n: int, start: int = 0, timeout_ms: int | None = None) -> list[int]:
    props = []
    for i in range(start, start + n):
        p = {Prop.TRAN_MSG: "true", Prop.PRODUCER_GROUP: group, Prop.TRANSACTION_ID: f"tx{i}"}
        if timeout_ms is not None:
            p[Prop.TXN_TIMEOUT_MS] = str(timeout_ms)
        props.append(p)
    batch = RecordBatch("orders", 0, [f"m{i}".encode() for i in range(start, start + n)],
                        properties=props)
    return sh.send(batch).phys


def taken(registry, group: str) -> list[int]:
    return [r.origin for r in registry.poll_checks(group, "instance-1", 10_000, 0)]


def test_a_check_storm_is_cut_to_the_group_limit_and_each_half_waits_its_back_off(world):
    clock, sh, registry, checker = world
    registry.heartbeat("g", "instance-1")
    origins = halves(sh, "g", 35)
    clock.advance(TIMEOUT_MS + 1)
    asked = []
    for _ in range(4):  # 35 due halves, at most 10 a round: four rounds, nobody twice
        sent = checker.run_round()
        got = taken(registry, "g")
        assert sent == {"g": len(got)} and len(got) == min(10, 35 - len(asked))
        asked += got
    assert sorted(asked) == sorted(origins)
    assert checker.run_round() == {}  # all checked once: each now waits out its back-off
    assert {h["checks"] for h in sh.half_list()} == {1}
    clock.advance(TIMEOUT_MS)  # past the first back-off (it doubles from the timeout)
    assert checker.run_round() == {"g": 10}
    assert len(set(taken(registry, "g"))) == 10


def test_one_group_s_storm_does_not_use_up_another_group_s_round(world):
    clock, sh, registry, checker = world
    for group in ("noisy", "quiet"):
        registry.heartbeat(group, "instance-1")
    halves(sh, "noisy", 40)
    quiet = halves(sh, "quiet", 2, start=100)
    clock.advance(TIMEOUT_MS + 1)
    assert checker.run_round() == {"noisy": 10, "quiet": 2}
    assert sorted(taken(registry, "quiet")) == sorted(quiet)


def test_a_producer_whose_lease_ran_out_is_not_live_and_its_halves_wait_uncounted(world):
    clock, sh, registry, checker = world
    registry.heartbeat("g", "instance-1")
    [origin] = halves(sh, "g", 1)
    assert registry.live_groups() == ["g"]
    clock.advance(6001)  # the instance died without unregistering: its lease runs out
    assert registry.live_groups() == [] and registry.live("g") == []
    assert registry.status()["g"]["live"] == []
    for _ in range(20):  # more rounds than the maximum number of checks
        assert checker.run_round() == {}
        clock.advance(60_000)
    [half] = sh.half_list()
    assert (half["origin"], half["checks"], half["waiting_for_producer"]) == (origin, 0, True)
    assert sh.half_list(expired=True) == []
    assert sh.transaction_status()["groups_without_live_producer"] == ["g"]
    # polling for checks is a heartbeat too: a new instance makes the group live again
    assert registry.poll_checks("g", "instance-2", 10, 0) == []
    assert registry.live("g") == ["instance-2"]
    assert checker.run_round() == {"g": 1}
    assert taken(registry, "g") == [origin]
    assert not sh.half_list()[0]["waiting_for_producer"]


def test_a_per_message_transaction_timeout_reaches_the_shard(world):
    clock, sh, registry, checker = world
    registry.heartbeat("g", "instance-1")
    [slow] = halves(sh, "g", 1, timeout_ms=60_000)
    [usual] = halves(sh, "g", 1, start=1)
    clock.advance(TIMEOUT_MS + 1)
    assert checker.run_round() == {"g": 1}  # the usual one is due, the slow one is not,
    assert taken(registry, "g") == [usual]  # and the slow one does not hold it back
    clock.advance(60_000 - TIMEOUT_MS - 2)
    registry.heartbeat("g", "instance-1")  # (a live producer heartbeats all along)
    assert checker.run_round() == {"g": 1}  # the usual one again, after its back-off
    assert taken(registry, "g") == [usual]
    clock.advance(2)  # the slow one's own timeout is up, counted from when it was stored
    assert checker.run_round() == {"g": 1}
    assert taken(registry, "g") == [slow]


def test_an_expired_half_with_nothing_else_pending_survives_a_restart(tmp_path):
    """Its op record must hold the op progress even when no half is pending, or a restart
    forgets it: not listed as expired, and an operator's commit does nothing."""
    from raymq.message import CHECK_EXPIRED_TOPIC
    clock = ManualClock()
    cfg = {"data_dir": str(tmp_path), "num_shards": 1, "txn_timeout_ms": TIMEOUT_MS,
           "txn_max_checks": 1}
    sh = BrokerShard(0, cfg, clock=clock, background=False)
    sh.set_routes([("orders", 0)])
    [origin] = halves(sh, "g", 1)
    for _ in range(3):  # checked once (nobody answers), then expired
        clock.advance(10 * TIMEOUT_MS)
        sh.check_round(["g"])
    assert [h["origin"] for h in sh.half_list(expired=True)] == [origin]
    for _ in range(3):  # later rounds with nothing pending
        clock.advance(10 * TIMEOUT_MS)
        sh.check_round(["g"])
    sh.close()
    sh = BrokerShard(0, cfg, clock=clock, background=False)
    try:
        sh.set_routes([("orders", 0)])
        [expired] = sh.half_list(expired=True)
        assert expired["origin"] == origin
        assert sh.resolve_half(origin, "COMMIT") == "COMMITTED"
        [(_t, _q, batch, _n, _e)] = sh.pull([("orders", 0, 0, 10)])
        assert [m.body for m in batch.messages()] == [b"m0"]
        assert sh.half_list(expired=True) == []
        batch = sh.store.read_batch(CHECK_EXPIRED_TOPIC, 0, 0, 10)  # (not a client's pull)
        assert len(batch) == 1
    finally:
        sh.close()


def test_a_round_reads_past_one_window_up_to_where_the_queue_ended(world):
    clock, sh, registry, checker = world
    origins = halves(sh, "g", 25)
    clock.advance(TIMEOUT_MS + 1)
    asked = sh.check_round(["g"], window=10)  # three windows in one round
    assert sorted(c.origin for c in asked) == sorted(origins)
    # its own re-puts wait for the next round, where their back-off holds them
    assert sh.check_round(["g"], window=10) == []


@pytest.fixture
def two_shards(tmp_path):
    """(clock, [shard 0, shard 1], registry, checker): group "g" live, 10 checks a round."""
    clock = ManualClock()
    shards = []
    for i in range(2):
        sh = BrokerShard(i, {"data_dir": str(tmp_path / f"s{i}"), "num_shards": 2,
                             "txn_timeout_ms": TIMEOUT_MS}, clock=clock, background=False)
        sh.set_routes([("orders", 0)])
        shards.append(sh)
    registry = ProducerGroupRegistry(lease_ms=10**9, clock=clock)
    registry.heartbeat("g", "instance-1")
    checker = CheckerWorker(0, [0, 1],
                            call_shard=lambda i, m, *a, **k: getattr(shards[i], m)(*a, **k),
                            call_registry=lambda _i, m, *a: getattr(registry, m)(*a),
                            num_registries=1, interval_ms=10**6, max_checks_per_group=10,
                            background=False)
    yield clock, shards, registry, checker
    for sh in shards:
        sh.close()


def test_the_group_limit_holds_across_the_shards_of_a_round(two_shards):
    clock, shards, registry, checker = two_shards
    for sh in shards:
        halves(sh, "g", 8)
    clock.advance(TIMEOUT_MS + 1)
    assert checker.run_round() == {"g": 10}
    assert len(taken(registry, "g")) == 10
    assert checker.run_round() == {"g": 6}  # the rest, the next round


def test_an_unreachable_registry_holds_back_only_its_own_groups(tmp_path):
    from raymq.actors.rocketmq_tx.checker import registry_for
    from raymq.storage.errors import BrokerUnavailableError
    clock = ManualClock()
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1, "txn_timeout_ms": TIMEOUT_MS},
                     clock=clock, background=False)
    sh.set_routes([("orders", 0)])
    registries = [ProducerGroupRegistry(lease_ms=10**9, clock=clock) for _ in range(2)]
    groups = {}  # one group served by each registry
    for i in range(100):
        groups.setdefault(registry_for(f"g{i}", 2), f"g{i}")
    up, down = groups[0], groups[1]

    def call_registry(r, method, *args):
        if r == 1:
            raise BrokerUnavailableError("registry-1 restarting")
        return getattr(registries[r], method)(*args)
    checker = CheckerWorker(0, [0], call_shard=lambda _i, m, *a, **k: getattr(sh, m)(*a, **k),
                            call_registry=call_registry, num_registries=2, interval_ms=10**6,
                            max_checks_per_group=10, background=False)
    try:
        registries[0].heartbeat(up, "a")
        registries[1].heartbeat(down, "b")
        [mine] = halves(sh, up, 1)
        halves(sh, down, 1, start=1)
        clock.advance(TIMEOUT_MS + 1)
        assert checker.run_round() == {up: 1}
        assert taken(registries[0], up) == [mine]
        waiting = {h["group"]: h for h in sh.half_list()}[down]
        assert waiting["checks"] == 0 and waiting["waiting_for_producer"]
    finally:
        sh.close()


def check(shard: int, origin: int, checks: int) -> CheckRequest:
    return CheckRequest(shard, "g", origin, checks, None, None)


def test_a_registry_refuses_checks_for_a_group_with_no_lease_and_twice_queued_ones():
    clock = ManualClock()
    registry = ProducerGroupRegistry(lease_ms=1000, clock=clock)
    reqs = [check(0, o, 1) for o in (10, 20)]
    assert registry.push_checks("g", reqs) == [(0, 10, 1), (0, 20, 1)]  # nobody registered
    registry.heartbeat("g", "a")
    assert registry.push_checks("g", reqs[:1]) == []
    again = [check(0, 10, 2), reqs[1]]
    assert registry.push_checks("g", again) == [(0, 10, 2)]  # the first is still waiting
    clock.advance(1001)
    assert registry.push_checks("g", [check(1, 5, 1)]) == [(1, 5, 1)]


def test_a_check_shows_the_listener_the_id_its_producer_was_given(world):
    from raymq.message import make_msg_id, messages_ext
    clock, sh, registry, checker = world
    registry.heartbeat("g", "instance-1")
    [origin] = halves(sh, "g", 1)
    for checks in (1, 2):  # the first check reads the half, the second a re-put copy of it
        clock.advance(10 * TIMEOUT_MS)
        registry.heartbeat("g", "instance-1")
        assert checker.run_round() == {"g": 1}
        [req] = registry.poll_checks("g", "instance-1", 10, 0)
        [msg] = messages_ext(req.shard, [req.message])
        assert req.checks == checks and msg.msg_id == make_msg_id(0, origin)
        assert (msg.topic, msg.transaction_id) == ("orders", "tx0")


def test_one_shard_s_backlog_of_a_group_does_not_starve_its_other_shards(two_shards):
    clock, shards, registry, checker = two_shards
    halves(shards[0], "g", 40)  # a backlog: four rounds' worth on shard 0
    [lone] = halves(shards[1], "g", 1, start=100)
    clock.advance(TIMEOUT_MS + 1)
    asked = []
    for _ in range(2):
        assert checker.run_round() == {"g": 10}
        asked += [(r.shard, r.origin) for r in
                  registry.poll_checks("g", "instance-1", 100, 0)]
    assert (1, lone) in asked  # within two rounds, not after shard 0's backlog


def test_the_registry_forgets_instances_and_groups_whose_leases_ran_out():
    """Every transaction-producer process that crashed (no unregister) stayed in the
    registry for good, and its group with it: a service restarted daily over months
    left an entry per process.  Expired ones are forgotten at the next heartbeat after
    a lease; a group with none left and no check queued goes from the status."""
    clock = ManualClock(1_700_000_000_000)
    reg = ProducerGroupRegistry(lease_ms=6000, clock=clock)
    for day in range(30):
        reg.heartbeat("orders", f"pod-{day}")   # each day's process, crashed the next
        reg.heartbeat(f"batch-{day}", "job")      # a group used once, a check left queued
        reg.push_checks(f"batch-{day}", [CheckRequest(0, f"batch-{day}", 7, 1, "tx", None)])
        clock.advance(86_400_000)
    reg.heartbeat("orders", "pod-30")
    assert reg.status() == {"orders": {"live": ["pod-30"], "queued_checks": 0}}
    assert reg.live("orders") == ["pod-30"] and reg.live_groups() == ["orders"]
