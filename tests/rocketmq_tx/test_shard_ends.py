"""A shard in-process (no Ray): transaction ends with and without the halves kept in memory."""
from __future__ import annotations

import time

import pytest

from raymq.actors.rocketmq_tx import halves as halves_mod
from raymq.actors import shard as shard_mod
from raymq.actors.rocketmq_tx.halves import HALF_PROGRESS, OP_PROGRESS
from raymq.actors.shard import BrokerShard
from raymq.message import OP_TOPIC, SCHEDULE_TOPIC, Prop, make_msg_id
from raymq.storage import RecordBatch


def outcomes(results) -> list[str]:
    """The outcomes of transaction ends (``EndResult``), as their names."""
    return [r.outcome.value for r in results]


def tx_batch(topic: str, n: int, start: int) -> RecordBatch:
    return RecordBatch(
        topic, [i % 2 for i in range(n)], [f"body-{start + i}".encode() for i in range(n)],
        keys=[f"k{start + i}" for i in range(n)], tags=["t" if i % 2 else None for i in range(n)],
        properties=[{Prop.TRAN_MSG: "true", Prop.PRODUCER_GROUP: "g",
                     Prop.TRANSACTION_ID: f"tx{start + i}", "user": str(start + i)}
                    for i in range(n)], born_ms=1_700_000_000_000)


@pytest.mark.parametrize("kept", [0, 2, 100])
def test_commit_writes_the_same_real_messages_whether_halves_are_kept_or_read(
        tmp_path, monkeypatch, kept):
    monkeypatch.setattr(halves_mod, "HALF_CACHE_MAX", kept)
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    try:
        sh.set_routes([("orders", 0), ("orders", 1)])
        sent = sh.send(tx_batch("orders", 5, 0), 77, 1)
        assert len(sh.halves.cache) == min(kept, 5)
        ends = [("g", f"tx{i}", [phys], "COMMIT_MESSAGE") for i, phys in enumerate(sent.phys)]
        ends[4] = ("g", "tx4", [sent.phys[4]], "ROLLBACK_MESSAGE")
        ends.append(("other-group", "tx0", [sent.phys[0]], "COMMIT_MESSAGE"))
        # the ends ride on the producer's next request (one put with its new halves)
        more = sh.send(tx_batch("orders", 3, 100), 77, 2, ends)
        assert outcomes(more.ends[:5]) == ["COMMITTED"] * 4 + ["ROLLED_BACK"]
        assert str(more.ends[5]).startswith("REFUSED")  # wrong group: refused, nothing written
        assert more.status == "SEND_OK" and len(more.phys) == len(more.queue_offsets) == 3
        # resolved halves are not kept; the new ones are, as far as the bound allows
        assert set(sh.halves.cache) == set(more.phys[:min(kept, 3)])
        # a resend of that request (a timeout) stores nothing again and ends nothing again
        again = sh.send(tx_batch("orders", 3, 100), 77, 2, ends)
        assert again.duplicate and again.phys == more.phys
        # ends alone (nothing else to send): the rest of the transactions
        alone = sh.send(None, 0, 0, [("g", f"tx{100 + i}", [p], "ROLLBACK_MESSAGE")
                                     for i, p in enumerate(more.phys)])
        assert outcomes(alone.ends) == ["ROLLED_BACK"] * 3 and alone.phys == []
        assert sh.halves.cache == {}
        got = []
        for q in (0, 1):
            [(_t, _q, batch, _next, _end)] = sh.pull([("orders", q, 0, 100)])
            got += batch.messages()
        assert sorted(m.body for m in got) == [f"body-{i}".encode() for i in range(4)]
        for m in got:
            i = int(m.properties["user"])
            assert (m.key, m.tags, m.queue_id, m.born_ms) == \
                (f"k{i}", "t" if i % 2 else None, i % 2, 1_700_000_000_000)
            assert m.properties[Prop.PRODUCER_MSG_ID] == make_msg_id(0, sent.phys[i])
            assert m.properties[Prop.TRANSACTION_ID] == f"tx{i}"
            assert not {Prop.TRAN_MSG, Prop.REAL_TOPIC, Prop.REAL_QID} & set(m.properties)
        # a late duplicate end changes nothing
        assert outcomes(sh.send(None, 0, 0, ends[:1]).ends) == ["NOOP"]
    finally:
        sh.close()


