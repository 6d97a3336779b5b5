"""A read of one queue reads only its records' ranges of the log (issue 37: a Spark read
task's pull read the whole stretch of the log, the other queues' records between its own
included, and copied its own out again).  No Ray."""
from __future__ import annotations

from raymq.storage import Record
from tests.helpers import SMALL, open_store


def test_a_read_of_one_queue_reads_none_of_the_other_queues_bodies(tmp_path):
    with open_store(tmp_path, SMALL) as store:
        for k in range(20):  # frames holding a block of each queue's records
            store.put([Record("t", 0, b"mine-%04d-" % (k * 10 + i) + bytes(300))
                       for i in range(10)]
                      + [Record("t", 1, b"other-%04d" % (k * 20 + i) + b"x" * 3900)
                         for i in range(20)])  # (80 KB between two frames' blocks)
        entries = store.read_cq("t", 0, 0, 1000)
        spans = store.records_at(entries)
        assert [m.body for m in spans.decode().messages()] == [
            b"mine-%04d-" % i + bytes(300) for i in range(200)]
        buf = bytes(spans.buf)
        assert b"other-" not in buf  # (the other queue's bodies were not read)
        span = int(entries["phys"][-1] + entries["size"][-1] - entries["phys"][0])
        assert len(buf) < span / 2
        # out of log order, and one at a time, the same records
        back = store.records_at(entries[::-1])
        assert [m.body for m in back.decode().messages()] == [
            b"mine-%04d-" % i + bytes(300) for i in reversed(range(200))]
        assert [m.body for m in store.records_at(entries[7:8]).decode().messages()] == [
            b"mine-0007-" + bytes(300)]
        assert len(store.records_at(entries[:0])) == 0


def test_a_big_read_fills_memory_it_need_not_zero_first_and_travels_either_way(tmp_path):
    """A read of megabytes (a Spark read task's pull) goes into ``fresh_buffer`` (huge
    pages, not zero-filled first: zeroing a fresh ``bytearray`` was a third of a shard's
    time serving such pulls); its records are the same, decoded or pickled in or out of
    band."""
    import pickle

    from raymq.storage.buffers import HUGE_PAGE_BYTES
    with open_store(tmp_path, SMALL) as store:
        bodies = [b"%06d" % i + bytes(4090) for i in range(800)]  # (3.2 MB)
        for lo in range(0, 800, 100):
            store.put([Record("t", 0, b) for b in bodies[lo:lo + 100]])
        spans = store.records_at(store.read_cq("t", 0, 0, 1000))
        assert len(spans.buf) > HUGE_PAGE_BYTES and not isinstance(spans.buf, bytearray)
        assert [m.body for m in spans.decode().messages()] == bodies
        for protocol in (4, 5):
            again = pickle.loads(pickle.dumps(spans, protocol=protocol))
            assert [m.body for m in again.decode().messages()] == bodies
        small = store.records_at(store.read_cq("t", 0, 0, 3))  # (a small read: as before)
        assert isinstance(small.buf, bytearray)
