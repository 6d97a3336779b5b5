"""The shard trusts no client (issue 12 B): what a raw client sends is checked where it is
stored, one bad message is refused alone, and what the shard cannot parse is skipped.

In-process shards, no Ray: these are the calls the data channel serves.
"""
from __future__ import annotations

import logging

import pytest

from tests.helpers import open_shard
from raymq.actors.protocol import (CHECK_EXPIRED_TOPIC, HALF_TOPIC, OP_TOPIC, SCHEDULE_TOPIC,
                                   Prop, dlq_topic, retry_topic)
from raymq.actors.shard import BrokerShard
from raymq.message import Message, check_group, check_user_topic
from raymq.storage import RecordBatch
from raymq.storage.errors import InvalidMessageError, RayMQError, ReservedNameError


@pytest.fixture
def shard(tmp_path):
    sh = open_shard(tmp_path, [("orders", 0), ("orders", 1), (retry_topic("g"), 0),
                               (dlq_topic("g"), 0)])
    yield sh
    sh.close()


def one(props: dict | None = None, topic: str = "orders", **kw) -> RecordBatch:
    return RecordBatch(topic, 0, [b"x"], properties=[props] if props is not None else None, **kw)


def bodies(sh, topic="orders", qid=0) -> list[bytes]:
    return [m.body for m in sh.store.read_queue(topic, qid, 0, 100)]


TX = {Prop.TRAN_MSG: "true", Prop.PRODUCER_GROUP: "g", Prop.TRANSACTION_ID: "t1"}


@pytest.mark.parametrize("props", [
    {Prop.ORIGIN_HALF: "x"},                       # would break every check round
    {Prop.PRODUCER_MSG_ID: "0000000000000000ABCD"},  # a forged id defeats dedupe by id
    {Prop.REAL_TOPIC: "orders", Prop.REAL_QID: "0"},
    {Prop.CHECK_TIMES: "1"},
    {Prop.OP_STATE: "1"},
    {Prop.RETRY_TOPIC: "orders"},
    {Prop.DLQ_REASON: "x"},
    {**TX, Prop.TXN_TIMEOUT_MS: "soon"},
    {**TX, Prop.TRAN_MSG: "yes"},
    {**TX, Prop.PRODUCER_GROUP: "bad group\n"},
    {**TX, Prop.TRANSACTION_ID: ""},
    {Prop.PRODUCER_GROUP: "g"},                    # a transaction's property without one
    {Prop.DELAY: "x"},
    {Prop.DELAY: "0"},
    {Prop.DELAY: "99"},
])
def test_a_system_property_the_sdk_does_not_set_or_cannot_parse_is_refused(shard, props):
    reply = shard.send(one(props))
    assert reply.refused and list(reply.refused) == [0]
    assert reply.phys == [-1] and bodies(shard) == []
    assert shard.store.max_queue_offset(HALF_TOPIC, 0) == 0


def test_what_the_sdk_sets_is_accepted(shard):
    for props in (TX, {**TX, Prop.TXN_TIMEOUT_MS: "5000"}, {Prop.DELAY: "3"}, {"user": "1"}):
        assert not shard.send(one(props)).refused


def test_one_bad_message_is_refused_alone_and_the_others_are_stored(shard):
    batch = RecordBatch("orders", [0, 1, 0], [b"a", b"b", b"c"],
                        properties=[None, {Prop.ORIGIN_HALF: "x"}, {"ok": "1"}])
    reply = shard.send(batch, 5, 1)
    assert list(reply.refused) == [1] and "ORIGIN_HALF_OFFSET" in reply.refused[1]
    assert reply.phys[1] == -1 and reply.phys[0] >= 0 and reply.phys[2] > reply.phys[0]
    assert reply.queue_offsets == [0, -1, 1]
    assert bodies(shard) == [b"a", b"c"] and bodies(shard, qid=1) == []
    again = shard.send(batch, 5, 1)  # the resend: the same refusal, nothing stored twice
    assert again.duplicate and list(again.refused) == [1] and bodies(shard) == [b"a", b"c"]


@pytest.mark.parametrize("topic", [HALF_TOPIC, OP_TOPIC, SCHEDULE_TOPIC, CHECK_EXPIRED_TOPIC,
                                   retry_topic("g"), dlq_topic("g")])
def test_a_client_cannot_send_to_a_system_topic(shard, topic):
    shard.set_routes([("orders", 0), (topic, 0)])
    reply = shard.send(one(topic=topic))
    assert list(reply.refused) == [0] and "reserved" in reply.refused[0]
    assert shard.store.max_queue_offset(topic, 0) == 0