def test_checks_the_registry_could_not_take_are_not_counted(tmp_path):
    """RocketMQ counts a check even when no producer was asked; RayMQ takes it back."""
    from raymq.actors.rocketmq_tx.checker import CheckerWorker
    from raymq.actors.rocketmq_tx.registry import ProducerGroupRegistry
    from raymq.message import CHECK_EXPIRED_TOPIC
    from raymq.storage.clock import ManualClock
    from raymq.storage.errors import BrokerUnavailableError
    clock = ManualClock()
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1, "txn_timeout_ms": 1000,
                         "txn_max_checks": 2, "txn_check_backoff_max_ms": 2000},
                     clock=clock, background=False)
    registry = ProducerGroupRegistry(lease_ms=10**9, clock=clock)
    registry.heartbeat("g", "instance-1")
    registry_down = [True]

    def call_registry(_i, method, *args):
        if method == "push_checks" and registry_down[0]:
            raise BrokerUnavailableError("registry-0 restarting")
        return getattr(registry, method)(*args)
    checker = CheckerWorker(0, [0], call_shard=lambda _i, m, *a, **k: getattr(sh, m)(*a, **k),
                            call_registry=call_registry, num_registries=1, interval_ms=10**6,
                            max_checks_per_group=100, background=False)
    try:
        sh.set_routes([("orders", 0), ("orders", 1)])
        [origin] = sh.send(tx_batch("orders", 1, 0), 5, 1).phys
        for _ in range(6):  # far more rounds than max checks, every push failing
            clock.advance(5000)
            assert checker.run_round() == {}
            [half] = sh.half_list()
            assert half["checks"] == 0  # nothing counted, nothing expired
        assert sh.half_list(expired=True) == []
        registry_down[0] = False  # the registry is back: the check is asked and counted
        clock.advance(5000)
        assert checker.run_round() == {"g": 1}
        [req] = registry.poll_checks("g", "instance-1", 10, 0)
        assert (req.origin, req.checks) == (origin, 1)
        assert sh.half_list()[0]["checks"] == 1
        # taking back is idempotent and ignores checks that moved on
        assert sh.uncount_checks([(origin, 5)]) == 0
        assert sh.uncount_checks([(origin, 1)]) == 1
        assert sh.uncount_checks([(origin, 1)]) == 0
        assert sh.half_list()[0]["checks"] == 0
        # a check still queued is not asked (nor counted) twice: one round asks, the next
        # finds it untaken
        clock.advance(5000)
        assert checker.run_round() == {"g": 1} and sh.half_list()[0]["checks"] == 1
        clock.advance(5000)
        assert checker.run_round() == {} and sh.half_list()[0]["checks"] == 1
        for _ in range(3):  # taken but never answered: max checks expire it in the end
            registry.poll_checks("g", "instance-1", 10, 0)
            clock.advance(5000)
            checker.run_round()
        [expired] = sh.half_list(expired=True)
        assert (expired["origin"], expired["state"]) == (origin, "EXPIRED")
        batch = sh.store.read_batch(CHECK_EXPIRED_TOPIC, 0, 0, 10)  # (not a client's pull)
        assert len(batch) == 1
    finally:
        sh.close()


