"""Kafka-style transactions on one shard (issue 13, the shard's part): registration
(KIP-890), epochs, sequences, control markers, the last stable offset, the aborted
index, offsets committed with a transaction, and all of it after a restart.

In-process shard, no Ray: these are the calls the coordinator and the producer make.
"""
from __future__ import annotations

import threading
import time

import pytest

from tests import helpers
from raymq.actors.shard import BrokerShard
from raymq.storage import RecordBatch
from raymq.storage.errors import (InvalidMessageError, InvalidTxnStateError,
                                  OutOfOrderSequenceError, ProducerFencedError)

ROUTES = [("t", 0), ("t", 1), ("u", 0)]


def open_shard(tmp_path) -> BrokerShard:
    return helpers.open_shard(tmp_path, ROUTES)


@pytest.fixture
def shard(tmp_path):
    sh = open_shard(tmp_path)
    yield sh
    sh.close()


def read(sh, topic="t", qid=0, isolation="read_committed", offset=0, wait_ms=0):
    """(bodies, next, end) of one pull."""
    [(_t, _q, batch, nxt, end)] = sh.pull([(topic, qid, offset, 1000)], wait_ms, None, None,
                                          isolation)
    return [m.body for m in batch.messages()], nxt, end


def tx_write(sh, pid, epoch, seq, bodies, topic="t", qid=0, wait_ms=0):
    return sh.ktx_send(RecordBatch(topic, qid, list(bodies)), pid, epoch, seq, wait_ms)


def test_committed_data_appears_at_the_marker_and_markers_never_reach_a_reader(shard):
    shard.send(RecordBatch("t", 0, [b"plain-0"]))
    shard.ktx_register(7, 0, [("t", 0)])
    tx_write(shard, 7, 0, 1, [b"tx-a", b"tx-b"])
    shard.send(RecordBatch("t", 0, [b"plain-1"]))  # after the open transaction: held too
    assert read(shard) == ([b"plain-0"], 1, 1)  # the LSO is the transaction's first offset
    assert read(shard, isolation="read_uncommitted")[0] == [b"plain-0", b"tx-a", b"tx-b",
                                                            b"plain-1"]
    assert shard.ktx_end(7, 0, "COMMIT") == {"markers": 1}
    got, nxt, end = read(shard)
    assert got == [b"plain-0", b"tx-a", b"tx-b", b"plain-1"]  # no marker
    assert nxt == end == 5  # past the marker: a reader at the end is at the end
    assert read(shard, offset=5, wait_ms=5000)[1] == 5
    t0 = time.monotonic()
    assert read(shard, offset=4, wait_ms=5000) == ([], 5, 5)  # only a marker left: no wait
    assert time.monotonic() - t0 < 2


def test_an_aborted_transaction_is_invisible_committed_and_visible_uncommitted(shard):
    shard.ktx_register(7, 0, [("t", 0), ("u", 0)])
    tx_write(shard, 7, 0, 1, [b"gone-1"])
    shard.send(RecordBatch("t", 0, [b"other"]))  # another producer's, between
    tx_write(shard, 7, 0, 2, [b"gone-2"])
    tx_write(shard, 7, 0, 3, [b"gone-u"], topic="u")
    assert shard.ktx_end(7, 0, "ABORT") == {"markers": 2}
    assert read(shard)[0] == [b"other"]
    assert read(shard, "u")[0] == []
    assert read(shard, isolation="read_uncommitted")[0] == [b"gone-1", b"other", b"gone-2"]
    shard.ktx_register(7, 1, [("t", 0)])  # the next transaction of the same producer
    tx_write(shard, 7, 1, 1, [b"kept"])
    shard.ktx_end(7, 1, "COMMIT")
    assert read(shard)[0] == [b"other", b"kept"]


def test_offsets_sent_with_their_group_s_registration_wait_for_it_and_no_longer(shard):
    """``send_offsets`` sends a group's offsets together with the add of the group
    (issue 27): the shard holds them until the registration lands, refuses them when
    none comes in time."""
    shard.send(RecordBatch("t", 1, [b"in"] * 4))
    shard.ktx_register(7, 0, [("t", 0)])
    later = threading.Timer(0.3, shard.ktx_register, (7, 0, [], ["g"]))
    later.start()
    t0 = time.monotonic()
    shard.ktx_offsets(7, 0, "g", {("t", 1): 3}, 5000)
    assert 0.25 < time.monotonic() - t0 < 3  # taken once the registration came
    later.join()
    t0 = time.monotonic()
    with pytest.raises(InvalidTxnStateError, match="'h' is not registered"):
        shard.ktx_offsets(7, 0, "h", {("t", 1): 3}, 300)
    assert 0.25 < time.monotonic() - t0 < 3
    with pytest.raises(InvalidMessageError, match="wait_ms"):
        shard.ktx_offsets(7, 0, "g", {("t", 1): 3}, -1)
    assert shard.ktx_end(7, 1, "COMMIT") == {"markers": 1}
    assert shard.get_offsets("g", [("t", 1)]) == {("t", 1): 3}


