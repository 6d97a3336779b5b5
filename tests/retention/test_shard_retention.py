"""Retention on a shard (issue 35), in-process on a manual clock: what a part of the shard
still waits on -- a half message not checked back, a delay-level message, an open
Kafka-style transaction, a timer due in 40 days -- keeps its segment and everything
after it, and is ended or delivered on time afterwards; what nothing waits on goes with
its topic's retention.  A reader below a queue's log start goes on as its
``auto_offset_reset`` says.  No Ray."""
from __future__ import annotations

import pytest

from raymq.message import Prop
from raymq.storage import RecordBatch
from raymq.storage.clock import ManualClock
from raymq.storage.errors import OffsetOutOfRangeError
from tests.helpers import open_shard

HOUR, DAY = 3600_000, 86_400_000
MB = 1 << 20
SEG = 9 * MB  # the smallest segment a cluster allows: one 8 MiB frame and a bit


def bulk(sh, topic: str, mb: int, start: int = 0) -> None:
    for i in range(mb * 4):
        sh.send(RecordBatch(topic, 0, [b"%08d" % (start + i) + bytes(256 * 1024 - 8)]))


@pytest.fixture
def shard(tmp_path):
    clock = ManualClock(1_700_000_000_000)
    sh = open_shard(tmp_path, [("bulk", 0), ("orders", 0), ("t", 0)], clock=clock,
                    segment_size_bytes=SEG, retention_ms=HOUR)
    yield sh, clock
    sh.close()


def _bodies(sh, topic: str, since: int) -> list[bytes]:
    return [m.body for m in sh.store.read_queue(topic, 0, since, 100)]


def _ids(sh, topic: str, since: int) -> list[str]:
    return [m.properties[Prop.PRODUCER_MSG_ID] for m in sh.store.read_queue(topic, 0, since, 100)]


def test_what_the_shard_still_waits_on_is_carried_forward_and_delivered_on_time(tmp_path):
    """A half not yet ended, a delay-level message, timers due in 40 days (one cancelled
    after its segment went) outlive the segments they were written in: re-written at the
    head (RocketMQ 5's roll), ended or delivered on time with the ids their producers were
    given, once, across restarts; an open Kafka-style transaction keeps its records until
    it ends."""
    from raymq.actors.protocol import make_msg_id
    routes = [("bulk", 0), ("orders", 0), ("t", 0)]
    clock = ManualClock(1_700_000_000_000)
    cfg = dict(clock=clock, segment_size_bytes=SEG, retention_ms=HOUR)
    sh = open_shard(tmp_path, routes, **cfg)
    bulk(sh, "bulk", 20)                              # ~2 segments nothing waits on
    half = sh.send(RecordBatch("orders", 0, [b"half"], properties=[{
        Prop.TRAN_MSG: "true", Prop.PRODUCER_GROUP: "g", Prop.TRANSACTION_ID: "tx1"}]), 7, 1)
    delayed = sh.send(RecordBatch("t", 0, [b"delayed"], properties=[{Prop.DELAY: "18"}]))  # 2 h
    due = clock.now_ms() + 40 * DAY
    timer = sh.send(RecordBatch("t", 0, [b"in 40 days"], properties=[{Prop.DELIVER_AT: str(due)}]))
    dropped = sh.send(RecordBatch("t", 0, [b"cancelled"], properties=[{Prop.DELIVER_AT: str(due)}]))
    written = max(half.phys[0], delayed.phys[0], timer.phys[0], dropped.phys[0])
    bulk(sh, "bulk", 30, 80)
    sh.ktx_register(5, 0, [("t", 0)])
    in_txn = sh.ktx_send(RecordBatch("t", 0, [b"in a transaction"]), 5, 0, 1)
    bulk(sh, "bulk", 20, 200)
    clock.advance(HOUR + 60_000)   # everything is past its retention; 'delayed' due in < 1 h
    assert sh.check_round(["g"])   # the half is checked: its copy is re-put at the head
    first = sh.janitor.run_once()
    # the segments they were written in are gone; the open transaction's records stay
    assert sh.store.min_phys_offset > written and first.held_by == "pinned"
    assert sh.store.min_phys_offset <= in_txn.phys[0]
    assert sh.cancel_scheduled(dropped.phys[0]) == "cancelled"   # by the id it was given
    ends = sh.send(None, 0, 0, [("g", "tx1", [half.phys[0]], "COMMIT_MESSAGE")])
    assert [r.outcome.value for r in ends.ends] == ["COMMITTED"]
    assert _bodies(sh, "orders", 0) == [b"half"]
    assert _ids(sh, "orders", 0) == [make_msg_id(0, half.phys[0])]
    sh.ktx_end(5, 1, "COMMIT")
    mark = sh.store.max_queue_offset("t", 0)
    sh.close()
    sh = open_shard(tmp_path, routes, **cfg)            # a restart after the roll
    clock.advance(HOUR - 60_000 - 1000)
    sh.deliver_due()
    assert _bodies(sh, "t", mark) == []                 # not early
    clock.advance(1000)
    sh.deliver_due()
    assert _bodies(sh, "t", mark) == [b"delayed"]       # on time
    assert _ids(sh, "t", mark) == [make_msg_id(0, delayed.phys[0])]
    bulk(sh, "bulk", 20, 300)
    clock.advance(2 * HOUR)                             # the cancellation's own record ages out
    second = sh.janitor.run_once()
    assert second.count >= 1 and sh.store.retention.log_start("t", 0) > in_txn.queue_offsets[0]
    sh.close()
    sh = open_shard(tmp_path, routes, **cfg)
    try:
        clock.advance(due - clock.now_ms() - 1000)
        sh.deliver_due()
        assert _bodies(sh, "t", mark) == [b"delayed"]
        clock.advance(1000)
        sh.deliver_due()
        sh.deliver_due()                                # on time, once; the cancelled never
        assert _bodies(sh, "t", mark) == [b"delayed", b"in 40 days"]
        assert _ids(sh, "t", mark)[1] == make_msg_id(0, timer.phys[0])
        clock.advance(DAY)
        sh.deliver_due()
        assert _bodies(sh, "t", mark) == [b"delayed", b"in 40 days"]
        assert sh.timer_list(clock.now_ms() + DAY) == []
    finally:
        sh.close()