def test_one_op_record_per_call_is_what_a_restart_and_the_op_progress_read(tmp_path):
    cfg = {"data_dir": str(tmp_path), "num_shards": 1, "txn_timeout_ms": 1}
    sh = BrokerShard(0, cfg, background=False)
    sh.set_routes([("orders", 0), ("orders", 1)])
    sent = sh.send(tx_batch("orders", 6, 0), 77, 1).phys
    states = ["COMMIT_MESSAGE", "ROLLBACK_MESSAGE", "COMMIT_MESSAGE"]
    ends = [("g", f"tx{i}", [sent[i]], states[i]) for i in range(3)]
    assert outcomes(sh.send(tx_batch("orders", 1, 50), 77, 2, ends).ends) == \
        ["COMMITTED", "ROLLED_BACK", "COMMITTED"]
    assert outcomes(sh.end_transactions([("g", "tx3", [sent[3]], "ROLLBACK_MESSAGE"),
                                         ("g", "tx4", [sent[4]], "COMMIT_MESSAGE")])) == \
        ["ROLLED_BACK", "COMMITTED"]
    ops = sh.store.read_queue(OP_TOPIC, 0, 0, 100)
    assert [m.properties[Prop.ORIGIN_HALF] for m in ops] == \
        [",".join(map(str, sent[:3])), ",".join(map(str, sent[3:5]))]  # one per call
    want = {sent[0]: "COMMITTED", sent[1]: "ROLLED_BACK", sent[2]: "COMMITTED",
            sent[3]: "ROLLED_BACK", sent[4]: "COMMITTED"}
    assert {o: st.name for o, st in sh.halves.resolved.items()} == want
    sh.close()

    sh = BrokerShard(0, cfg, background=False)  # a restart rebuilds the resolutions from them
    try:
        assert {o: st.name for o, st in sh.halves.resolved.items() if o in want} == want
        pending = {h["origin"] for h in sh.half_list()}
        assert sent[5] in pending and not pending & set(want) and len(pending) == 2
        # both op records cover only halves older than the oldest pending one (tx5):
        # a round passes them (and no further: nothing else is resolved)
        assert sh.store.offsets.get(OP_PROGRESS, 0) == 0
        sh.check_round(["g"], now_ms=sh.clock.now_ms() + 60_000)
        assert sh.store.offsets.get(OP_PROGRESS, 0) == 2
        sh.end_transactions([("g", "tx5", [sent[5]], "ROLLBACK_MESSAGE")])
        assert sent[5] not in {h["origin"] for h in sh.half_list()}
    finally:
        sh.close()


class RecordingMetrics(shard_mod.NullMetrics):
    def __init__(self):
        self.observed: list[tuple[str, float]] = []

    def observe(self, name, value, **tags):
        self.observed.append((name, value))


def test_every_send_path_observes_its_put_latency(tmp_path):
    metrics = RecordingMetrics()
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False,
                     metrics=metrics)
    try:
        sh.set_routes([("orders", 0), ("orders", 1)])
        sent = sh.send(tx_batch("orders", 2, 0), 77, 1)  # a plain put
        ends = [("g", f"tx{i}", [phys], "COMMIT_MESSAGE") for i, phys in enumerate(sent.phys)]
        sh.send(tx_batch("orders", 2, 10), 77, 2, ends)  # halves and ends in one put
        latencies = [v for name, v in metrics.observed if name == "put_latency_ms"]
        assert len(latencies) == 2 and all(v >= 0 for v in latencies)
    finally:
        sh.close()


def orders_shard(tmp_path):
    """(manual clock, a shard serving orders/0 on it)."""
    from raymq.storage.clock import ManualClock
    clock = ManualClock()
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, clock=clock,
                     background=False)
    sh.set_routes([("orders", 0)])
    return clock, sh


def unflushed_shard(tmp_path, routes, clock=None, **config) -> BrokerShard:
    """A shard whose puts stay unflushed until someone flushes (async flush, no background
    flush): what is durable when can be checked."""
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1, "flush_mode": "async",
                         **config}, clock=clock, background=False)
    sh.set_routes(routes)
    return sh


def one_half(start: int) -> RecordBatch:
    return RecordBatch("orders", 0, [f"body-{start}".encode()],
                       properties=[{Prop.TRAN_MSG: "true", Prop.PRODUCER_GROUP: "g",
                                    Prop.TRANSACTION_ID: f"tx{start}"}])


def test_a_resend_after_the_half_was_rolled_back_and_forgotten_does_not_revive_it(tmp_path):
    from raymq.storage.clock import ManualClock
    clock = ManualClock()
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1, "txn_timeout_ms": 1000},
                     clock=clock, background=False)
    try:
        sh.set_routes([("orders", 0)])
        half = sh.send(one_half(0), 77, 1).phys[0]  # stored; the producer never hears so
        clock.advance(5000)
        assert [c.origin for c in sh.check_round(["g"])] == [half]
        assert sh.end_transaction("g", "tx0", [half], "ROLLBACK_MESSAGE") == "ROLLED_BACK"
        clock.advance(5000)
        sh.check_round(["g"])  # passes the resolved half: nothing of it is kept any more
        assert half not in sh.halves.resolved and half not in sh.halves.pending
        again = sh.send(one_half(0), 77, 1)  # the producer's resend, at last
        assert again.duplicate and again.phys == [half]
        assert sh.transaction_status()["pending_halves"] == 0  # not pending again ...
        late = sh.send(None, 0, 0, [("g", "tx0", [half], "COMMIT_MESSAGE")])
        assert outcomes(late.ends) == ["NOOP"]  # ... so a late commit cannot deliver it
        [(_t, _q, batch, _next, _end)] = sh.pull([("orders", 0, 0, 10)])
        assert len(batch) == 0
    finally:
        sh.close()


