"""Consume queues under faults: a failed fsync, lost pages past the checkpoint, and more
queues than open files allowed."""
from __future__ import annotations

import contextlib
import errno
import os

import numpy as np
import pytest

from raymq.storage import RecordBatch, StoreConfig
from raymq.storage.consumequeue import CQ_ENTRY_BYTES
from tests.helpers import ROOT, batch, body, open_store
from tests.helpers import queue_bodies as bodies


def fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


# --------------------------------------------------------------- finding 2
def test_a_failed_consume_queue_fsync_never_lets_a_checkpoint_claim_its_entries(
        tmp_path, monkeypatch):
    """Linux may drop the pages an fsync failed to write and report the next fsync a
    success: after a failed fsync of a consume queue no checkpoint may claim its entries
    (until a restart re-indexes them from the commit log)."""
    store = open_store(tmp_path)
    store.put(batch("t", 0, 0, 10))
    store.checkpoint()
    good = (tmp_path / "checkpoint").read_bytes()
    store.put(batch("t", 0, 10, 10))
    real_fsync, failed = os.fsync, []

    def fsync(fd):
        if "consumequeue" in fd_path(fd) and not failed:
            failed.append(fd)
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="Input/output"):
        store.checkpoint()
    assert failed and (tmp_path / "checkpoint").read_bytes() == good
    assert store._cq.queues[("t", 0)].dirty  # not forgotten
    store.put(batch("t", 0, 20, 5))  # the store goes on: the commit log is fine
    store.checkpoint()  # this fsync would "succeed"
    assert (tmp_path / "checkpoint").read_bytes() == good
    store.close()
    assert (tmp_path / "checkpoint").read_bytes() == good
    monkeypatch.setattr(os, "fsync", real_fsync)
    with open_store(tmp_path) as store:  # recovery starts from the last good checkpoint
        assert store.recovered_records == 15
        assert bodies(store, "t", 0) == [body(i) for i in range(25)]


# --------------------------------------------------------------- finding 3
def _store_with_entries_past_its_checkpoint(tmp_path) -> None:
    """t/0: 100 records under the checkpoint, 400 past it; u/0: 30 records, all under it.
    The process died before checkpointing again (the old checkpoint is put back)."""
    with open_store(tmp_path) as store:
        store.put(batch("u", 0, 0, 30))
        store.put(batch("t", 0, 0, 100))
        store.checkpoint()
        old = (tmp_path / "checkpoint").read_bytes()
        for start in range(100, 500, 50):
            store.put(batch("t", 0, start, 50))
    (tmp_path / "checkpoint").write_bytes(old)


def test_a_lost_page_inside_the_entries_past_the_checkpoint_is_re_indexed(tmp_path):
    """A page of a consume queue lost in a power cut reads as zeros while the file keeps
    its size and its last entry: recovery must not keep the zeroed entries (a reader of
    them would fail at every try: its consumer stuck for ever)."""
    _store_with_entries_past_its_checkpoint(tmp_path)
    path = tmp_path / "consumequeue" / "t" / "0"
    assert os.path.getsize(path) == 500 * CQ_ENTRY_BYTES
    with open(path, "r+b") as f:  # the second 4 KiB page: entries 204..409, past the checkpoint
        f.seek(4096)
        f.write(bytes(4096))
    with open_store(tmp_path) as store:
        assert bodies(store, "t", 0) == [body(i) for i in range(500)]
        assert bodies(store, "u", 0) == [body(i) for i in range(30)]
        assert store.put(batch("t", 0, 500, 1)).queue_offsets == [500]


@pytest.mark.parametrize("queue", ["t", "u"])  # with records past the checkpoint, without
def test_zeroed_entries_after_the_last_one_are_dropped(tmp_path, queue):
    _store_with_entries_past_its_checkpoint(tmp_path)
    path = tmp_path / "consumequeue" / queue / "0"
    os.truncate(path, os.path.getsize(path) + 40 * CQ_ENTRY_BYTES)  # size kept, data lost
    with open_store(tmp_path) as store:
        assert store.max_queue_offset("t", 0) == 500 and store.max_queue_offset("u", 0) == 30
        assert bodies(store, "t", 0) == [body(i) for i in range(500)]
        assert bodies(store, "u", 0) == [body(i) for i in range(30)]
        assert store.put(batch(queue, 0, 0, 1)).queue_offsets == [500 if queue == "t" else 30]