def test_a_roll_with_an_old_wheel_delivers_each_message_once_and_cancels_by_first_id(
        tmp_path):
    """The timer wheel is derived data: one written before a roll (a crash before the
    rolled entries left it, or a follower's copy shipped earlier) still delivers each
    rolled message once, never its aged-out first record; a delayed message rolled into
    the timer log is cancelled by the id its producer was given."""
    import shutil
    routes = [("bulk", 0), ("t", 0)]
    clock = ManualClock(1_700_000_000_000)
    cfg = dict(clock=clock, segment_size_bytes=SEG, retention_ms=HOUR)
    sh = open_shard(tmp_path, routes, **cfg)
    bulk(sh, "bulk", 20)
    due = clock.now_ms() + 40 * DAY
    timer = sh.send(RecordBatch("t", 0, [b"in 40 days"], properties=[{Prop.DELIVER_AT: str(due)}]))
    delayed = sh.send(RecordBatch("t", 0, [b"delayed"], properties=[{Prop.DELAY: "18"}]))
    bulk(sh, "bulk", 30, 80)
    clock.advance(HOUR + 60_000)
    sh.deliver_due()                       # the wheel holds the timer's first entry
    wheel = sh.timers.wheel.directory
    shutil.copytree(wheel, tmp_path / "old-wheel")
    sh.janitor.run_once()
    assert sh.store.min_phys_offset > max(timer.phys[0], delayed.phys[0])
    assert sh.cancel_scheduled(delayed.phys[0]) == "cancelled"
    assert sh.cancel_scheduled(delayed.phys[0]) == "already cancelled"
    sh.close()
    shutil.rmtree(wheel)
    shutil.copytree(tmp_path / "old-wheel", wheel)
    sh = open_shard(tmp_path, routes, **cfg)
    try:
        clock.advance(HOUR)
        sh.deliver_due()
        assert _bodies(sh, "t", 0) == []   # cancelled after its roll: never delivered
        clock.advance(due - clock.now_ms())
        sh.deliver_due()
        sh.deliver_due()
        assert _bodies(sh, "t", 0) == [b"in 40 days"]
    finally:
        sh.close()


@pytest.mark.parametrize("reset", ["earliest", "latest", "error"])
def test_a_reader_below_the_log_start_goes_on_as_its_reset_says(shard, reset):
    sh, clock = shard
    bulk(sh, "bulk", 30)
    clock.advance(2 * HOUR)
    bulk(sh, "bulk", 2, 120)
    assert sh.janitor.run_once().count >= 2
    start, end = sh.store.retention.log_start("bulk", 0), sh.store.max_queue_offset("bulk", 0)
    assert 0 < start < end
    if reset == "error":
        with pytest.raises(OffsetOutOfRangeError, match=f"bulk/0: offset 3 is below .* {start}"):
            sh.pull([("bulk", 0, 3, 10)], group="g", reset=reset)
        return
    [(_t, _q, got, nxt, _e)] = sh.pull([("bulk", 0, 3, 10)], group="g", reset=reset)
    if reset == "earliest":
        assert got.messages()[0].queue_offset == start and nxt == start + len(got)
    else:
        assert len(got) == 0 and nxt == end
    # reads at or above the log start are as ever
    [(_t, _q, got, _n, _e)] = sh.pull([("bulk", 0, end - 1, 10)], group="g", reset=reset)
    assert [m.queue_offset for m in got.messages()] == [end - 1]