def test_check_progress_is_never_durable_ahead_of_the_resolutions_it_passes(tmp_path):
    from raymq.storage.clock import ManualClock
    clock = ManualClock()
    sh = unflushed_shard(tmp_path, [("orders", 0)], clock=clock, txn_timeout_ms=1000)
    try:
        half = sh.send(one_half(0), 77, 1).phys[0]
        sh.send(one_half(1), 77, 2, [("g", "tx0", [half], "COMMIT_MESSAGE")])
        written = sh.store._log.max_offset
        assert sh.store._log.flushed_offset < written  # the commit is not durable yet
        clock.advance(500)  # the second half is not due: the round only passes the first
        sh.check_round(["g"])
        assert sh.store.offsets.get(HALF_PROGRESS, 0) == 1
        assert sh.store._log.flushed_offset >= written  # flushed before the progress
    finally:
        sh.close()


def test_a_progress_past_the_end_of_its_queue_is_cut_back_on_start(tmp_path):
    from raymq.storage.clock import ManualClock
    clock = ManualClock()
    cfg = {"data_dir": str(tmp_path), "num_shards": 1, "txn_timeout_ms": 1000}
    sh = BrokerShard(0, cfg, clock=clock, background=False)
    sh.set_routes([("orders", 0)])
    sh.send(one_half(0), 77, 1)
    # as an older version could leave it after a power loss: progress past the queues' ends
    sh.store.offsets.update({HALF_PROGRESS: 50, OP_PROGRESS: 50})
    sh.close()
    sh = BrokerShard(0, cfg, clock=clock, background=False)
    try:
        sh.set_routes([("orders", 0)])
        assert sh.store.offsets.get(HALF_PROGRESS) == 1
        assert sh.store.offsets.get(OP_PROGRESS) == 0
        later = sh.send(one_half(1), 78, 1).phys[0]  # a new half is checked, not skipped
        clock.advance(5000)
        assert [c.origin for c in sh.check_round(["g"])] == [later]
    finally:
        sh.close()


def test_a_committed_consumer_offset_is_never_durable_ahead_of_what_it_passes(tmp_path):
    sh = unflushed_shard(tmp_path, [("orders", 0)])
    try:
        sh.send(RecordBatch("orders", 0, [b"a", b"b"]))
        written = sh.store._log.max_offset
        assert sh.store._log.flushed_offset < written
        [(_t, _q, batch, next_offset, _end)] = sh.pull([("orders", 0, 0, 10)])
        assert len(batch) == 2  # a consumer can read what is not durable yet ...
        sh.commit_offsets("g", {("orders", 0): next_offset})
        assert sh.store._log.flushed_offset >= written  # ... and its offset waits for it
        assert sh.get_offsets("g", [("orders", 0)]) == {("orders", 0): 2}
    finally:
        sh.close()


def test_dlq_resend_makes_its_copies_durable_before_its_progress(tmp_path):
    from raymq.message import dlq_topic, retry_topic
    sh = unflushed_shard(tmp_path, [("orders", 0), (retry_topic("g"), 0), (dlq_topic("g"), 0)])
    try:
        sent = sh.send(RecordBatch("orders", 0, [b"m0"]))
        sh.send_back("g", sent.phys[0], dead_letter=True)
        sh.store.flush()
        assert len(sh.dlq_resend("g")) == 1
        assert sh.store._log.flushed_offset >= sh.store._log.max_offset  # before the progress
        assert sh.store.offsets.get("dlq-resend@g@0") == 1
        assert sh.dlq_resend("g") == []  # and nothing twice
    finally:
        sh.close()