def test_a_write_sent_with_its_registration_waits_for_it_and_no_longer(shard):
    """The producer asks its coordinator to add a queue and sends the write at the same
    time (``wait_ms``): the shard holds the write until the registration lands, refuses
    it when none comes in time, and refuses a fenced epoch at once."""
    later = threading.Timer(0.3, shard.ktx_register, (7, 0, [("t", 0)]))
    later.start()
    t0 = time.monotonic()
    assert tx_write(shard, 7, 0, 1, [b"held"], wait_ms=5000).queue_offsets == [0]
    assert 0.25 < time.monotonic() - t0 < 3  # stored once the registration came
    later.join()
    t0 = time.monotonic()
    with pytest.raises(InvalidTxnStateError, match="t/1"):  # never registered: refused
        tx_write(shard, 7, 0, 2, [b"x"], qid=1, wait_ms=300)
    assert 0.25 < time.monotonic() - t0 < 3
    shard.ktx_end(7, 1, "COMMIT")  # its markers carry the next epoch: epoch 0 is fenced
    t0 = time.monotonic()
    with pytest.raises(ProducerFencedError):
        tx_write(shard, 7, 0, 2, [b"late"], wait_ms=5000)
    assert time.monotonic() - t0 < 1
    # a fence landing while a write waits ends its wait at once
    shard.ktx_register(7, 1, [("t", 0)])
    fence = threading.Timer(0.2, shard.ktx_end, (7, 2, "ABORT"))
    fence.start()
    t0 = time.monotonic()
    with pytest.raises((ProducerFencedError, InvalidTxnStateError)):
        tx_write(shard, 7, 1, 1, [b"x"], qid=1, wait_ms=5000)
    assert time.monotonic() - t0 < 3
    fence.join()
    # and a fence for a producer with nothing open here (its end reaches every shard)
    fence = threading.Timer(0.2, shard.ktx_end, (9, 1, "ABORT"))
    fence.start()
    t0 = time.monotonic()
    with pytest.raises(ProducerFencedError):
        tx_write(shard, 9, 0, 1, [b"x"], wait_ms=5000)
    assert time.monotonic() - t0 < 3
    fence.join()
    assert read(shard)[0] == [b"held"]
    for bad in (-1, True, 1.5, 10**9):
        with pytest.raises(InvalidMessageError, match="wait_ms"):
            tx_write(shard, 7, 3, 1, [b"x"], wait_ms=bad)


def test_writes_outside_the_registered_transaction_are_refused(shard):
    with pytest.raises(InvalidTxnStateError):  # never registered
        tx_write(shard, 7, 0, 1, [b"x"])
    shard.ktx_register(7, 0, [("t", 0)])
    with pytest.raises(InvalidTxnStateError, match="t/1"):  # a queue not in it (KIP-890)
        tx_write(shard, 7, 0, 1, [b"x"], qid=1)
    tx_write(shard, 7, 0, 1, [b"in"])
    shard.ktx_end(7, 0, "COMMIT")
    with pytest.raises(InvalidTxnStateError):  # a late write after its marker
        tx_write(shard, 7, 0, 2, [b"late"])
    shard.ktx_register(7, 1, [("t", 0)])
    with pytest.raises(ProducerFencedError):  # the previous epoch, now fenced
        tx_write(shard, 7, 0, 2, [b"late"])
    with pytest.raises(ProducerFencedError):
        shard.ktx_register(7, 0, [("t", 1)])
    assert shard.ktx_end(7, 0, "ABORT") == {"markers": 0}  # a late marker: nothing
    tx_write(shard, 7, 1, 1, [b"next"])
    shard.ktx_end(7, 1, "COMMIT")
    assert read(shard)[0] == [b"in", b"next"]
    assert read(shard, isolation="read_uncommitted")[0] == [b"in", b"next"]