def test_a_deleted_topic_takes_its_halves_and_offsets_with_it_and_waits_for_transactions(
        shard):
    from raymq.storage.errors import ConcurrentTransactionsError, InvalidMessageError
    sh, clock = shard
    half = sh.send(RecordBatch("orders", 0, [b"half"], properties=[{
        Prop.TRAN_MSG: "true", Prop.PRODUCER_GROUP: "g", Prop.TRANSACTION_ID: "tx1"}]), 7, 1)
    sh.send(RecordBatch("orders", 0, [b"plain"]))
    sh.commit_offsets("readers", {("orders", 0): 1})
    sh.set_routes([("bulk", 0), ("orders", 0), ("t", 0), ("%DLQ%readers", 0),
                   ("%RETRY%readers", 0)])
    plain = sh.send(RecordBatch("orders", 0, [b"poison"]))
    other = sh.send(RecordBatch("bulk", 0, [b"poison too"]))
    sh.send_back("readers", plain.phys[0], reason="bad", dead_letter=True)
    sh.send_back("readers", other.phys[0], reason="bad", dead_letter=True)
    sh.send_back("readers", plain.phys[0], retry_after_ms=1000)  # a retry still waiting
    letters = sh.dlq_list("readers")
    assert [m.body for m in letters] == [b"poison", b"poison too"]
    sh.ktx_register(5, 0, [("t", 0)])
    sh.ktx_send(RecordBatch("t", 0, [b"in a transaction"]), 5, 0, 1)
    with pytest.raises(InvalidMessageError, match="still exists"):
        sh.drop_topic("orders")  # (its routes are still served: not deleted)
    kept = [("bulk", 0), ("%DLQ%readers", 0), ("%RETRY%readers", 0)]
    sh.set_routes(kept)
    sh.routes._fetch = lambda _i: kept  # the controller's routes, without them
    with pytest.raises(ConcurrentTransactionsError, match="producer ids \\[5\\]"):
        sh.drop_topic("t")
    assert sh.drop_topic("orders") and not sh.drop_topic("orders")
    # its dead letters and retries go with it; the other topic's stay
    assert [m.body for m in sh.dlq_list("readers")] == [b"poison too"]
    with pytest.raises(InvalidMessageError, match="deleted"):
        sh.dlq_resend("readers", [letters[0].phys_offset])
    assert len(sh.dlq_resend("readers")) == 1
    clock.advance(1000)
    sh.deliver_due()
    assert [m.body for m in sh.store.read_queue("%RETRY%readers", 0, 0, 10)] == [b"poison too"]
    assert sh.halves.pending == {} and sh.store.max_queue_offset("orders", 0) == 0
    assert not any("@orders@" in k for k in sh.store.offsets.snapshot())
    late = sh.send(None, 0, 0, [("g", "tx1", [half.phys[0]], "COMMIT_MESSAGE")])
    assert [r.outcome.value for r in late.ends] != ["COMMITTED"]  # rolled back: never delivered
    sh.ktx_end(5, 1, "ABORT")
    assert sh.drop_topic("t") and sh.store.max_queue_offset("t", 0) == 0


def test_a_message_looked_up_after_it_aged_out_is_answered_expired(shard):
    from raymq.actors.protocol import make_msg_id
    from raymq.storage.errors import InvalidMessageError
    from raymq.tools.console import http_status
    sh, clock = shard
    first = sh.send(RecordBatch("bulk", 0, [b"first"]))
    bulk(sh, "bulk", 30)
    clock.advance(2 * HOUR)
    assert sh.janitor.run_once().count >= 1
    with pytest.raises(InvalidMessageError, match="expired") as err:
        sh.get_message(first.phys[0])
    assert make_msg_id(0, first.phys[0]) in str(err.value) and http_status(err.value) == 404
    with pytest.raises(InvalidMessageError, match="no such message"):  # (not a record)
        sh.get_message(sh.store.max_phys_offset + 5)