def test_dlq_resend_cut_short_before_its_progress_resends_each_dead_letter_once(tmp_path):
    """A crash after the copies are durable and before the progress is written: the
    resend run again after the restart writes nothing twice, and misses nothing new."""
    from raymq.message import dlq_topic, retry_topic
    cfg = {"data_dir": str(tmp_path), "num_shards": 1}
    routes = [("orders", 0), (retry_topic("g"), 0), (dlq_topic("g"), 0)]
    sh = BrokerShard(0, cfg, background=False)
    sh.set_routes(routes)
    sent = sh.send(RecordBatch("orders", 0, [b"m0", b"m1", b"m2"]))
    for phys in sent.phys[:2]:
        sh.send_back("g", phys, dead_letter=True)

    def crash(_offsets):
        raise SystemExit("crashed before the progress")
    sh.store.save_offsets = crash  # the fault: the process dies between the two writes
    with pytest.raises(SystemExit):
        sh.dlq_resend("g")
    sh.close()
    sh = BrokerShard(0, cfg, background=False)
    try:
        sh.set_routes(routes)
        assert sh.store.offsets.get("dlq-resend@g@0", 0) == 0  # the progress was lost
        sh.send_back("g", sent.phys[2], dead_letter=True)  # and a new dead letter came
        assert len(sh.dlq_resend("g")) == 1  # only the new one is resent now
        assert sh.dlq_resend("g") == []
        [(_t, _q, batch, _n, _e)] = sh.pull([(retry_topic("g"), 0, 0, 10)], group="g")
        assert sorted(m.body for m in batch.messages()) == [b"m0", b"m1", b"m2"]
        # an operator's pick is resent on every call: that is what they asked for
        dead = sh.store.read_queue(dlq_topic("g"), 0, 0, 1)
        sh.dlq_resend("g", [dead[0].phys_offset])
        sh.dlq_resend("g", [dead[0].phys_offset])
        [(_t, _q, batch, _n, _e)] = sh.pull([(retry_topic("g"), 0, 0, 10)], group="g")
        assert len(batch) == 5
    finally:
        sh.close()


def test_two_dlq_resends_at_once_resend_each_dead_letter_once(tmp_path):
    """A resend retried while the first is still writing (a client timeout), with a new
    dead letter between them: the two must not both resend the old ones."""
    import threading
    from raymq.message import dlq_topic, retry_topic
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    sh.set_routes([("orders", 0), (retry_topic("g"), 0), (dlq_topic("g"), 0)])
    try:
        sent = sh.send(RecordBatch("orders", 0, [b"m0", b"m1", b"m2"]))
        for phys in sent.phys[:2]:
            sh.send_back("g", phys, dead_letter=True)
        real_store, arrived = sh._store_request, []
        go = {"first": threading.Event(), "second": threading.Event()}

        def store(batch, *args):  # each resend's write waits for its own go
            if batch is not None and batch.topics == retry_topic("g"):
                me = threading.current_thread().name
                arrived.append(me)
                go[me].wait(10)
            return real_store(batch, *args)
        sh._store_request = store
        first = threading.Thread(target=sh.dlq_resend, args=("g",), name="first")
        first.start()
        deadline = time.monotonic() + 10
        while not arrived and time.monotonic() < deadline:
            time.sleep(0.01)
        assert arrived == ["first"]
        sh.send_back("g", sent.phys[2], dead_letter=True)
        second = threading.Thread(target=sh.dlq_resend, args=("g",), name="second")
        second.start()
        second.join(1.0)  # it must not read the progress while the first one is writing
        go["first"].set()  # the first writes first, then the second
        first.join(10)
        go["second"].set()
        second.join(10)
        assert not first.is_alive() and not second.is_alive()
        [(_t, _q, batch, _n, _e)] = sh.pull([(retry_topic("g"), 0, 0, 10)], group="g")
        assert sorted(m.body for m in batch.messages()) == [b"m0", b"m1", b"m2"]
    finally:
        sh.close()


