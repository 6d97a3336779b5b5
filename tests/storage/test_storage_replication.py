"""Commit-log replication at the storage level (issue 26, first part): a follower store
that copies a leader's frames holds the same records at the same physical offsets, the
same queues and producer sequences, across segments and puts of several frames, after a
reopen, and again after it is cut back where it diverged.  Out-of-step and damaged
frames are refused with nothing written.  In-process stores, no Ray."""
from __future__ import annotations

import os
import random

import pytest

from raymq.storage import MessageStore, RecordBatch, StoreConfig
from raymq.storage.errors import StorageError
from raymq.storage.records import frame_producer
from raymq.storage.replication import cut_store, split_frames, truncate_log
from tests.helpers import put_starts

CONFIG = StoreConfig(segment_size_bytes=256 * 1024, max_message_bytes=4096,
                     max_frame_bytes=4096 + 128 * 1024, flush_interval_ms=50)
QUEUES = [("a", 0), ("a", 1), ("b", 0)]


def fill(store: MessageStore, rng: random.Random, puts: int, start: int = 0) -> None:
    for k in range(start, start + puts):
        n = rng.choice([1, 3, 40, 120])  # 120 records of up to 2 KiB: several frames
        topic, qid = rng.choice(QUEUES)
        bodies = [rng.randbytes(rng.randrange(10, 2048)) for _ in range(n)]
        store.put(RecordBatch(topic, qid, bodies, keys=[f"k{k}-{i}" for i in range(n)]),
                  producer_id=7 + k % 2, sequence=k // 2 + 1)


def copy(leader: MessageStore, follower: MessageStore, chunk: int) -> int:
    """Replicate until the follower holds everything; how many fetches."""
    fetches = 0
    while True:
        start, data = leader.read_frames(follower.max_phys_offset, chunk)
        if not data:
            return fetches
        follower.append_replicated(start, data)
        fetches += 1


def view(store: MessageStore) -> dict:
    out = {"end": store.max_phys_offset,
           "segments": [(b, s) for _p, b, s in store.segments()],
           "producers": {p: store.last_sequence(p) for p in (7, 8)}}
    for q in QUEUES:
        out[q] = [(m.phys_offset, m.queue_offset, m.key, m.body)
                  for m in store.read_queue(*q, 0, 100_000)]
    return out


@pytest.fixture
def pair(tmp_path):
    leader = MessageStore(str(tmp_path / "leader"), CONFIG, background=False)
    follower = MessageStore(str(tmp_path / "follower"), CONFIG, background=False)
    yield leader, follower
    leader.close()
    follower.close()


def test_a_follower_holds_the_leaders_records_at_the_same_offsets(pair, tmp_path):
    leader, follower = pair
    fill(leader, random.Random(3), 60)
    assert len(leader.segments()) > 3  # across segments
    _start, everything = leader.read_frames(0, 1 << 30)  # (the first segment's frames)
    frames = split_frames(everything)
    assert len(frames) > len({frame_producer(everything, p)[:2] for p, _l, _c in frames})
    # (more frames than puts there: puts of several frames)
    fetches = copy(leader, follower, chunk=5_000)
    assert fetches > 20  # in many pieces, puts of several frames split between them
    want = view(leader)
    assert view(follower) == want and want["producers"] == {7: 30, 8: 30}
    # a resend of a put the follower copied is a duplicate there too
    assert follower.put(RecordBatch("a", 0, [b"again"]), producer_id=7,
                        sequence=30).duplicate
    follower.close()
    reopened = MessageStore(str(tmp_path / "follower"), CONFIG, background=False)
    try:
        assert view(reopened) == want
    finally:
        reopened.close()


def test_a_put_over_several_queues_is_indexed_on_the_follower_as_on_the_leader(pair):
    """A frame of one queue is indexed without sorting its records by queue; one whose
    records go to several (interleaved, of two topics) is indexed queue by queue, each in
    its records' order."""
    leader, follower = pair
    rng = random.Random(11)
    for k in range(30):
        picks = [rng.choice(QUEUES) for _ in range(rng.choice([1, 5, 60]))]
        leader.put(RecordBatch([t for t, _q in picks], [q for _t, q in picks],
                               [b"%d-%d" % (k, i) for i in range(len(picks))]))
    copy(leader, follower, chunk=4_000)
    want = view(leader)
    assert view(follower) == want
    assert sum(len(want[q]) for q in QUEUES) > 500 and all(want[q] for q in QUEUES)


def test_copying_goes_on_from_where_it_stopped(pair):
    leader, follower = pair
    rng = random.Random(5)
    fill(leader, rng, 10)
    copy(leader, follower, chunk=100_000)
    fill(leader, rng, 10, start=10)
    assert leader.read_frames(leader.max_phys_offset, 1000)[1] == b""  # nothing new
    copy(leader, follower, chunk=3_000)
    assert view(follower) == view(leader)


def test_out_of_step_or_damaged_frames_are_refused_with_nothing_written(pair):
    leader, follower = pair
    fill(leader, random.Random(7), 5)
    start, data = leader.read_frames(follower.max_phys_offset, 4_000)
    with pytest.raises(StorageError, match="out of step"):
        follower.append_replicated(start + 8, data)
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0xFF
    with pytest.raises(StorageError, match="CRC|frame"):
        follower.append_replicated(start, bytes(damaged))
    assert follower.max_phys_offset == start and view(follower)[("a", 0)] == []
    copy(leader, follower, chunk=4_000)
    assert view(follower) == view(leader)


def test_a_replica_cut_back_where_it_diverged_copies_again_to_the_same(tmp_path, pair):
    leader, follower = pair
    rng = random.Random(11)
    fill(leader, rng, 30)
    copy(leader, follower, chunk=50_000)
    # the point where its epochs diverge: the start of a put in the middle of the log
    cut = sorted({m.phys_offset for q in QUEUES for m in follower.read_queue(*q, 0, 100)})
    cut = cut[len(cut) // 2]
    follower.close()
    truncate_log(str(tmp_path / "follower" / "commitlog"), CONFIG.segment_size_bytes, cut)
    follower = MessageStore(str(tmp_path / "follower"), CONFIG, background=False)
    try:
        assert follower.max_phys_offset <= cut
        kept = view(follower)
        for q in QUEUES:  # every queue holds exactly the leader's records before the cut
            assert kept[q] == [r for r in view(leader)[q] if r[0] < follower.max_phys_offset]
        copy(leader, follower, chunk=7_000)
        assert view(follower) == view(leader)
    finally:
        follower.close()



def test_a_replica_cut_below_its_checkpoint_reopens_from_the_cut_not_from_the_start(
        tmp_path, pair):
    """Issue 34: a cut below the checkpoint moves the checkpoint, the queues and the
    producer sequences back with the log, so nothing is re-indexed (it rebuilt every
    queue from offset 0); the store then holds, and copies again, what the leader has."""
    leader, follower = pair
    fill(leader, random.Random(5), 40)
    copy(leader, follower, chunk=50_000)
    follower.checkpoint()
    starts = put_starts(leader)
    cut, producers_before = starts[len(starts) // 2]
    queue_file = tmp_path / "follower" / "consumequeue" / "a" / "0"
    inode = os.stat(queue_file).st_ino
    follower.close()
    cut_store(str(tmp_path / "follower"), CONFIG.segment_size_bytes, cut)
    follower = MessageStore(str(tmp_path / "follower"), CONFIG, background=False)
    try:
        assert follower.max_phys_offset == cut
        assert follower.recovered_records == 0 and os.stat(queue_file).st_ino == inode
        kept = view(follower)
        for q in QUEUES:  # every queue holds exactly the leader's records before the cut
            assert kept[q] == [r for r in view(leader)[q] if r[0] < cut]
        assert kept["producers"] == {p: producers_before.get(p) for p in (7, 8)}
        # a put that was cut is a new put again, one before the cut a duplicate
        assert follower.put(RecordBatch("a", 0, [b"x"]), producer_id=7,
                            sequence=producers_before[7]).duplicate
        assert not follower.put(RecordBatch("a", 0, [b"x"]), producer_id=8,
                                sequence=producers_before[8] + 1).duplicate
        follower.close()
        cut_store(str(tmp_path / "follower"), CONFIG.segment_size_bytes, cut)
        follower = MessageStore(str(tmp_path / "follower"), CONFIG, background=False)
        copy(leader, follower, chunk=7_000)
        assert view(follower) == view(leader)
    finally:
        follower.close()
