"""A follower cut back below a topic deletion it copied (a leader change before the
deletion was confirmed: Kafka's truncation to the new leader's log) is as if the deletion
had never reached it: the topic's queues hold its records before the cut again, the
deleted-topics file and ``retention.tombstones`` no longer list it, and the new leader's
frames -- more records of the topic, or the same deletion copied again -- apply cleanly.
Before, the dropped queues and the noted tombstone outlived the cut: an empty queue
beside a log holding the topic's records, and a tombstone past the log's end.  The same
holds for a follower whose store starts again at a later segment (``restart_store_at``).
In-process stores, no Ray."""
from __future__ import annotations

import pytest

from raymq.storage import MessageStore
from raymq.storage.clock import ManualClock
from raymq.storage.replication import cut_store, restart_store_at
from raymq.storage.topics import TOPIC_DELETED, read_deleted
from tests.helpers import SMALL, batch, put_starts

T_RECORDS = 30


def copy(leader: MessageStore, follower: MessageStore) -> None:
    """Replicate until the follower holds everything the leader has."""
    while True:
        start, data = leader.read_frames(follower.max_phys_offset, 50_000)
        if not data:
            return
        follower.append_replicated(start, data)


def bodies(store: MessageStore, topic: str) -> list[bytes]:
    return [m.body for m in store.read_queue(topic, 0, 0, 100_000)]


def tombstone_put(store: MessageStore) -> int:
    """Where the put of ``store``'s (only) tombstone starts: a put boundary below it."""
    phys = store.read_queue(TOPIC_DELETED, 0, 0, 1)[0].phys_offset
    return max(start for start, _producers in put_starts(store) if start <= phys)


@pytest.mark.parametrize("checkpointed", [True, False], ids=["cut-below-checkpoint",
                                                              "checkpoint-below-cut"])
def test_a_follower_cut_below_a_tombstone_gets_the_topic_back(tmp_path, checkpointed):
    clock = ManualClock(1_700_000_000_000)
    old = MessageStore(str(tmp_path / "old"), SMALL, clock, background=False)
    new = MessageStore(str(tmp_path / "new"), SMALL, clock, background=False)
    follower = MessageStore(str(tmp_path / "f"), SMALL, clock, background=False)
    try:
        for i in range(0, T_RECORDS, 10):
            old.put(batch("t", 0, i, 10, 1000))
            old.put(batch("u", 0, i, 10, 1000))
        if not checkpointed:
            follower.checkpoint()  # (empty yet: the cut is past what it covers)
        copy(old, new)             # the next leader has all but the deletion
        assert old.delete_topic("t")
        old.put(batch("u", 0, 100, 5))
        copy(old, follower)        # the follower copies the deletion: t's queues go
        assert follower.max_queue_offset("t", 0) == 0
        assert "t" in read_deleted(follower.directory)
        if checkpointed:
            follower.checkpoint()
        cut = tombstone_put(old)
        assert cut == new.max_phys_offset
        follower.close()
        # the new leader never had the deletion: the follower is cut back to its log
        cut_store(follower.directory, SMALL.segment_size_bytes, cut)
        follower = MessageStore(str(tmp_path / "f"), SMALL, clock, background=False)
        assert follower.max_phys_offset == cut
        assert follower.max_queue_offset("t", 0) == T_RECORDS
        assert bodies(follower, "t") == bodies(new, "t")
        assert bodies(follower, "u") == bodies(new, "u")
        assert "t" not in read_deleted(follower.directory)
        assert "t" not in follower.retention.tombstones
        # the new leader's records of t go on from the queue's end, on the follower too
        assert new.put(batch("t", 0, 500, 4)).queue_offsets == [30, 31, 32, 33]
        copy(new, follower)
        assert bodies(follower, "t") == bodies(new, "t")
        follower.close()
        follower = MessageStore(str(tmp_path / "f"), SMALL, clock, background=False)
        assert bodies(follower, "t") == bodies(new, "t") and not follower.retention.tombstones
        # cut back again and copying the old leader's deletion again deletes t again
        follower.close()
        cut_store(follower.directory, SMALL.segment_size_bytes, cut)
        follower = MessageStore(str(tmp_path / "f"), SMALL, clock, background=False)
        assert follower.max_queue_offset("t", 0) == T_RECORDS
        copy(old, follower)
        assert follower.max_queue_offset("t", 0) == 0
        assert read_deleted(follower.directory) == read_deleted(old.directory)
    finally:
        for s in (old, new, follower):
            s.close()


def test_a_follower_started_again_at_a_later_segment_keeps_no_tombstone(tmp_path):
    leader = MessageStore(str(tmp_path / "l"), SMALL, background=False)
    follower = MessageStore(str(tmp_path / "f"), SMALL, background=False)
    try:
        leader.put(batch("t", 0, 0, 20, 1000))
        assert leader.delete_topic("t")
        copy(leader, follower)
        assert "t" in read_deleted(follower.directory)
        base = follower.segments()[-1][1] + SMALL.segment_size_bytes  # (past its log)
        follower.close()
        restart_store_at(follower.directory, SMALL.segment_size_bytes, base)
        follower = MessageStore(str(tmp_path / "f"), SMALL, background=False)
        assert read_deleted(follower.directory) == {} and follower.retention.tombstones == {}
        assert follower.max_queue_offset("t", 0) == 0
    finally:
        leader.close()
        follower.close()