def test_offsets_past_the_end_of_their_queues_are_cut_back_on_start(tmp_path):
    from raymq.message import dlq_topic, retry_topic
    cfg = {"data_dir": str(tmp_path), "num_shards": 1}
    routes = [("orders", 0), (retry_topic("g"), 0), (dlq_topic("g"), 0)]
    sh = BrokerShard(0, cfg, background=False)
    sh.set_routes(routes)
    sent = sh.send(RecordBatch("orders", 0, [b"m0", b"m1"]))
    sh.send_back("g", sent.phys[0], dead_letter=True)
    sh.commit_offsets("g", {("orders", 0): 2})
    # as a power loss could leave them before offsets waited for their data: past the ends
    sh.store.offsets.update({"g@orders@0": 9, "dlq-resend@g@0": 7, "h@nowhere@0": 5})
    sh.close()
    sh = BrokerShard(0, cfg, background=False)
    try:
        sh.set_routes(routes)
        assert sh.get_offsets("g", [("orders", 0)]) == {("orders", 0): 2}
        assert sh.store.offsets.get("dlq-resend@g@0") == 1
        assert sh.store.offsets.get("h@nowhere@0") == 5  # a queue this shard does not have
        nxt = sh.send(RecordBatch("orders", 0, [b"m2"]))  # what comes next is not skipped
        [(_t, _q, batch, _n, _e)] = sh.pull([("orders", 0, 2, 10)])
        assert [m.body for m in batch.messages()] == [b"m2"] and nxt.queue_offsets == [2]
        sh.send_back("g", nxt.phys[0], dead_letter=True)
        assert len(sh.dlq_resend("g")) == 1
    finally:
        sh.close()


def test_a_delayed_message_keeps_the_id_its_producer_was_given(tmp_path):
    clock, sh = orders_shard(tmp_path)
    try:
        sent = sh.send(RecordBatch("orders", 0, [b"now", b"later"],
                                   properties=[None, {Prop.DELAY: "1"}]), 77, 1)
        assert sent.queue_offsets == [0, -1]  # the delayed one's offset comes on delivery
        clock.advance(60_000)
        sh.deliver_due()
        [(_t, _q, batch, _n, _e)] = sh.pull([("orders", 0, 0, 10)])
        got = batch.messages()
        assert [m.body for m in got] == [b"now", b"later"]
        assert got[1].properties[Prop.PRODUCER_MSG_ID] == make_msg_id(0, sent.phys[1])
        assert Prop.DELAY not in got[1].properties
    finally:
        sh.close()


def test_a_deliver_at_past_the_maximum_is_refused_by_the_client_before_it_is_sent():
    # (issue 15 made deliver_at_ms work; this test refused it while it did not)
    from raymq.message import Message
    from raymq.storage.errors import InvalidMessageError
    far = int(time.time() * 1000) + 41 * 24 * 3600 * 1000
    with pytest.raises(InvalidMessageError, match="max_delay_ms"):
        Message("orders", b"x", deliver_at_ms=far).validate(1024, 18)


def test_a_client_cannot_write_as_one_of_the_shard_s_own_producers(tmp_path):
    """The delay scheduler and dead-letter resends keep their progress as the sequences
    of producer ids from 2**62 up: a client request under such an id could freeze them."""
    from raymq.actors.shard import DLQ_RESEND_PID_BASE, SCHEDULER_PID_BASE
    from raymq.storage.errors import InvalidMessageError
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    try:
        sh.set_routes([("orders", 0)])
        for pid in (SCHEDULER_PID_BASE + 1, DLQ_RESEND_PID_BASE + 5):
            with pytest.raises(InvalidMessageError, match="reserved for the broker"):
                sh.send(RecordBatch("orders", 0, [b"x"]), pid, 10**12)
            assert sh.store.last_sequence(pid) == 0
        assert sh.send(RecordBatch("orders", 0, [b"y"]), (1 << 62) - 1, 1).status == "SEND_OK"
    finally:
        sh.close()