@pytest.mark.parametrize("topic", [HALF_TOPIC, OP_TOPIC, SCHEDULE_TOPIC, CHECK_EXPIRED_TOPIC,
                                   dlq_topic("g"), "not-routed"])
def test_pull_serves_routed_user_and_retry_topics_only(shard, topic):
    shard.send(one(TX))  # a half: uncommitted
    with pytest.raises(RayMQError):
        shard.pull([(topic, 0, 0, 10)])
    assert shard.pull([("orders", 0, 0, 10)])[0][0] == "orders"
    assert shard.pull([(retry_topic("g"), 0, 0, 10)], group="g")[0][0] == retry_topic("g")


@pytest.mark.parametrize("group", [None, "other"])
def test_a_retry_topic_is_read_and_committed_by_its_own_group_only(shard, group):
    """A group's retry topic holds the messages its consumers gave back: another group
    (or a pull naming none) reads none of them and cannot move its offsets."""
    shard.store.put(RecordBatch(retry_topic("g"), 0, [b"x"]))  # (a given-back message)
    with pytest.raises(ReservedNameError, match="retry topic of group 'g'"):
        shard.pull([(retry_topic("g"), 0, 0, 10)], group=group)
    if group is not None:
        before = shard.store.offsets.snapshot()
        with pytest.raises(ReservedNameError):
            shard.commit_offsets(group, {(retry_topic("g"), 0): 1})
        assert shard.store.offsets.snapshot() == before
    [(_t, _q, batch, _n, _end)] = shard.pull([(retry_topic("g"), 0, 0, 10)], group="g")
    assert [m.body for m in batch.messages()] == [b"x"]
    shard.commit_offsets("g", {(retry_topic("g"), 0): 1})


def test_names_ending_in_a_newline_are_refused():
    for bad in ("orders\n", "g\n"):
        with pytest.raises(InvalidMessageError):
            check_user_topic(bad)
        with pytest.raises(InvalidMessageError):
            check_group(bad)


@pytest.mark.parametrize("group, queue", [
    ("dlq-resend@g@0", ("orders", 0)),   # an internal key's shape
    ("g\n", ("orders", 0)),
    ("g", ("orders", -1)),
    ("g", ("orders", True)),
    ("g", ("nope", 0)),                  # a queue this shard does not serve
    ("g", (HALF_TOPIC, 0)),
])
def test_commit_offsets_validates_group_and_queue(shard, group, queue):
    before = shard.store.offsets.snapshot()
    with pytest.raises(RayMQError):
        shard.commit_offsets(group, {queue: 0})
    assert shard.store.offsets.snapshot() == before


def test_recovery_and_rounds_skip_a_record_they_cannot_parse(tmp_path, caplog):
    """A half written before the shard checked properties (older data) must not stop
    recovery or check rounds: skipped and logged."""
    cfg = {"data_dir": str(tmp_path), "num_shards": 1, "txn_timeout_ms": 1}
    sh = BrokerShard(0, cfg, background=False)
    sh.set_routes([("orders", 0)])
    bad = {**TX, Prop.ORIGIN_HALF: "x", Prop.REAL_TOPIC: "orders", Prop.REAL_QID: "0"}
    sh.store.put(RecordBatch(HALF_TOPIC, 0, [b"bad"], properties=[bad]))  # as old data
    sh.store.put(RecordBatch(OP_TOPIC, 0, [b""], properties=[{Prop.ORIGIN_HALF: "y",
                                                               Prop.OP_STATE: "1"}]))
    [good] = sh.send(one(TX)).phys
    sh.close()
    caplog.set_level(logging.WARNING, logger="raymq.shard")
    sh = BrokerShard(0, cfg, background=False)  # recovery goes on
    sh.set_routes([("orders", 0)])
    try:
        assert [c.origin for c in sh.check_round(["g"], now_ms=2**42)] == [good]
        assert "cannot parse" in caplog.text
    finally:
        sh.close()


def test_the_client_refuses_what_the_store_would(tmp_path):
    """Checked in the client, so a bad message never joins another caller's request."""
    for m in (Message("orders", b"x", key="k" * 1025), Message("orders", b"x", tags="\ud800"),
              Message("orders", b"x", properties={"a\x01": "v"}),
              Message("orders", b"x", properties={"a": "v\x02"}),
              Message("orders", b"x", properties={"": "v"})):
        with pytest.raises(InvalidMessageError):
            m.validate(1024, 18)
    from raymq.message import validate_messages
    with pytest.raises(InvalidMessageError):
        validate_messages([Message("orders", b"x", key="k" * 1025)], 1024, 18)
    with pytest.raises(ReservedNameError):
        Message(retry_topic("g"), b"x").validate(1024, 18)


