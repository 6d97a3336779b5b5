"""Retention at the storage level (issue 35): whole commit-log segments go once every
queue with records in them is done with them -- by age, by size, a topic's own
retention, for disk space -- oldest first, never past a pin or the checkpoint; each
queue's log start moves up with them, the blocks of its aged-out index entries are given
back, and a reopen (or a rebuild of the queues from a log that starts late) keeps the
same offsets.  In-process stores on a manual clock, no Ray."""
from __future__ import annotations

import os

import pytest

from raymq.storage import MessageStore
from raymq.storage.clock import ManualClock
from raymq.storage.errors import OffsetOutOfRangeError
from raymq.storage.retention import (UNLIMITED, RetentionPolicy, SegmentSummary,
                                     TopicRetention, expired_prefix)
from tests.helpers import SMALL, batch, forget_checkpoint

HOUR = 3600_000
DAY = 24 * HOUR


def fill(store: MessageStore, clock: ManualClock, topic: str, n: int, *, qid: int = 0,
         step_ms: int = 0, size: int = 2000) -> None:
    start = store.max_queue_offset(topic, qid)
    for i in range(start, start + n, 10):
        store.put(batch(topic, qid, i, 10, size))
        clock.advance(step_ms)


@pytest.fixture
def clock():
    return ManualClock(1_700_000_000_000)


def open_at(path, clock) -> MessageStore:
    return MessageStore(str(path), SMALL, clock, background=False)


def policy(ms=DAY, size=UNLIMITED, **topics) -> RetentionPolicy:
    return RetentionPolicy(TopicRetention(ms, size), {t: TopicRetention(*r) for t, r in topics.items()})


# ------------------------------------------------------------------ the rule
def seg(base, newest_ms, **queues) -> SegmentSummary:
    return SegmentSummary(base, base + 100, newest_ms, {(t, 0): b for t, b in queues.items()})


def test_a_segment_goes_only_when_every_topic_in_it_is_done_with_it():
    segs = [seg(0, 0, a=50), seg(100, 10, a=20, b=30), seg(200, 20, a=50), seg(300, 30, b=5)]
    p = policy(ms=15, b_long=(1000,))
    assert expired_prefix(segs, p, 31, covered_end=10**9, pinned=10**9).count == 2
    p = policy(ms=15, b=(100, UNLIMITED))  # b keeps its records 100 ms: holds segment 1 on
    v = expired_prefix(segs, p, 31, covered_end=10**9, pinned=10**9)
    assert (v.count, v.held_by, v.held_bytes) == (1, "b", 30)  # (b's bytes in segment 1)
    # a pin, or what a checkpoint does not cover yet, holds them too
    assert expired_prefix(segs, policy(ms=1), 1000, covered_end=10**9, pinned=150).count == 1
    v = expired_prefix(segs, policy(ms=1), 1000, covered_end=250, pinned=10**9)
    assert (v.count, v.held_by, v.held_bytes) == (2, "checkpoint", 100)  # (all of it)
    # by size: a queue keeps at least its retention_bytes in the segments after
    assert expired_prefix(segs, policy(ms=DAY, size=50), 31, covered_end=10**9,
                          pinned=10**9).count == 1  # a: 20+50 after seg 0; b: 5 after seg 1
    # for disk space, whatever the retention (the pin still holds)
    v = expired_prefix(segs, policy(ms=DAY), 31, covered_end=10**9, pinned=10**9, force=150)
    assert (v.count, v.forced) == (2, 2)
    assert expired_prefix(segs, policy(ms=DAY), 31, covered_end=10**9, pinned=100,
                          force=10**6).count == 1
    # a deleted topic's records before its deletion are garbage
    p = policy(ms=DAY)
    p.deleted = {"a": 300, "b": 200}
    assert expired_prefix(segs, p, 31, covered_end=10**9, pinned=10**9).count == 3


