"""Deleting a topic from a store (issue 35): its queues go at once; created again it starts
empty at offset 0 and never shows the old records -- after a reopen, after a rebuild of
the queues from the log, and on a follower that copies the log; its old records are
garbage to retention whatever its retention said; a crash between the tombstone and the
dropping of the queues is finished on open.  In-process stores, no Ray."""
from __future__ import annotations

import os

from raymq.storage import MessageStore
from raymq.storage.clock import ManualClock
from raymq.storage.retention import RetentionPolicy, TopicRetention
from raymq.storage.topics import TOPIC_DELETED
from tests.helpers import SMALL, batch, forget_checkpoint

DAY = 86_400_000


def bodies(store, topic, qid=0):
    start = store.retention.log_start(topic, qid)
    return [m.body for m in store.read_queue(topic, qid, start, 100_000)]


def test_a_deleted_topic_created_again_starts_empty_everywhere(tmp_path):
    clock = ManualClock(1_700_000_000_000)
    leader = MessageStore(str(tmp_path / "l"), SMALL, clock, background=False)
    follower = MessageStore(str(tmp_path / "f"), SMALL, clock, background=False)
    try:
        for i in range(0, 600, 20):
            leader.put(batch("a", i % 40 // 20, i, 20, 1000))
            leader.put(batch("b", 0, i, 20, 1000))
        assert leader.delete_topic("a") and not leader.delete_topic("nope")
        assert leader.max_queue_offset("a", 0) == 0 and bodies(leader, "a") == []
        assert not os.path.exists(os.path.join(leader.directory, "consumequeue", "a"))
        assert leader.put(batch("a", 0, 9000, 3)).queue_offsets == [0, 1, 2]  # created again
        want = {"a": [batch("a", 0, 9000, 3).bodies[i] for i in range(3)], "b": bodies(leader, "b")}
        assert len(want["b"]) == 600
        pos = 0  # a follower copies it all, tombstone included
        while True:
            start, data = leader.read_frames(pos, 200_000)
            if not data:
                break
            pos = follower.append_replicated(start, data)
        for s in (leader, follower):
            assert bodies(s, "a") == want["a"] and bodies(s, "b") == want["b"]
            assert bodies(s, "a", 1) == [] and s.max_queue_offset("a", 1) == 0
    finally:
        leader.close()
        follower.close()
    for path in (tmp_path / "l", tmp_path / "f"):  # reopened, and rebuilt from the log
        for rebuild in (False, True):
            if rebuild:
                forget_checkpoint(path)
            store = MessageStore(str(path), SMALL, clock, background=False)
            try:
                assert bodies(store, "a") == want["a"] and bodies(store, "b") == want["b"]
                assert store.max_queue_offset("a", 1) == 0
            finally:
                store.close()
    # its old records are garbage to retention, however long the topics' retention
    store = MessageStore(str(tmp_path / "l"), SMALL, clock, background=False)
    try:
        store.delete_topic("b")
        store.put(batch("c", 0, 0, 300, 1000))
        store.checkpoint()
        policy = RetentionPolicy(TopicRetention(365 * DAY), {},
                                 store.retention.deleted(), frozenset({TOPIC_DELETED}))
        assert set(policy.deleted) == {"a", "b"}
        v = store.retention.apply(policy, clock.now_ms())
        assert v.count >= 4 and v.held_by == "a"  # (the new a's records hold its segment)
        assert bodies(store, "a") == want["a"] and store.max_queue_offset("b", 0) == 0
    finally:
        store.close()


def test_a_crash_between_the_tombstone_and_the_queues_is_finished_on_open(tmp_path):
    from raymq.storage import topics
    store = MessageStore(str(tmp_path / "s"), SMALL, background=False)
    store.put(batch("a", 0, 0, 50))
    store.put(RecordBatch_tombstone("a"))  # the tombstone written, its queues not dropped
    store.checkpoint()                     # (and a checkpoint covered it)
    store.close()
    assert topics.read_deleted(str(tmp_path / "s")) == {}
    store = MessageStore(str(tmp_path / "s"), SMALL, background=False)
    try:
        assert store.max_queue_offset("a", 0) == 0 and "a" in topics.read_deleted(store.directory)
    finally:
        store.close()


def RecordBatch_tombstone(topic: str):
    from raymq.storage import RecordBatch
    return RecordBatch(TOPIC_DELETED, 0, [topic.encode()])


def delete_racing(store, topic: str, *, also_deleted: bool = False) -> list:
    """``store.delete_topic(topic)``, with a write of the topic made right after its
    tombstone's put (and, ``also_deleted``, a whole second deletion of it before that
    write): what each of them gave, in order (an error raised is given)."""
    from raymq.storage.errors import UnknownTopicError
    put, raced = store.put, []

    def put_then_race(b, *args, **kwargs):
        res = put(b, *args, **kwargs)
        if not raced and TOPIC_DELETED in b.column("topics"):  # the tombstone is written
            raced.append("tombstone")
            if also_deleted:
                raced.append(store.delete_topic(topic))  # the other deletion, all of it
            try:
                raced.append(put(batch(topic, 0, 100, 1)))
            except UnknownTopicError as err:
                raced.append(err)
        return res
    store.put = put_then_race
    try:
        assert store.delete_topic(topic)
    finally:
        store.put = put
    return raced[1:]


def test_a_write_landing_in_the_middle_of_a_deletion_is_refused_and_the_store_opens(tmp_path):
    """The tombstone's put waits for its fsync before the queues are dropped; a write for
    the topic in between (a due timer, a send on a stale route) got the old queue's next
    offset and was acknowledged, then lost with the queue -- and on every open the log
    held a record of the topic after its tombstone at an offset a fresh queue cannot
    take: the store could not be opened (RebuildNeeded), with or without a checkpoint.
    Such a write is refused now (UnknownTopicError: the topic is being deleted)."""
    from raymq.storage.errors import UnknownTopicError
    path = tmp_path / "s"
    store = MessageStore(str(path), SMALL, background=False)
    store.put(batch("a", 0, 0, 50))
    raced = delete_racing(store, "a")
    assert len(raced) == 1 and isinstance(raced[0], UnknownTopicError), raced
    assert store.put(batch("a", 0, 200, 2)).queue_offsets == [0, 1]  # created again
    want = bodies(store, "a")
    store.close()
    for scan_all in (False, True):  # reopened from its checkpoint, then from the log start
        if scan_all:
            forget_checkpoint(path)
        store = MessageStore(str(path), SMALL, background=False)
        try:
            assert store.max_queue_offset("a", 0) == 2 and bodies(store, "a") == want
        finally:
            store.close()


def test_two_deletions_of_a_topic_at_once_both_hold_its_writes_off(tmp_path):
    """The janitor and a client may delete a topic at the same time: the second one to
    finish must not let writes of the topic in while the first still waits on its
    tombstone (a set of topics being deleted did: the second's end took the topic out)."""
    from raymq.storage.errors import UnknownTopicError
    store = MessageStore(str(tmp_path / "s"), SMALL, background=False)
    try:
        store.put(batch("a", 0, 0, 50))
        raced = delete_racing(store, "a", also_deleted=True)
        assert raced[0] is True and isinstance(raced[1], UnknownTopicError), raced
        assert store.put(batch("a", 0, 200, 1)).queue_offsets == [0]
    finally:
        store.close()