def test_a_wrong_message_id_is_no_such_message_never_garbage(shard):
    """Issue 12 D13: an offset that is not where a record starts is 'no such message'."""
    [a, b] = shard.send(RecordBatch("orders", 0, [b"first", b"second"])).phys
    assert shard.get_message(b).body == b"second"
    end = shard.store.max_phys_offset
    for wrong in (a + 1, a + 7, b - 1, (a + b) // 2, end, end + 10**9, 2**63 - 1, -1, True):
        with pytest.raises(InvalidMessageError, match="no such message") as err:
            shard.get_message(wrong)
        assert "/" not in str(err.value)  # no server path
        for call in (lambda: shard.send_back("g", wrong),
                     lambda: shard.dlq_resend("g", [wrong]),
                     lambda: shard.resolve_half(wrong, "COMMIT")):
            with pytest.raises(InvalidMessageError, match="no such message"):
                call()


def test_a_delayed_or_transactional_id_shows_the_message_as_delivered(shard):
    [delayed] = shard.send(one({Prop.DELAY: "3", "user": "1"})).phys
    [half] = shard.send(one(TX)).phys
    for phys in (delayed, half):
        m = shard.get_message(phys)
        assert (m.topic, m.queue_id, m.queue_offset) == ("orders", 0, -1)
        assert Prop.REAL_TOPIC not in m.properties and Prop.TRAN_MSG not in m.properties
    assert shard.get_message(delayed).properties["user"] == "1"


def test_the_client_hands_the_store_bytes_bodies_however_they_were_given():
    """A body given as a bytearray is validated and sent as ``bytes``, also in a batch
    that has timer messages in it."""
    from raymq.message import validate_messages
    for extra in ({}, {"deliver_after_ms": 1_000}):
        cols = validate_messages([Message("orders", bytearray(b"ab"), **extra),
                                  Message("orders", bytearray(b"cd"), **extra),
                                  Message("orders", b"ef", **extra)], 1024, 18)
        assert [type(b) for b in cols.body] == [bytes] * 3
        assert cols.body == [b"ab", b"cd", b"ef"]


def test_a_binary_key_and_headers_are_kept_by_every_copy_the_shard_makes(tmp_path):
    """A delayed message, a timer message, a committed half, a retry and a dead letter are
    copies the shard writes of a record: each keeps its binary key and its headers; bad
    headers are refused alone."""
    from raymq.storage.clock import ManualClock
    from raymq.message import messages_ext
    clock = ManualClock()
    sh = open_shard(tmp_path, [("orders", 0), (retry_topic("g"), 0), (dlq_topic("g"), 0)],
                    clock=clock)
    try:
        key, headers = b"\xff\x00k", [("h", b"\x01"), ("h", None)]
        sends = [{Prop.DELAY: "1"}, {Prop.DELIVER_AFTER: "5000"}, TX, None]
        reply = sh.send(RecordBatch("orders", 0, [b"delay", b"timer", b"half", b"now", b"bad"],
                                    keys=[key] * 5, headers=[headers] * 4 + [[("h", 1)]],
                                    properties=sends + [None]))
        assert list(reply.refused) == [4] and "bytes or None" in reply.refused[4]
        [end] = sh.end_transactions([("g", "t1", [reply.phys[2]], "COMMIT_MESSAGE")])
        assert end.outcome == "COMMITTED", end
        clock.advance(3_600_000)
        sh.deliver_due()
        got = {m.body: m for m in sh.store.read_queue("orders", 0, 0, 10)}
        assert sorted(got) == [b"delay", b"half", b"now", b"timer"]
        assert all((m.key, m.headers) == (key, headers) for m in got.values())
        retry = sh.send_back("g", got[b"now"].phys_offset, reason="x", retry_after_ms=0)
        dead = sh.send_back("g", got[b"now"].phys_offset, reason="x", dead_letter=True)
        clock.advance(1000)
        sh.deliver_due()
        [r] = sh.store.read_queue(retry_topic("g"), 0, 0, 10)
        [d] = sh.store.read_queue(dlq_topic("g"), 0, 0, 10)
        assert retry["topic"] == retry_topic("g") and dead["topic"] == dlq_topic("g")
        for m in (r, d):
            assert (m.key, m.headers, m.body) == (key, headers, b"now")
        [(_t, _q, batch, _n, _e)] = sh.pull([("orders", 0, 0, 10)])
        assert {(m.key, tuple(m.headers)) for m in messages_ext(0, batch)} == {
            (key, tuple(headers))}
    finally:
        sh.close()