def test_a_message_s_own_properties_leave_room_to_retry_and_dead_letter_it(tmp_path):
    from raymq.message import Message, dlq_topic, retry_topic
    from raymq.storage.errors import InvalidMessageError
    from raymq.storage.records import MAX_USER_PROPERTIES_BYTES
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    try:
        sh.set_routes([("orders", 0), (retry_topic("g"), 0), (dlq_topic("g"), 0)])
        fits = {"big": "v" * (MAX_USER_PROPERTIES_BYTES - len("big") - 1)}
        [phys] = sh.send(RecordBatch("orders", 0, [b"x"], properties=[fits])).phys
        assert sh.send_back("g", phys, reason="é" * 600)["topic"] == retry_topic("g")
        assert sh.send_back("g", phys, reason="é" * 600,  # a long reason, multibyte
                            dead_letter=True)["topic"] == dlq_topic("g")
        too_big = {"big": "v" * MAX_USER_PROPERTIES_BYTES}
        with pytest.raises(InvalidMessageError, match="broker's own properties"):
            Message("orders", b"y", properties=too_big).validate(1 << 20, 18)
        # a raw sender past it (the shard allows 1 KiB for what a client adds): that
        # message is refused (alone, issue 12: the others of its request would be stored)
        reply = sh.send(RecordBatch("orders", 0, [b"y"],
                                    properties=[{"big": "v" * (MAX_USER_PROPERTIES_BYTES + 1024)}]))
        assert "broker's own properties" in reply.refused[0] and reply.phys == [-1]
        # at the client's limit, with what the client adds (a delay, a transaction): stored
        at_limit = {"big": "v" * (MAX_USER_PROPERTIES_BYTES - len("big") - 1)}
        Message("orders", b"z", properties=at_limit).validate(1 << 20, 18)
        with_system = {**at_limit, Prop.DELAY: "18", Prop.TRAN_MSG: "true",
                       Prop.PRODUCER_GROUP: "g" * 100, Prop.TRANSACTION_ID: "t" * 60}
        assert sh.send(RecordBatch("orders", 0, [b"z"], properties=[with_system]),
                       5, 1).status == "SEND_OK"
    finally:
        sh.close()


def _delayed(sh, body: bytes, level: int = 1) -> None:
    sh.send(RecordBatch("orders", 0, [body], properties=[{Prop.DELAY: str(level)}]))


def test_a_clock_stepped_back_does_not_hold_a_delay_level_for_the_step(tmp_path):
    clock, sh = orders_shard(tmp_path)
    try:
        _delayed(sh, b"a")  # level 1: one second
        clock._now -= 3_600_000  # the clock steps back an hour (NTP)
        _delayed(sh, b"b")
        clock.advance(1_000)
        sh.deliver_due()  # both: "a" now looks due in an hour, more than its level's delay
        assert [m.body for m in sh.store.read_queue("orders", 0, 0, 10)] == [b"a", b"b"]
    finally:
        sh.close()


def test_a_message_delayed_while_a_delivery_runs_is_not_taken_for_a_clock_step(tmp_path):
    """A clean clone delivered a level-1 message 2 ms after its send: the delivery had read
    the clock, then the message was stored (stamped later) before the delivery read its
    level, so it looked due later than its level's delay from then: a clock stepped back."""
    clock, sh = orders_shard(tmp_path)
    try:
        real = sh.store.max_queue_offset
        sent = []

        def max_queue_offset(topic, qid):  # between the delivery's clock and its read
            if topic == SCHEDULE_TOPIC and not sent:
                clock.advance(5)
                _delayed(sh, b"late")
                sent.append(clock.now_ms())
            return real(topic, qid)
        sh.store.max_queue_offset = max_queue_offset
        sh.deliver_due()
        assert sent and sh.store.read_queue("orders", 0, 0, 10) == []  # not due for 1 s
        clock.advance(999)
        sh.deliver_due()
        assert sh.store.read_queue("orders", 0, 0, 10) == []
        clock.advance(1)
        sh.deliver_due()
        [m] = sh.store.read_queue("orders", 0, 0, 10)
        assert m.body == b"late" and m.store_ms >= sent[0] + 1000
    finally:
        sh.close()


def test_two_deliveries_of_due_messages_at_once_deliver_each_once(tmp_path):
    import threading
    clock, sh = orders_shard(tmp_path)
    try:
        for i in range(4):
            _delayed(sh, f"m{i}".encode())
            clock.advance(10)
        clock.advance(1000 - 40 + 15)  # m0 and m1 due
        real = sh.store.messages_at
        gates = {n: (threading.Event(), threading.Event()) for n in "AB"}

        def read(entries):  # each delivery stops before its put until let go
            arrived, go = gates[threading.current_thread().name]
            arrived.set()
            go.wait(10)
            return real(entries)
        sh.store.messages_at = read
        a = threading.Thread(target=sh.deliver_due, name="A")
        a.start()
        assert gates["A"][0].wait(10)
        clock.advance(100)  # now all four are due
        b = threading.Thread(target=sh.deliver_due, name="B")
        b.start()
        b.join(1.0)  # it must not read while A delivers
        gates["A"][1].set()
        a.join(10)
        gates["B"][1].set()
        b.join(10)
        sh.store.messages_at = real
        assert [m.body for m in sh.store.read_queue("orders", 0, 0, 10)] == \
            [b"m0", b"m1", b"m2", b"m3"]
    finally:
        sh.close()