def test_a_retry_is_stored_once_and_a_gap_is_refused(shard):
    shard.ktx_register(7, 0, [("t", 0)])
    first = tx_write(shard, 7, 0, 1, [b"a"])
    again = tx_write(shard, 7, 0, 1, [b"a"])
    assert again.duplicate and again.queue_offsets == first.queue_offsets
    with pytest.raises(OutOfOrderSequenceError):
        tx_write(shard, 7, 0, 3, [b"c"])
    tx_write(shard, 7, 0, 2, [b"b"])
    shard.ktx_end(7, 0, "COMMIT")
    assert read(shard)[0] == [b"a", b"b"]


def test_a_delayed_or_system_message_cannot_join_a_transaction(shard):
    shard.ktx_register(7, 0, [("t", 0)])
    with pytest.raises(InvalidMessageError, match="delayed"):
        shard.ktx_send(RecordBatch("t", 0, [b"x"], properties=[{"DELAY": "1"}]), 7, 0, 1)
    with pytest.raises(InvalidMessageError):
        shard.ktx_send(RecordBatch("t", 0, [b"x"], properties=[{"REAL_TOPIC": "t"}]), 7, 0, 1)
    with pytest.raises(InvalidMessageError):
        shard.ktx_send(RecordBatch("t", 0, [b"x"]), 0, 0, 1)  # no producer id


def test_offsets_sent_with_a_transaction_take_effect_with_its_commit_only(shard):
    shard.send(RecordBatch("t", 1, [b"in-%d" % i for i in range(5)]))
    shard.ktx_register(7, 0, [("t", 0)], ["job"])
    tx_write(shard, 7, 0, 1, [b"out"])
    shard.ktx_offsets(7, 0, "job", {("t", 1): 3})
    assert shard.get_offsets("job", [("t", 1)]) == {("t", 1): -1}  # pending
    shard.ktx_end(7, 0, "COMMIT")
    assert shard.get_offsets("job", [("t", 1)]) == {("t", 1): 3}
    shard.ktx_register(7, 1, [("t", 0)], ["job"])
    shard.ktx_offsets(7, 1, "job", {("t", 1): 5})
    shard.ktx_end(7, 1, "ABORT")
    assert shard.get_offsets("job", [("t", 1)]) == {("t", 1): 3}  # the abort's: dropped
    with pytest.raises(InvalidTxnStateError):  # a group not registered in the transaction
        shard.ktx_register(7, 2, [("t", 0)])
        shard.ktx_offsets(7, 2, "other", {("t", 1): 1})


def test_open_and_aborted_transactions_survive_a_restart(tmp_path):
    sh = open_shard(tmp_path)
    sh.ktx_register(7, 0, [("t", 0)])
    tx_write(sh, 7, 0, 1, [b"aborted"])
    sh.ktx_end(7, 0, "ABORT")
    sh.ktx_register(8, 3, [("t", 0)], ["job"])  # open across the restart
    tx_write(sh, 8, 3, 1, [b"pending"])
    sh.send(RecordBatch("t", 1, [b"x", b"y"]))
    sh.ktx_offsets(8, 3, "job", {("t", 1): 2})
    sh.close()
    sh = open_shard(tmp_path)
    try:
        assert read(sh) == ([], 2, 2)  # the aborted record hidden, the LSO held by 8
        with pytest.raises(OutOfOrderSequenceError):  # its sequences were kept
            tx_write(sh, 8, 3, 3, [b"gap"])
        assert tx_write(sh, 8, 3, 1, [b"pending"]).duplicate
        tx_write(sh, 8, 3, 2, [b"more"])
        with pytest.raises(ProducerFencedError):
            sh.ktx_register(8, 2, [("t", 0)])
        [open_txn] = sh.ktx_status()
        assert (open_txn["producer_id"], open_txn["epoch"]) == (8, 3)
        assert open_txn["queues"]["t/0"]["first"] == 2
        sh.ktx_end(8, 3, "COMMIT")
        assert read(sh)[0] == [b"pending", b"more"]
        assert sh.get_offsets("job", [("t", 1)]) == {("t", 1): 2}
        assert sh.ktx_status() == []
    finally:
        sh.close()
    sh = open_shard(tmp_path)
    try:  # and once more: ended transactions stay ended, aborted stays hidden
        assert read(sh)[0] == [b"pending", b"more"]
        assert sh.ktx_status() == []
        assert sh.get_offsets("job", [("t", 1)]) == {("t", 1): 2}
    finally:
        sh.close()