def test_entries_past_the_checkpoint_are_checked_against_the_log_not_trusted(tmp_path):
    """Entries past the checkpoint that point to the wrong records are re-indexed too."""
    _store_with_entries_past_its_checkpoint(tmp_path)
    path = tmp_path / "consumequeue" / "t" / "0"
    entries = np.fromfile(path, dtype=[("phys", "<i8"), ("size", "<i4"), ("tag", "<i8")])
    entries[300] = entries[299]  # a plausible entry, but of another record
    entries.tofile(path)
    with open_store(tmp_path) as store:
        assert bodies(store, "t", 0) == [body(i) for i in range(500)]


# --------------------------------------------------------------- finding 5
def open_queue_files(directory) -> int:
    root = os.path.join(str(directory), "consumequeue") + os.sep
    return sum(1 for fd in os.listdir("/proc/self/fd") if fd_path(int(fd)).startswith(root))


def test_more_queues_than_open_files_allowed_work_within_the_limit(tmp_path):
    cfg = StoreConfig(segment_size_bytes=256 * 1024, max_message_bytes=4096,
                      max_frame_bytes=4096 + 128 * 1024, max_open_queue_files=4)
    queues = [(f"t{k % 5}", k // 5) for k in range(23)]
    expected = {q: [] for q in queues}
    with open_store(tmp_path, cfg) as store:
        for rnd in range(3):
            for k, (topic, qid) in enumerate(queues):  # one queue at a time, round robin
                b = [f"{topic}/{qid}/{rnd}".encode()]
                store.put(RecordBatch(topic, qid, b))
                expected[(topic, qid)] += b
                assert open_queue_files(tmp_path) <= 4
            many = RecordBatch([t for t, _ in queues], [q for _, q in queues],  # all in one put
                               [b"m%d" % k for k in range(len(queues))])
            store.put(many)
            for k, q in enumerate(queues):
                expected[q].append(b"m%d" % k)
            assert open_queue_files(tmp_path) <= 4
            if rnd == 1:
                store.checkpoint()
        assert {q: bodies(store, *q) for q in queues} == expected
        assert open_queue_files(tmp_path) <= 4
    assert open_queue_files(tmp_path) == 0
    with open_store(tmp_path, cfg) as store:
        assert open_queue_files(tmp_path) <= 4
        assert {q: bodies(store, *q) for q in queues} == expected
        store.put(RecordBatch("t0", 0, [b"after"]))
        assert bodies(store, "t0", 0)[-1] == b"after"
        assert open_queue_files(tmp_path) <= 4


def test_a_store_opens_with_more_queues_than_the_process_may_open_files(tmp_path):
    """EMFILE at start failed the shard on every restart: a process limit below the
    number of queues (and the default max_open_queue_files) still opens and works."""
    import subprocess
    import sys
    with open_store(tmp_path) as store:
        for k in range(150):
            store.put(RecordBatch(f"q{k}", 0, [b"x%d" % k]))
    script = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from raymq.storage import MessageStore
from tests.helpers import SMALL
with MessageStore({str(tmp_path)!r}, SMALL, background=False) as store:
    got = [store.read_queue(f"q{{k}}", 0, 0, 1)[0].body for k in range(150)]
    assert got == [b"x%d" % k for k in range(150)], got
    for k in range(150):
        store.put(__import__("raymq.storage").storage.RecordBatch(f"q{{k}}", 0, [b"y"]))
print("OK")
"""
    root = ROOT
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@contextlib.contextmanager
def readers_running(check_once, n: int = 2):
    """``n`` threads calling ``check_once(rng)`` until the block ends; yields the list of
    what they raised (checked by the caller after the block)."""
    import random
    import threading
    errors, done = [], threading.Event()

    def read(seed):
        rng = random.Random(seed)
        try:
            while not done.is_set():
                check_once(rng)
        except BaseException as err:
            errors.append(err)
    readers = [threading.Thread(target=read, args=(s,)) for s in range(n)]
    for t in readers:
        t.start()
    try:
        yield errors
    finally:
        done.set()
        for t in readers:
            t.join()


def test_readers_and_a_writer_share_few_open_files_without_reading_the_wrong_one(tmp_path):
    """With more queues than open files, reads in other threads reopen files while the
    writer's files are closed for room: nobody may read or write through a descriptor
    closed (and reused) under it."""
    cfg = StoreConfig(segment_size_bytes=256 * 1024, max_message_bytes=4096,
                      max_frame_bytes=4096 + 128 * 1024, max_open_queue_files=2,
                      flush_mode="async")
    queues = [(f"q{k}", 0) for k in range(6)]
    with open_store(tmp_path, cfg) as store:
        def read(rng):
            topic, qid = rng.choice(queues)
            got = bodies(store, topic, qid)
            assert got == [f"{topic}-{i}".encode() for i in range(len(got))], got[:3]
        with readers_running(read) as errors:
            for i in range(80):
                for topic, qid in queues:
                    store.put(RecordBatch(topic, qid, [f"{topic}-{i}".encode()]))
                if i % 30 == 29:
                    store.checkpoint()
        assert errors == []
        assert all(bodies(store, *q) == [f"{q[0]}-{i}".encode() for i in range(80)]
                   for q in queues)
        assert store._cq.files.open_count <= 2


def open_segments(directory) -> int:
    root = os.path.join(str(directory), "commitlog") + os.sep
    return sum(1 for fd in os.listdir("/proc/self/fd") if fd_path(int(fd)).startswith(root))


def test_a_long_log_keeps_few_segments_open_and_reads_every_one(tmp_path):
    """Every segment kept a descriptor for ever (a 1 TB log of 64 MiB segments: 16,000):
    now the written segment and at most ``max_open_segments`` sealed ones are open, and
    readers in other threads reopen what they need while the writer seals more."""
    cfg = StoreConfig(segment_size_bytes=256 * 1024, max_message_bytes=4096,
                      max_frame_bytes=4096 + 128 * 1024, max_open_segments=2, flush_mode="async")
    N = 2000
    with open_store(tmp_path, cfg) as store:
        def read(rng):  # random old messages: reopened segments, the right bytes
            n = store.max_queue_offset("t", 0)
            if n:
                k = rng.randrange(n)
                [m] = store.read_queue("t", 0, k, 1)
                assert m.body == body(k, 3000), k
        with readers_running(read) as errors:
            for k in range(N):  # ~6 MB: ~23 segments
                store.put(RecordBatch("t", 0, [body(k, 3000)]))
                assert open_segments(tmp_path) <= 3
        assert errors == []
        assert len(store._log.segments()) >= 15
        assert [m.body for m in store.read_queue("t", 0, 0, N)] == [body(k, 3000)
                                                                      for k in range(N)]
        assert open_segments(tmp_path) <= 3
    assert open_segments(tmp_path) == 0
    with open_store(tmp_path, cfg) as store:  # recovery opens every segment once, keeps 3
        assert open_segments(tmp_path) <= 3
        assert [m.body for m in store.read_queue("t", 0, 0, N)] == [body(k, 3000)
                                                                      for k in range(N)]


@pytest.mark.parametrize("big_queue_ids", [False, True])
def test_a_frames_records_are_grouped_by_queue_in_the_order_each_queue_first_comes(big_queue_ids):
    """(How a follower, a restart and retention tell a frame's queues: one sorted pass over
    an integer a queue, or by rows where a queue id does not fit in one.)"""
    import numpy as np
    from raymq.storage.recovery import _queues_of
    rng = np.random.default_rng(7)
    h = np.zeros(300, dtype=[("meta_off", "<u4"), ("topic_len", "<u2"), ("queue_id", "<u4")])
    topics = [(100, 5), (200, 11), (300, 5)]
    pick = rng.integers(0, len(topics), len(h))
    h["meta_off"] = [topics[k][0] for k in pick]
    h["topic_len"] = [topics[k][1] for k in pick]
    h["queue_id"] = rng.integers(0, 4, len(h)) + ((1 << 21) if big_queue_ids else 0)
    want: dict[tuple, list[int]] = {}
    for k, row in enumerate(h):
        want.setdefault((int(row["meta_off"]), int(row["topic_len"]), int(row["queue_id"])),
                        []).append(k)
    got = _queues_of(h)
    assert [key for key, _idx in got] == list(want)
    assert [list(idx) for _key, idx in got] == list(want.values())
    one = h[:1].repeat(5)  # (a batch to one queue: the common case)
    first = (int(h["meta_off"][0]), int(h["topic_len"][0]), int(h["queue_id"][0]))
    assert [(key, list(idx)) for key, idx in _queues_of(one)] == [(first, [0, 1, 2, 3, 4])]