def test_a_send_leaves_the_caller_s_batch_as_it_was(tmp_path):
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    try:
        sh.set_routes([("orders", 0)])
        batch = RecordBatch(["orders", "orders"], [0, 0], [b"a", b"b"],
                            properties=[{Prop.DELAY: "1"}, None])
        sh.send(batch)
        assert batch.topics == ["orders", "orders"] and batch.queue_ids == [0, 0]
        sh.send(batch)  # and can be sent again
    finally:
        sh.close()


def test_an_operator_end_that_conflicts_raises_and_changes_nothing(tmp_path):
    """A producer's late conflicting end is a NOOP; an operator's says what the half became."""
    from raymq.storage.errors import InvalidMessageError
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    sh.set_routes([("orders", 0)])
    try:
        [half] = sh.send(tx_batch("orders", 1, 0), 77, 1).phys
        assert sh.resolve_half(half, "ROLLBACK") == "ROLLED_BACK"
        assert sh.resolve_half(half, "ROLLBACK") == "NOOP"  # a duplicate
        with pytest.raises(InvalidMessageError, match="already ROLLED_BACK; it cannot become "
                                                      "COMMITTED"):
            sh.resolve_half(half, "COMMIT")
        assert outcomes(sh.end_transactions([("g", "tx0", [half], "COMMIT_MESSAGE")])) == ["NOOP"]
        [(_t, _q, batch, _n, _e)] = sh.pull([("orders", 0, 0, 10)])
        assert len(batch) == 0  # nothing was committed
    finally:
        sh.close()


def test_op_records_store_state_ids_and_read_older_names():
    from raymq.actors.rocketmq_tx.logic import HalfState
    from raymq.actors.rocketmq_tx.records import op_entries, ops_record
    record = ops_record([(5, HalfState.COMMITTED), (9, HalfState.EXPIRED)])
    assert record.properties[Prop.OP_STATE] == "1,3"
    assert op_entries(record.properties) == [(5, HalfState.COMMITTED), (9, HalfState.EXPIRED)]
    older = {Prop.ORIGIN_HALF: "5,9", Prop.OP_STATE: "ROLLED_BACK,EXPIRED"}
    assert op_entries(older) == [(5, HalfState.ROLLED_BACK), (9, HalfState.EXPIRED)]


def test_an_origin_named_twice_in_one_end_commits_once(tmp_path):
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    sh.set_routes([("orders", 0)])
    try:
        [half] = sh.send(tx_batch("orders", 1, 0), 77, 1).phys
        assert outcomes(sh.end_transactions([("g", "tx0", [half, half], "COMMIT_MESSAGE")])) \
            == ["COMMITTED"]
        [(_t, _q, batch, _n, _e)] = sh.pull([("orders", 0, 0, 10)])
        assert [m.body for m in batch.messages()] == [b"body-0"]
    finally:
        sh.close()


def test_a_send_without_halves_does_not_wait_for_the_transaction_lock(tmp_path):
    """Check rounds and ends hold the transaction lock; other sends must not queue behind."""
    import threading
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    sh.set_routes([("orders", 0)])
    done = threading.Event()
    try:
        with sh._tx_lock:
            sender = threading.Thread(target=lambda: (sh.send(RecordBatch(
                "orders", 0, [b"x"], properties=[{"user": "1"}])), done.set()))
            sender.start()
            assert done.wait(10), "a send with properties waited for the transaction lock"
        sender.join(10)
    finally:
        sh.close()


def test_an_operator_conflict_is_refused_after_the_rounds_forgot_the_resolution(tmp_path):
    from raymq.storage.errors import InvalidMessageError
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    sh.set_routes([("orders", 0)])
    try:
        [half] = sh.send(tx_batch("orders", 1, 0), 77, 1).phys
        assert sh.resolve_half(half, "COMMIT") == "COMMITTED"
        sh.check_round(["g"], now_ms=2**42)  # passes the resolved half: the index forgets it
        assert half not in sh.halves.resolved  # (the situation this test is about)
        assert sh.resolve_half(half, "COMMIT") == "NOOP"
        with pytest.raises(InvalidMessageError, match="already COMMITTED"):
            sh.resolve_half(half, "ROLLBACK")
    finally:
        sh.close()
