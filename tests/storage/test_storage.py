"""Storage engine: round trips, segments, recovery, corruption, bad input."""
from __future__ import annotations

import json
import logging
import random
import os
import threading
import time
from collections import defaultdict

import numpy as np
import pytest

from raymq.storage import (ConfigError, CorruptLogError, ManualClock, MessageStore,
                     MessageTooLargeError, Record, RecordBatch, StoreConfig, SysFlag)
from raymq.storage.commitlog import segment_name
from raymq.storage.errors import InvalidMessageError
from raymq.storage.offsets import OffsetStore
from raymq.storage.records import FRAME_HEADER_BYTES
from tests.helpers import (SMALL, batch, body, commitlog_files, flip, open_store,
                                  forget_checkpoint)


def test_every_field_round_trips(tmp_path):
    clock = ManualClock(1_700_000_123_456)
    rec = Record("orders", 3, b"\x00body\xff" * 10, key="order-1", tags="paid",
                 properties={"TRAN_MSG": "true", "ünï": "cödé", "empty": ""},
                 flags=int(SysFlag.TRANSACTION_PREPARED), born_ms=1_700_000_000_001,
                 reconsume_count=7, prepared_offset=123456789, tag_code=None)
    with open_store(tmp_path, clock=clock) as store:
        res = store.put([rec])
        m = store.get_message(res.phys_offsets[0])
        assert store.read_queue("orders", 3, 0, 10)[0] == m
    with open_store(tmp_path) as store:  # and after reopening
        m2 = store.get_message(res.phys_offsets[0], res.sizes[0])
    for got in (m, m2):
        assert (got.topic, got.queue_id, got.queue_offset) == ("orders", 3, 0)
        assert got.body == rec.body and got.key == "order-1" and got.tags == "paid"
        assert got.properties == rec.properties
        assert got.flags == SysFlag.TRANSACTION_PREPARED
        assert got.born_ms == 1_700_000_000_001 and got.store_ms == 1_700_000_123_456
        assert got.reconsume_count == 7 and got.prepared_offset == 123456789
        assert got.phys_offset == res.phys_offsets[0] and got.size == res.sizes[0]
        assert got.tag_code != 0  # hash of "paid"
        assert got.to_record().body == rec.body


def test_explicit_tag_code_goes_to_the_consume_queue(tmp_path):
    with open_store(tmp_path) as store:
        store.put([Record("SCHEDULE", 2, b"x", tag_code=1_800_000_000_000,
                          flags=int(SysFlag.SCHEDULED))])
        assert store.read_cq("SCHEDULE", 2, 0, 1)["tag"][0] == 1_800_000_000_000


def test_batch_over_several_queues_gets_offsets_per_queue(tmp_path):
    topics = ["a", "b", "a", "a", "b", "c"]
    qids = [0, 0, 0, 1, 0, 0]
    b = RecordBatch(topics, qids, [body(i) for i in range(6)], keys=[None, "k", None, "x", None, None])
    with open_store(tmp_path) as store:
        store.put(RecordBatch("a", 0, [b"first"]))
        res = store.put(b)
        assert res.queue_offsets == [1, 0, 2, 0, 1, 0]
        assert [m.body for m in store.read_queue("a", 0, 0, 10)] == [b"first", body(0), body(2)]
        assert [m.key for m in store.read_queue("b", 0, 0, 10)] == ["k", None]
        assert store.queues() == [("a", 0), ("a", 1), ("b", 0), ("c", 0)]
        before = {q: store.read_queue(*q, 0, 10) for q in store.queues()}
    # lose the whole index and the checkpoint: everything is re-indexed from the log
    import shutil
    shutil.rmtree(tmp_path / "consumequeue")
    forget_checkpoint(tmp_path)
    with open_store(tmp_path) as store:
        assert {q: store.read_queue(*q, 0, 10) for q in store.queues()} == before
        assert store.recovered_records == 7


