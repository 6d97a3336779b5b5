"""Retention's public surface on the session cluster (issue 35): a topic's own retention
(create, alter, describe), offsets by time, a group's offsets reset each way (refused
while it has live members, or only shown with a dry run), a consumer that seeks to a
time, and the consumer's ``auto_offset_reset`` checked."""
from __future__ import annotations

import time

import pytest

from raymq import Message
from raymq.storage.errors import InvalidMessageError
from tests.client.test_cluster import read_to_end

pytestmark = pytest.mark.ray

HOUR = 3600_000


def test_a_topic_keeps_its_own_retention_and_shows_it(mq, name):
    info = mq.create_topic(name, 2, retention_ms=6 * HOUR, retention_bytes=10 << 30)
    assert (info["retention_ms"], info["retention_bytes"]) == (6 * HOUR, 10 << 30)
    info = mq.alter_topic(name, retention_ms=HOUR)
    assert (info["retention_ms"], info["retention_bytes"]) == (HOUR, 10 << 30)
    assert mq.describe_topic(name)["retention_ms"] == HOUR
    other = mq.create_topic(name + "d")  # the cluster's defaults
    assert (other["retention_ms"], other["retention_bytes"]) == (3 * 24 * HOUR, -1)
    for bad in (dict(retention_ms=0), dict(retention_bytes=0), dict(retention_ms="6h")):
        with pytest.raises(InvalidMessageError, match="retention_"):
            mq.alter_topic(name, **bad)


def test_offsets_by_time_reset_a_group_and_seek_a_consumer(mq, name):
    mq.create_topic(name, 2)
    p = mq.producer()
    first = [p.send(Message(name, b"early-%d" % i, key=str(i))) for i in range(10)]
    time.sleep(0.05)  # (store times are the shard's clock: what comes next is later)
    middle = int(time.time() * 1000)
    time.sleep(0.05)
    later = [p.send(Message(name, b"late-%d" % i, key=str(i))) for i in range(10)]
    ends = {}
    for r in first + later:
        ends[(name, r.queue_id)] = max(ends.get((name, r.queue_id), 0), r.queue_offset + 1)
    by_time = mq.admin.offsets_for_times({q: middle for q in ends})
    for q, off in by_time.items():  # the first late message of each queue
        firsts = [r.queue_offset for r in later if (name, r.queue_id) == q]
        assert off == min(firsts)
    assert mq.admin.offsets_for_times({q: 0 for q in ends}) == {q: 0 for q in ends}
    far = int(time.time() * 1000) + HOUR
    assert mq.admin.offsets_for_times({q: far for q in ends}) == ends

    group = name + "-g"
    plan = mq.admin.reset_offsets(group, name, to="datetime", value=middle, dry_run=True)
    assert {q: after for q, (_b, after) in plan.items()} == by_time
    assert all(before == -1 for before, _a in plan.values())
    got = mq.admin.reset_offsets(group, name, to="datetime", value=middle)
    assert got == plan
    c = mq.consumer(group, [name])
    try:
        bodies = sorted(m.body for m in read_to_end(c, mq, [name]))
        assert bodies == sorted(b"late-%d" % i for i in range(10))  # from the reset on
        with pytest.raises(InvalidMessageError, match="live member"):
            mq.admin.reset_offsets(group, name, to="earliest")
        # while a member is live, a dry run still shows what a reset would do
        shown = mq.admin.reset_offsets(group, name, to="earliest", dry_run=True)
        assert {q: a for q, (_b, a) in shown.items()} == {q: 0 for q in ends}
        moved = c.seek_to_time(middle)
        assert moved == by_time
        assert sorted(m.body for m in read_to_end(c, mq, [name])) == \
            sorted(b"late-%d" % i for i in range(10))
    finally:
        c.close()
    for to, value, want in (("latest", None, ends), ("offset", 3, {q: min(3, e) for q, e in
                                                                   ends.items()})):
        plan = wait_reset(mq, group, name, to, value)
        assert {q: a for q, (_b, a) in plan.items()} == want
    plan = wait_reset(mq, group, name, "duration", 10 * HOUR)  # everything is younger
    assert {q: a for q, (_b, a) in plan.items()} == {q: 0 for q in ends}


def wait_reset(mq, group, topic, to, value):
    """A reset once the group's last member is gone (its session ends after close)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return mq.admin.reset_offsets(group, topic, to=to, value=value)
        except InvalidMessageError as err:
            if "live member" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_consumer_says_which_resets_it_knows(mq, name):
    mq.create_topic(name, 1)
    with pytest.raises(InvalidMessageError, match="auto_offset_reset must be"):
        mq.consumer(name + "-g", [name], auto_offset_reset="smallest")


def test_a_deleted_topic_is_gone_at_once_and_created_again_empty(mq, name):
    from raymq import UnknownTopicError
    mq.create_topic(name, 2)
    p = mq.producer()
    for i in range(20):
        p.send(Message(name, b"old-%d" % i, key=str(i)))
    group = name + "-g"
    c = mq.consumer(group, [name])
    try:
        assert len(read_to_end(c, mq, [name])) == 20
        c.commit()
    finally:
        c.close()
    info = mq.delete_topic(name)
    assert info["queues"] == 2 and info["pending"] == {}
    with pytest.raises(UnknownTopicError):
        p.send(Message(name, b"after"))
    with pytest.raises(UnknownTopicError):
        mq.describe_topic(name)
    with pytest.raises(UnknownTopicError):
        mq.delete_topic(name)
    with pytest.raises(Exception, match="reserved"):
        mq.delete_topic("RMQ_SYS_OFFSETS")
    mq.create_topic(name, 2)  # a new, empty topic: no old message, no old offset
    assert mq.admin.offsets_for_times({(name, 0): 0, (name, 1): 0}) == {(name, 0): 0,
                                                                       (name, 1): 0}
    q = p.send(Message(name, b"new"))
    assert q.queue_offset == 0
    c = mq.consumer(group, [name])
    try:
        assert [m.body for m in read_to_end(c, mq, [name])] == [b"new"]
    finally:
        c.close()