def test_aborted_ranges_of_records_that_aged_out_are_forgotten(shard):
    """What a read_committed reader must skip stays bounded by retention: an aborted
    transaction's range goes once its records aged out."""
    sh, clock = shard
    sh.ktx_register(5, 0, [("t", 0)])
    sh.ktx_send(RecordBatch("t", 0, [b"aborted"]), 5, 0, 1)
    sh.ktx_end(5, 1, "ABORT")
    assert sh.ktx.state.aborted_count() == 1
    bulk(sh, "t", 30)
    clock.advance(2 * HOUR)
    bulk(sh, "t", 2, 120)
    assert sh.janitor.run_once().count >= 1 and sh.store.retention.log_start("t", 0) > 2
    assert sh.ktx.state.aborted_count() == 0
    [(_t, _q, got, _n, _e)] = sh.pull([("t", 0, sh.store.max_queue_offset("t", 0) - 1, 10)])
    assert len(got) == 1  # (reads go on as before)


def test_what_was_scheduled_for_a_deleted_topic_is_never_delivered_to_it_again(shard):
    sh, clock = shard
    due = clock.now_ms() + 60_000
    sh.send(RecordBatch("orders", 0, [b"timer, old"], properties=[{Prop.DELIVER_AT: str(due)}]))
    sh.send(RecordBatch("orders", 0, [b"delayed, old"], properties=[{Prop.DELAY: "3"}]))  # 10 s
    sh.send(RecordBatch("orders", 0, [b"plain, old"]))
    sh.routes._fetch = lambda _i: [("bulk", 0), ("t", 0)]  # the controller deleted it
    assert sh.drop_topic("orders")
    sh.set_routes([("bulk", 0), ("t", 0), ("orders", 0)])  # ... and it is created again
    sh.routes._fetch = lambda _i: [("bulk", 0), ("t", 0), ("orders", 0)]
    sh.send(RecordBatch("orders", 0, [b"timer, new"], properties=[{Prop.DELIVER_AT: str(due)}]))
    clock.advance(61_000)
    sh.deliver_due()
    sh.deliver_due()
    assert [m.body for m in sh.store.read_queue("orders", 0, 0, 10)] == [b"timer, new"]


def test_the_status_says_which_topic_keeps_the_oldest_segment_and_its_bytes_there(shard):
    sh, clock = shard
    sh.send(RecordBatch("orders", 0, [b"x" * 1000]))    # a topic kept 30 days
    bulk(sh, "bulk", 30)
    sh.janitor.topic_settings = {"orders": {"retention_ms": 30 * DAY}}
    clock.advance(2 * HOUR)
    assert sh.janitor.run_once().count == 0
    st = sh.janitor.status()
    assert st["oldest_held_by"] == "orders" and 1000 < st["oldest_held_bytes"] < 1500


def test_an_expired_half_holds_the_log_for_its_retention_then_ages_out(tmp_path):
    """A half nobody answered expires (txn_max_checks): operators may still resolve it for
    the retention of the check-expired topic (RocketMQ keeps its TRANS_CHECK_MAX_TIME_TOPIC
    for its files' reserved time), across a restart.  Past that it ages out like any
    message: the op progress passes its EXPIRED record and segments go.  (One expired half
    held every segment after it for good: the disk filled and writes were refused.)"""
    routes = [("bulk", 0), ("orders", 0), ("t", 0)]
    clock = ManualClock(1_700_000_000_000)
    cfg = dict(clock=clock, segment_size_bytes=SEG, retention_ms=HOUR, txn_max_checks=1,
               txn_timeout_ms=1000)
    sh = open_shard(tmp_path, routes, **cfg)
    sh.send(RecordBatch("orders", 0, [b"half"], properties=[{
        Prop.TRAN_MSG: "true", Prop.PRODUCER_GROUP: "g", Prop.TRANSACTION_ID: "tx1"}]), 7, 1)
    for _ in range(4):  # checked once (no answer), then expired
        clock.advance(600_000)
        sh.check_round(["g"])
    assert [h["state"] for h in sh.half_list(expired=True)] == ["EXPIRED"]
    bulk(sh, "bulk", 20)
    clock.advance(HOUR // 2)   # within the retention: kept, and listed after a restart
    sh.check_round(["g"])
    sh.close()
    sh = open_shard(tmp_path, routes, **cfg)
    try:
        sh.check_round(["g"])
        assert [h["state"] for h in sh.half_list(expired=True)] == ["EXPIRED"]
        bulk(sh, "bulk", 20, 100)
        clock.advance(HOUR)        # the expired half is past its retention
        sh.check_round(["g"])
        verdict = sh.janitor.run_once()
        assert verdict.count >= 2, verdict  # its segment and those after it go
        assert sh.half_list(expired=True) == []
        assert sh.halves.status()["expired_halves"] == 0
    finally:
        sh.close()