# --------------------------------------------------------------- the store
def test_segments_go_when_their_records_pass_retention_and_the_log_start_moves_up(
        tmp_path, clock):
    store = open_at(tmp_path / "s", clock)
    try:
        fill(store, clock, "a", 600, step_ms=HOUR // 6)  # 10 h of records
        store.checkpoint()
        n_before = len(store.segments())
        assert n_before >= 5
        v = store.retention.apply(policy(ms=20 * HOUR), clock.now_ms())
        assert v.count == 0 and store.retention.log_start("a", 0) == 0
        clock.advance(15 * HOUR)  # the first ~5 h of records are 20 h old now
        v = store.retention.apply(policy(ms=20 * HOUR), clock.now_ms())
        assert 0 < v.count < n_before - 1 and len(store.segments()) == n_before - v.count
        start = store.retention.log_start("a", 0)
        first_kept = store.read_queue("a", 0, start, 1)[0]
        assert first_kept.phys_offset >= store.min_phys_offset and 0 < start < 600
        # every record in a deleted segment was older than the retention; none kept is
        assert clock.now_ms() - first_kept.store_ms <= 20 * HOUR + HOUR
        with pytest.raises(OffsetOutOfRangeError, match=f"a/0: offset 3 is below .* {start}"):
            store.retention.check_readable("a", 0, 3)
        assert [m.queue_offset for m in store.read_queue("a", 0, start, 5)] == \
            list(range(start, start + 5))
        assert store.retention.deleted_segments == v.count and store.retention.deleted_bytes > 0
    finally:
        store.close()
    reopened = open_at(tmp_path / "s", clock)
    try:
        assert reopened.retention.log_start("a", 0) == start and reopened.max_queue_offset("a", 0) == 600
        assert [m.body for m in reopened.read_queue("a", 0, 599, 1)] == \
            [batch("a", 0, 599, 1, 2000).bodies[0]]
    finally:
        reopened.close()


def test_a_topic_with_a_longer_retention_keeps_the_segments_its_records_are_in(
        tmp_path, clock):
    store = open_at(tmp_path / "s", clock)
    try:
        fill(store, clock, "short", 200)
        store.put(batch("long", 0, 0, 1))
        fill(store, clock, "short", 400)
        store.checkpoint()
        clock.advance(2 * DAY)
        held = store.retention.apply(policy(ms=DAY, long=(7 * DAY,)), clock.now_ms())
        assert held.held_by == "long" and store.retention.log_start("long", 0) == 0
        assert [m.body for m in store.read_queue("long", 0, 0, 1)] == batch("long", 0, 0, 1).bodies
        assert store.min_phys_offset <= store.read_queue("long", 0, 0, 1)[0].phys_offset
    finally:
        store.close()


def test_queue_entries_that_aged_out_give_their_disk_blocks_back(tmp_path, clock):
    store = open_at(tmp_path / "s", clock)
    try:
        fill(store, clock, "a", 3000, size=100)
        store.checkpoint()
        path = os.path.join(store.directory, "consumequeue", "a", "0")
        before = os.stat(path).st_blocks
        clock.advance(2 * DAY)
        store.retention.apply(policy(ms=DAY), clock.now_ms())
        assert store.retention.log_start("a", 0) > 2000
        after = os.stat(path).st_blocks
        if after == before:
            pytest.skip("this filesystem does not punch holes (fallocate)")
        assert after < before and os.stat(path).st_size == 3000 * 20
    finally:
        store.close()


def test_a_rebuild_of_the_queues_from_a_log_that_starts_late_keeps_every_offset(
        tmp_path, clock):
    store = open_at(tmp_path / "s", clock)
    fill(store, clock, "a", 500)
    fill(store, clock, "b", 300)
    store.checkpoint()
    clock.advance(2 * DAY)
    fill(store, clock, "a", 100)
    store.checkpoint()
    store.retention.apply(policy(ms=DAY), clock.now_ms())
    starts = {q: store.retention.log_start(*q) for q in (("a", 0), ("b", 0))}
    want = {q: [m.body for m in store.read_queue(*q, starts[q], 1000)] for q in starts}
    assert starts[("a", 0)] > 0 and starts[("b", 0)] > 0
    store.close()
    forget_checkpoint(tmp_path / "s")  # as if no checkpoint: the queues re-indexed
    for name in os.listdir(tmp_path / "s" / "consumequeue" / "a"):
        os.unlink(tmp_path / "s" / "consumequeue" / "a" / name)
    store = open_at(tmp_path / "s", clock)
    try:
        assert {q: store.retention.log_start(*q) for q in starts}[("a", 0)] == starts[("a", 0)]
        assert store.max_queue_offset("a", 0) == 600
        assert [m.body for m in store.read_queue("a", 0, starts[("a", 0)], 1000)] == want[("a", 0)]
        assert store.put(batch("a", 0, 600, 1)).queue_offsets == [600]
    finally:
        store.close()


def test_the_segment_written_to_and_what_no_checkpoint_covers_never_go(tmp_path, clock):
    store = open_at(tmp_path / "s", clock)
    try:
        fill(store, clock, "a", 400)
        clock.advance(2 * DAY)
        v = store.retention.apply(policy(ms=DAY), clock.now_ms())
        assert v.count <= len(store.segments()) and store.retention.log_start("a", 0) == 0 or \
            v.held_by == "checkpoint"
        store.checkpoint()
        v = store.retention.apply(policy(ms=1), clock.now_ms())
        assert len(store.segments()) == 1 and store.retention.log_start("a", 0) > 0
        assert store.put(batch("a", 0, 400, 1)).queue_offsets == [400]
    finally:
        store.close()


def test_offsets_for_times_find_the_first_message_stored_at_or_after_a_time(tmp_path, clock):
    store = open_at(tmp_path / "s", clock)
    try:
        t0 = clock.now_ms()
        for i in range(0, 300, 10):  # ten messages a minute, with a gap of an hour at 150
            store.put(batch("a", 0, i, 10))
            clock.advance(60_000 if i != 140 else HOUR)
        q = store.retention.offset_for_time
        assert q("a", 0, t0 - 1) == 0 and q("a", 0, t0) == 0
        assert q("a", 0, t0 + 1) == 10 and q("a", 0, t0 + 60_000) == 10
        assert q("a", 0, t0 + 14 * 60_000 + 1) == 150  # inside the gap: the first after it
        assert q("a", 0, clock.now_ms()) == 300 and q("a", 0, 10**15) == 300  # the end
        assert q("nope", 0, t0) == 0
        fill(store, clock, "b", 200)  # (a's segment sealed)
        clock.advance(DAY + 2 * HOUR)
        fill(store, clock, "b", 200)
        store.checkpoint()
        store.retention.apply(policy(ms=DAY), clock.now_ms())
        assert store.retention.log_start("a", 0) == 300  # every message of a aged out
        assert q("a", 0, t0) == 300
    finally:
        store.close()