@pytest.mark.parametrize("n", [7, 150])  # record by record (small puts) and by columns
def test_puts_over_several_queues_index_what_recovery_rebuilds(tmp_path, n):
    rng = random.Random(n)
    queues = [("a", 0), ("a", 1), ("b", 0), ("c", 3)]
    picks = [rng.choice(queues) for _ in range(n)]
    b = RecordBatch([t for t, _ in picks], [q for _, q in picks], [body(i) for i in range(n)],
                    tags=[rng.choice([None, "x", "y"]) for _ in range(n)])
    with open_store(tmp_path) as store:
        store.put(RecordBatch("a", 1, [b"first"]))
        res = store.put(b)
        seen = defaultdict(int, {("a", 1): 1})
        for (t, q), off in zip(picks, res.queue_offsets):
            assert off == seen[(t, q)]
            seen[(t, q)] += 1
        indexed = {q: store.read_cq(*q, 0, 1000).tobytes() for q in store.queues()}
    assert {q: len(v) // 20 for q, v in indexed.items()} == dict(seen)
    import shutil
    shutil.rmtree(tmp_path / "consumequeue")
    forget_checkpoint(tmp_path)
    with open_store(tmp_path) as store:
        assert {q: store.read_cq(*q, 0, 1000).tobytes() for q in store.queues()} == indexed


def test_with_records_is_concat_of_a_batch_of_them():
    from raymq.storage.records import Record
    rng = random.Random(7)
    for _ in range(200):
        k = rng.randint(1, 5)
        pick = lambda *xs: [rng.choice(xs) for _ in range(k)]  # noqa: E731
        ahead = RecordBatch(rng.choice(["t", pick("t", "u")]), rng.choice([0, pick(0, 1)]),
                            [body(i) for i in range(k)],
                            keys=rng.choice([None, pick(None, "k")]),
                            tags=rng.choice([None, pick(None, "a")]),
                            properties=rng.choice([None, pick(None, {"p": "1"})]),
                            born_ms=rng.choice([5, pick(5, 6)]))
        records = [Record(rng.choice(["t", "v"]), rng.choice([0, 2]), body(i),
                          rng.choice([None, "k2"]), rng.choice([None, "b"]),
                          rng.choice([None, {"q": "2"}]), rng.choice([0, 4]), 5,
                          tag_code=rng.choice([None, 9]))
                   for i in range(rng.randint(1, 4))]
        got = ahead.with_records(records)
        want = RecordBatch.concat([ahead, RecordBatch.from_records(records)])
        assert {s: getattr(got, s) for s in RecordBatch.__slots__} == \
            {s: getattr(want, s) for s in RecordBatch.__slots__}


def test_many_segments_named_by_base_offset(tmp_path):
    with open_store(tmp_path) as store:
        for start in range(0, 6000, 500):
            store.put(batch("t", 0, start, 500))
        segs = store.segments()
    assert len(segs) >= 5
    for path, base, size in segs:
        assert os.path.basename(path) == segment_name(base)
        assert base % SMALL.segment_size_bytes == 0 and size <= SMALL.segment_size_bytes
    with open_store(tmp_path) as store:
        got = store.read_queue("t", 0, 0, 6000)
        assert [m.body for m in got] == [body(i) for i in range(6000)]
        assert [m.queue_offset for m in got] == list(range(6000))
        # a read spanning a segment boundary
        mid = store.read_queue("t", 0, 2990, 20)
        assert [m.body for m in mid] == [body(i) for i in range(2990, 3010)]


def test_big_put_is_split_into_frames_that_fit(tmp_path):
    cfg = StoreConfig(segment_size_bytes=512 * 1024, max_message_bytes=4096,
                      max_frame_bytes=140 * 1024)
    with open_store(tmp_path, cfg) as store:
        res = store.put(batch("t", 0, 0, 3000, size=1000))  # ~3 MB in one put
        assert res.queue_offsets == list(range(3000))
        assert len(store.segments()) >= 6
        assert [m.body for m in store.read_queue("t", 0, 0, 3000)] == [
            body(i, 1000) for i in range(3000)]


def test_consume_queues_rebuilt_when_lost_past_checkpoint(tmp_path):
    store = open_store(tmp_path)
    store.put(batch("t", 0, 0, 100))
    store.checkpoint()
    store.put(batch("t", 0, 100, 100))
    store.put(batch("u", 1, 0, 50))
    store.close()
    # lose the index past the checkpoint: cut t/0 back to 100 entries, delete u/1
    cq = tmp_path / "consumequeue" / "t" / "0"
    os.truncate(cq, 100 * 20 + 7)  # and a torn partial entry
    os.unlink(tmp_path / "consumequeue" / "u" / "1")
    # the checkpoint claims everything was indexed: put it back to the first checkpoint
    with open_store(tmp_path) as store:
        pass
    os.truncate(cq, 100 * 20)
    (tmp_path / "checkpoint").write_text('{"format": "raymq-checkpoint", "version": 1, '
                                         '"consume_queue_offset": 0}')
    with open_store(tmp_path) as store:
        assert [m.body for m in store.read_queue("t", 0, 0, 1000)] == [body(i) for i in range(200)]
        assert store.max_queue_offset("u", 1) == 50


def test_whole_index_rebuilt_when_it_disagrees_with_the_log(tmp_path, caplog):
    with open_store(tmp_path) as store:
        store.put(batch("t", 0, 0, 100))
        store.put(batch("t", 0, 100, 100))
    os.unlink(tmp_path / "consumequeue" / "t" / "0")
    (tmp_path / "checkpoint").write_text('{"format": "raymq-checkpoint", "version": 1, '
                                         f'"consume_queue_offset": {10 ** 6}, '
                                         '"producers": {}}')
    caplog.set_level(logging.WARNING, logger="raymq.storage")
    with open_store(tmp_path) as store:  # checkpoint past the end: said loudly, then rescanned
        assert [m.body for m in store.read_queue("t", 0, 0, 1000)] == [body(i) for i in range(200)]
    assert "past the end of the data" in caplog.text
    os.unlink(tmp_path / "consumequeue" / "t" / "0")
    (tmp_path / "checkpoint").write_text("not json")
    with open_store(tmp_path) as store:
        assert [m.body for m in store.read_queue("t", 0, 0, 1000)] == [body(i) for i in range(200)]
    assert "unreadable" in caplog.text


def test_torn_tail_is_cut_and_logged(tmp_path, caplog):
    with open_store(tmp_path) as store:
        store.put(batch("t", 0, 0, 10))
        last = store.put(batch("t", 0, 10, 10))
    forget_checkpoint(tmp_path)
    seg = commitlog_files(tmp_path)[-1]
    size = os.path.getsize(seg)
    os.truncate(seg, size - 150)  # mid-record of the last frame
    caplog.set_level(logging.WARNING, logger="raymq.storage")
    with open_store(tmp_path) as store:
        assert store.max_queue_offset("t", 0) == 10  # the torn batch is gone, whole
        assert [m.body for m in store.read_queue("t", 0, 0, 100)] == [body(i) for i in range(10)]
        res = store.put(batch("t", 0, 99, 1))
        assert res.queue_offsets == [10]
        assert res.phys_offsets[0] == last.phys_offsets[0]  # written where the torn frame was
    assert "truncating torn tail" in caplog.text and seg in caplog.text


def test_flipped_byte_in_last_frame_is_a_corrupt_tail(tmp_path, caplog):
    with open_store(tmp_path) as store:
        store.put(batch("t", 0, 0, 10))
        res = store.put(batch("t", 0, 10, 10))
    forget_checkpoint(tmp_path)
    seg = commitlog_files(tmp_path)[-1]
    flip(seg, res.phys_offsets[5] + 100)
    caplog.set_level(logging.WARNING, logger="raymq.storage")
    with open_store(tmp_path) as store:
        assert store.max_queue_offset("t", 0) == 10
    assert "CRC mismatch" in caplog.text


def test_flipped_byte_in_the_middle_is_an_error_naming_file_and_offset(tmp_path):
    with open_store(tmp_path) as store:
        res = store.put(batch("t", 0, 0, 10))
        store.put(batch("t", 0, 10, 10))
    forget_checkpoint(tmp_path)  # older than the damage, so recovery scans it
    seg = commitlog_files(tmp_path)[-1]
    flip(seg, res.phys_offsets[3] + 90)
    with pytest.raises(CorruptLogError) as err:
        open_store(tmp_path)
    frame_pos = res.phys_offsets[0] - FRAME_HEADER_BYTES
    assert seg in str(err.value) and f"file offset {frame_pos}" in str(err.value)
    assert "CRC mismatch" in str(err.value)
    with open(seg, "rb") as f:  # and nothing was cut
        assert len(f.read()) > res.phys_offsets[-1]


def test_damaged_segment_header_is_an_error(tmp_path):
    with open_store(tmp_path) as store:
        store.put(batch("t", 0, 0, 10))
    seg = commitlog_files(tmp_path)[0]
    flip(seg, 2)
    with pytest.raises(CorruptLogError, match="bad segment header"):
        open_store(tmp_path)


def test_crash_after_segment_roll_with_empty_segment(tmp_path):
    cfg = SMALL
    with open_store(tmp_path, cfg) as store:
        store.put(batch("t", 0, 0, 1000))
    files = commitlog_files(tmp_path)
    # a crash right after creating the next segment file, before its header was written
    base = int(os.path.basename(files[-1])[:-4]) + cfg.segment_size_bytes
    open(os.path.join(tmp_path, "commitlog", segment_name(base)), "wb").close()
    with open_store(tmp_path, cfg) as store:
        store.put(batch("t", 0, 1000, 10))
        assert [m.body for m in store.read_queue("t", 0, 995, 20)] == [
            body(i) for i in range(995, 1010)]


def test_group_commit_shares_fsyncs(tmp_path):
    store = open_store(tmp_path, StoreConfig(flush_mode="sync"))
    barrier = threading.Barrier(8)
    errors = []

    def worker(k):
        try:
            barrier.wait()
            for i in range(50):
                r = store.put(RecordBatch("t", k, [body(i)]))
                assert r.status.name == "PUT_OK"
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.flushed_offset == store.max_phys_offset
    assert store.sync_count < 400  # 400 puts, fewer fsyncs
    for k in range(8):
        assert [m.body for m in store.read_queue("t", k, 0, 100)] == [body(i) for i in range(50)]
    store.close()


def test_async_mode_flushes_in_the_background(tmp_path):
    cfg = StoreConfig(flush_mode="async", flush_interval_ms=20)
    with MessageStore(str(tmp_path), cfg) as store:
        store.put(batch("t", 0, 0, 10))
        target = store.max_phys_offset
        wait_until(lambda: store.flushed_offset >= target)


def test_bad_input_is_rejected_and_nothing_is_written(tmp_path):
    with open_store(tmp_path) as store:
        store.put(batch("t", 0, 0, 1))
        end = store.max_phys_offset
        with pytest.raises(MessageTooLargeError, match="4097 bytes exceeds"):
            store.put([Record("t", 0, b"x" * 4097)])
        for topic in ("", "a/b", "..", "x" * 128, 5):
            with pytest.raises(InvalidMessageError, match="invalid topic"):
                store.put([Record(topic, 0, b"x")])
        with pytest.raises(InvalidMessageError, match="reserved separator"):
            store.put([Record("t", 0, b"x", properties={"a\x01": "b"})])
        with pytest.raises(InvalidMessageError, match="must be bytes"):
            store.put([Record("t", 0, "text")])
        with pytest.raises(InvalidMessageError, match="queue id"):
            store.put([Record("t", -1, b"x")])
        with pytest.raises(InvalidMessageError, match="longer than"):
            store.put([Record("t", 0, b"x", key="k" * 2000)])
        assert store.max_phys_offset == end
        assert store.max_queue_offset("t", 0) == 1
        assert store.put([]).phys_offsets == []


def test_config_is_validated():
    with pytest.raises(ConfigError, match="unknown StoreConfig key"):
        StoreConfig.from_dict({"segment_size": 10})
    with pytest.raises(ConfigError, match="flush_mode"):
        StoreConfig(flush_mode="sometimes")
    with pytest.raises(ConfigError, match="segment_size_bytes"):
        StoreConfig(segment_size_bytes=10)
    with pytest.raises(ConfigError, match="max_frame_bytes"):
        StoreConfig(max_message_bytes=16 * 1024 * 1024)
    assert StoreConfig.from_dict({"flush_mode": "async"}).flush_mode == "async"


def test_offset_store_round_trip_and_damage(tmp_path):
    path = str(tmp_path / "offsets.json")
    s = OffsetStore(path)
    assert s.get("g|t|0") == -1
    s.update({"g|t|0": 5, "g|t|1": 7})
    s.delete(["g|t|1"])
    assert OffsetStore(path).snapshot() == {"g|t|0": 5}
    data = open(path, "rb").read()
    assert b'"g|t|0": 5' in data
    open(path, "wb").write(data.replace(b'"g|t|0": 5', b'"g|t|0": 6'))
    with pytest.raises(CorruptLogError, match="offsets.json"):
        OffsetStore(path)


def test_stored_message_batch_views_agree(tmp_path):
    with open_store(tmp_path) as store:
        store.put(RecordBatch(["a", "b"], [0, 0], [b"1", b"2"], tags=["x", None],
                              properties=[{"p": "q"}, None]))
        store.put(RecordBatch("a", 0, [b"3"]))
        entries = np.concatenate([store.read_cq("a", 0, 0, 10), store.read_cq("b", 0, 0, 10)])
        mb = store.messages_at(entries)
        assert [m.body for m in mb] == [b"1", b"3", b"2"]
        assert [mb[i] for i in range(3)] == mb.messages()
        assert mb[0].properties == {"p": "q"} and mb[2].properties == {}
        assert mb[0].tags == "x" and mb[1].tags is None




def wait_until(cond, timeout_s: float = 10.0) -> None:
    ev = threading.Event()
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        ev.wait(0.005)


def test_idempotent_put_is_stored_once_and_remembered_across_restarts(tmp_path):
    pid = 0x1234_5678_9ABC
    with open_store(tmp_path) as store:
        first = store.put(batch("t", 0, 0, 5), producer_id=pid, sequence=1)
        again = store.put(batch("t", 0, 0, 5), producer_id=pid, sequence=1)
        assert not first.duplicate and again.duplicate
        assert again.queue_offsets == first.queue_offsets == [0, 1, 2, 3, 4]
        second = store.put(batch("t", 0, 5, 5), producer_id=pid, sequence=2)
        assert second.queue_offsets == [5, 6, 7, 8, 9]
        store.checkpoint()  # snapshot holds pid -> 2
        third = store.put(batch("t", 0, 10, 5), producer_id=pid, sequence=3)
    with open_store(tmp_path) as store:  # after a clean close: from the snapshot
        assert store.last_sequence(pid) == 3
        dup = store.put(batch("t", 0, 10, 5), producer_id=pid, sequence=3)
        assert dup.duplicate and dup.queue_offsets == []  # stored once, offsets not kept
    forget_checkpoint(tmp_path)  # after a crash: replayed from the log, offsets too
    with open_store(tmp_path) as store:
        dup = store.put(batch("t", 0, 10, 5), producer_id=pid, sequence=3)
        assert dup.duplicate and dup.queue_offsets == third.queue_offsets
        old = store.put(batch("t", 0, 0, 5), producer_id=pid, sequence=1)
        assert old.duplicate and old.queue_offsets == [0, 1, 2, 3, 4]  # among the last 8
        assert store.max_queue_offset("t", 0) == 15
        assert store.put(batch("t", 0, 15, 1), producer_id=pid + 1, sequence=1).queue_offsets == [15]
    forget_checkpoint(tmp_path)  # and from a full replay of the log
    with open_store(tmp_path) as store:
        assert store.last_sequence(pid) == 3 and store.last_sequence(pid + 1) == 1
    with open_store(tmp_path) as store:
        with pytest.raises(InvalidMessageError, match="producer id"):
            store.put(batch("t", 0, 0, 1), producer_id=-5, sequence=1)


def test_a_put_of_several_frames_is_all_or_nothing_after_a_crash(tmp_path, caplog):
    pid = 4242
    with open_store(tmp_path) as store:
        store.put(batch("t", 0, 0, 10))
        big = store.put(batch("t", 0, 10, 3000), producer_id=pid, sequence=1)  # ~5 frames
        assert len({p // SMALL.segment_size_bytes for p in big.phys_offsets}) >= 2
    forget_checkpoint(tmp_path)
    last_seg = commitlog_files(tmp_path)[-1]
    seg_base = int(os.path.basename(last_seg)[:-4])
    os.truncate(last_seg, big.phys_offsets[-1] - seg_base - 100)  # tear the LAST frame
    caplog.set_level(logging.WARNING, logger="raymq.storage")
    with open_store(tmp_path) as store:
        assert store.max_queue_offset("t", 0) == 10  # none of the big put, not just its tail
        assert store.last_sequence(pid) == 0  # and a retry of it will be stored
        again = store.put(batch("t", 0, 10, 3000), producer_id=pid, sequence=1)
        assert not again.duplicate and again.queue_offsets[0] == 10
        assert [m.body for m in store.read_queue("t", 0, 3005, 5)] == [
            body(i) for i in range(3005, 3010)]
    assert "the last put was cut short" in caplog.text


def test_a_failed_frame_encoding_writes_nothing(tmp_path):
    with open_store(tmp_path) as store:
        end = store.max_phys_offset
        recs = batch("t", 0, 0, 3000)
        recs.keys = [None] * 2999 + ["k" * 5000]  # the bad record is in the last frame
        with pytest.raises(InvalidMessageError, match="longer than"):
            store.put(recs)
        assert store.max_phys_offset == end and store.max_queue_offset("t", 0) == 0


def test_small_frame_encoder_writes_the_column_encoders_bytes(monkeypatch):
    """Frames of a few records are encoded with struct; they must be byte-identical."""
    import random

    from raymq.storage import records
    from raymq.storage.records import RecordBatch, encode_frame
    rng = random.Random(7)

    def maybe(make, n):
        return None if rng.random() < 0.4 else [make(i) for i in range(n)]
    for _ in range(300):
        n = rng.randint(1, records.SMALL_FRAME_RECORDS)
        shared = rng.random() < 0.5
        tags = maybe(lambda i: rng.choice([None, "", "a", "tag-ü"]), n)
        batch = RecordBatch(
            "orders" if shared else [rng.choice(["a", "bb", "ccc"]) for _ in range(n)],
            rng.randint(0, 9) if rng.random() < 0.5 else [rng.randint(0, 9) for _ in range(n)],
            [os.urandom(rng.randint(0, 300)) for _ in range(n)],
            keys=maybe(lambda i: rng.choice([None, "", f"k{i}", "ключ"]), n),
            tags=tags,
            properties=maybe(lambda i: rng.choice([None, {}, {"a": "1", "bé": "x" * i}]), n),
            flags=rng.choice([0, 3, [rng.randint(0, 64) for _ in range(n)]]),
            born_ms=rng.choice([0, 1_700_000_000_000]),
            reconsume=rng.choice([0, [rng.randint(0, 16) for _ in range(n)]]),
            prepared_offsets=rng.choice([-1, [rng.randint(-1, 10**9) for _ in range(n)]]),
            tag_codes=maybe(lambda i: rng.choice([None, rng.randint(1, 10**12)]), n))
        qoffs = np.arange(n, dtype=np.int64) + rng.randint(0, 10**6)
        pid, seq, last = rng.randint(0, 2**62), rng.randint(0, 2**40), rng.random() < 0.5
        small = encode_frame(batch, qoffs, 123456, producer_id=pid, sequence=seq, last=last)
        monkeypatch.setattr(records, "SMALL_FRAME_RECORDS", 0)
        column = encode_frame(batch, qoffs, 123456, producer_id=pid, sequence=seq, last=last)
        monkeypatch.setattr(records, "SMALL_FRAME_RECORDS", 16)
        assert b"".join(small.parts) == b"".join(column.parts)
        assert small.size == column.size
        for a, b in ((small.rel_offsets, column.rel_offsets), (small.rec_lens, column.rec_lens),
                     (small.tag_codes, column.tag_codes)):
            assert np.array_equal(a, b)
    # bad input is refused the same way on both paths
    for bad in (RecordBatch("t", 0, ["not bytes"]), RecordBatch("t", -1, [b"x"]),
                RecordBatch("t", 0, [b"x"], keys=[7])):
        with pytest.raises(Exception) as small_err:
            encode_frame(bad, np.zeros(1, np.int64), 1)
        monkeypatch.setattr(records, "SMALL_FRAME_RECORDS", 0)
        with pytest.raises(Exception) as column_err:
            encode_frame(bad, np.zeros(1, np.int64), 1)
        monkeypatch.setattr(records, "SMALL_FRAME_RECORDS", 16)
        assert type(small_err.value) is type(column_err.value)


def test_wait_durable_gives_a_duplicate_the_status_of_its_first_copy(tmp_path):
    from raymq.storage.store import PutResult, PutStatus
    with MessageStore(str(tmp_path), StoreConfig(flush_mode="sync")) as store:
        # a resend's result: its first copy's fsync was waited for, and timed out
        dup = PutResult(PutStatus.FLUSH_DISK_TIMEOUT, [], [], [], duplicate=True)
        assert store.wait_durable(dup) is PutStatus.FLUSH_DISK_TIMEOUT
        first = store.put(RecordBatch("t", 0, [b"x"]), producer_id=5, sequence=1)
        again = store.put(RecordBatch("t", 0, [b"x"]), producer_id=5, sequence=1, wait=False)
        assert again.duplicate and store.wait_durable(again) is first.status is PutStatus.PUT_OK


def test_a_disk_slower_than_flush_timeout_answers_flush_disk_timeout_and_keeps_the_data(
        tmp_path, monkeypatch):
    """``flush_timeout_ms`` for real: the disk's fsync is held (a gate in front of the
    system call); a put waiting for another's fsync gives up at its deadline, and the put
    doing the fsync reports it too late.  Both are stored, and durable once the disk is."""
    from raymq.storage.store import PutStatus
    entered, gate = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_disk(fd):
        entered.set()
        assert gate.wait(30)
        real_fsync(fd)
    store = MessageStore(str(tmp_path), StoreConfig(flush_mode="sync", flush_timeout_ms=200),
                         background=False)
    try:
        store.put(RecordBatch("t", 0, [b"zero"]))  # (its queue file exists: no directory fsync)
        monkeypatch.setattr(os, "fsync", slow_disk)
        outcomes = {}
        syncing = threading.Thread(daemon=True, target=lambda: outcomes.update(
            first=store.put(RecordBatch("t", 0, [b"first"]))))
        syncing.start()
        assert entered.wait(30)  # the first put's fsync is at the disk
        t0 = time.monotonic()
        waiting = store.put(RecordBatch("t", 0, [b"second"]))  # waits for an fsync
        waited_s = time.monotonic() - t0
        assert waiting.status is PutStatus.FLUSH_DISK_TIMEOUT
        assert 0.15 <= waited_s < 5  # at its deadline, not when the disk answered
        assert syncing.is_alive()  # the disk has still not answered
        gate.set()
        syncing.join(30)
        assert outcomes["first"].status is PutStatus.FLUSH_DISK_TIMEOUT  # done too late
        monkeypatch.setattr(os, "fsync", real_fsync)
        assert store.put(RecordBatch("t", 0, [b"third"])).status is PutStatus.PUT_OK
    finally:
        gate.set()
        store.close()
    with MessageStore(str(tmp_path), StoreConfig(flush_mode="sync")) as again:
        assert [m.body for m in again.read_queue("t", 0, 0, 10)] == [
            b"zero", b"first", b"second", b"third"]


def test_a_put_indexed_only_in_part_stops_the_store_and_a_restart_stores_it_once(
        tmp_path, monkeypatch):
    import errno

    from raymq.storage import consumequeue
    from raymq.storage.errors import StorageError
    store = MessageStore(str(tmp_path), StoreConfig(flush_mode="sync"), background=False)
    records = [Record("A", 0, b"a1"), Record("B", 0, b"b1")]
    append = consumequeue.ConsumeQueue.append

    def disk_full_under_b(cq, entries, last_phys):
        if cq.topic == "B":
            raise OSError(errno.ENOSPC, "No space left on device")
        return append(cq, entries, last_phys)
    monkeypatch.setattr(consumequeue.ConsumeQueue, "append", disk_full_under_b)
    with pytest.raises(OSError, match="No space"):
        store.put(records, producer_id=7, sequence=1)  # in the log, indexed under A only
    monkeypatch.setattr(consumequeue.ConsumeQueue, "append", append)
    with pytest.raises(StorageError, match="restart"):  # the resend is not stored again
        store.put(records, producer_id=7, sequence=1)
    store.close()
    with MessageStore(str(tmp_path), StoreConfig(flush_mode="sync"), background=False) as store:
        again = store.put(records, producer_id=7, sequence=1)
        from raymq.storage.store import PutStatus
        assert again.duplicate and again.status is PutStatus.PUT_OK
        assert [m.body for m in store.read_queue("A", 0, 0, 10)] == [b"a1"]
        assert [m.body for m in store.read_queue("B", 0, 0, 10)] == [b"b1"]


def test_a_failed_fsync_stops_the_store_instead_of_acknowledging_a_resend(tmp_path, monkeypatch):
    import errno

    from raymq.storage import commitlog
    from raymq.storage.errors import StorageError
    store = MessageStore(str(tmp_path), StoreConfig(flush_mode="sync"), background=False)
    store.put([Record("T", 0, b"first")])
    log_fd, real_fsync, failed = store._log._segments[-1].fd, os.fsync, []

    def fsync_fails_once(fd):
        if fd == log_fd and not failed:  # Linux may now drop the unwritten pages and
            failed.append(fd)            # report success next time
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)
    monkeypatch.setattr(commitlog.os, "fsync", fsync_fails_once)
    with pytest.raises(OSError, match="Input/output"):
        store.put([Record("T", 0, b"x")], producer_id=9, sequence=1)
    with pytest.raises(StorageError, match="restart"):  # not acknowledged by the next fsync
        store.put([Record("T", 0, b"x")], producer_id=9, sequence=1)
    with pytest.raises(StorageError, match="restart"):
        store.put([Record("T", 0, b"y")], producer_id=9, sequence=2)
    monkeypatch.setattr(commitlog.os, "fsync", real_fsync)
    store.close()


def test_producer_sequences_come_back_as_the_log_holds_them_when_its_tail_is_lost(tmp_path):
    """A checkpoint past the end of the log (flushed data gone) must not restore its
    snapshot: the sequences it claims are no longer in the log.  The delay scheduler and
    dead-letter resends keep their progress as such sequences, and would skip."""
    internal = (1 << 62) + 1
    with open_store(tmp_path) as store:
        for seq in range(1, 4):
            store.put(batch("t", 0, seq * 10, 2), producer_id=internal, sequence=seq)
        store.checkpoint()
        keep = store.max_phys_offset
        for seq in range(4, 11):
            store.put(batch("t", 0, seq * 10, 2), producer_id=internal, sequence=seq)
        store.put(batch("t", 0, 500, 2), producer_id=77, sequence=1)
    seg = commitlog_files(tmp_path)[-1]
    os.truncate(seg, keep - int(os.path.basename(seg).split(".")[0]))  # the tail is lost
    with open_store(tmp_path) as store:
        assert store.last_sequence(internal) == 3 and store.last_sequence(77) == 0
        assert store.max_queue_offset("t", 0) == 6
        again = store.put(batch("t", 0, 40, 2), producer_id=internal, sequence=4)
        assert not again.duplicate  # stored, not taken for a resend of a lost put
    # a checkpoint without its producer table is unreadable: rebuilt from the log
    doc = json.loads((tmp_path / "checkpoint").read_text())
    del doc["producers"]
    (tmp_path / "checkpoint").write_text(json.dumps(doc))
    with open_store(tmp_path) as store:
        assert store.last_sequence(internal) == 4


def _fail_fsyncs_of_the_log(monkeypatch, store, when):
    import errno

    from raymq.storage import commitlog
    real_fsync = os.fsync

    def fsync(fd):
        if when(fd):
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)
    monkeypatch.setattr(commitlog.os, "fsync", fsync)
    return real_fsync


def test_no_checkpoint_is_written_after_a_failed_fsync(tmp_path, monkeypatch):
    """Linux may drop the pages an fsync failed to write and report the next fsync a
    success: a checkpoint then would claim (and a restart trust) puts not on disk."""
    from raymq.storage.errors import StorageError
    store = MessageStore(str(tmp_path), StoreConfig(flush_mode="sync"), background=False)
    store.put([Record("T", 0, b"first")], producer_id=9, sequence=1)
    store.checkpoint()
    before = (tmp_path / "checkpoint").read_bytes()
    failed = []
    log_fd = store._log._segments[-1].fd
    _fail_fsyncs_of_the_log(monkeypatch, store,
                            lambda fd: fd == log_fd and not failed and not failed.append(fd))
    with pytest.raises(OSError, match="Input/output"):
        store.put([Record("T", 0, b"lost?")], producer_id=9, sequence=2)
    with pytest.raises(StorageError, match="restart"):
        store.put([Record("T", 0, b"x")], producer_id=9, sequence=3)
    store.checkpoint()
    store.close()
    assert (tmp_path / "checkpoint").read_bytes() == before  # the last good one stays


def test_a_failed_fsync_sealing_a_full_segment_stops_the_store(tmp_path, monkeypatch):
    from raymq.storage.errors import StorageError
    cfg = StoreConfig(segment_size_bytes=256 * 1024, max_message_bytes=4096,
                      max_frame_bytes=4096 + 128 * 1024, flush_mode="async")
    store = MessageStore(str(tmp_path), cfg, background=False)
    armed = []
    _fail_fsyncs_of_the_log(monkeypatch, store, lambda fd: bool(armed) and armed.pop())
    seq = 0
    with pytest.raises(OSError, match="Input/output"):
        while seq < 100:  # fill the segment; the put that starts the next one seals it
            seq += 1
            armed[:] = [True] if store.max_phys_offset + 40_000 > 256 * 1024 else []
            store.put(batch("t", 0, seq * 30, 30, size=1000), producer_id=9, sequence=seq)
    with pytest.raises(StorageError, match="restart"):  # not accepted as if all was well
        store.put(batch("t", 0, 0, 1), producer_id=9, sequence=seq + 1)
    store.close()


def test_a_write_that_left_nothing_on_disk_does_not_stop_the_store(tmp_path, monkeypatch):
    """A full disk refusing the whole write (nothing written): the put fails, the log is
    intact, and the store goes on once there is room again."""
    import errno

    from raymq.storage import commitlog
    store = MessageStore(str(tmp_path), StoreConfig(flush_mode="sync"), background=False)
    store.put([Record("T", 0, b"first")], producer_id=9, sequence=1)
    end, real_pwritev, refused = store.max_phys_offset, os.pwritev, []

    def pwritev(fd, parts, offset):
        if not refused:
            refused.append(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, parts, offset)
    monkeypatch.setattr(commitlog.os, "pwritev", pwritev)
    with pytest.raises(OSError, match="No space"):
        store.put([Record("T", 0, b"second")], producer_id=9, sequence=2)
    assert store.max_phys_offset == end
    assert not store.put([Record("T", 0, b"second")], producer_id=9, sequence=2).duplicate
    assert [m.body for m in store.read_queue("T", 0, 0, 10)] == [b"first", b"second"]
    store.close()


def test_a_resend_no_longer_remembered_is_acknowledged_only_once_durable(tmp_path):
    with MessageStore(str(tmp_path), StoreConfig(flush_mode="sync"), background=False) as store:
        first = store.put([Record("T", 0, b"x0")], producer_id=9, sequence=1, wait=False)
        for seq in range(2, 20):  # later puts push the first out of the producer's results
            store.put([Record("T", 0, b"x%d" % seq)], producer_id=9, sequence=seq, wait=False)
        assert store._log.flushed_offset < first.end_offset  # nothing flushed yet
        again = store.put([Record("T", 0, b"x0")], producer_id=9, sequence=1)
        assert again.duplicate and again.phys_offsets == []  # offsets forgotten ...
        assert store._log.flushed_offset >= first.end_offset  # ... but durable before the ack
