"""Kafka record batches <-> RayMQ batches (``raymq.wire.records``): every compression a
Kafka client may use, binary keys and repeated headers, a corrupt batch refused.  No
Ray, no sockets."""
from __future__ import annotations

import numpy as np
import pytest
from kafka.record import MemoryRecordsBuilder

from raymq.storage.records import StoredMessage
from raymq.wire.records import BadRecords, from_messages, to_batch

CODECS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}


def kafka_batch(codec: int, n: int = 5) -> bytes:
    b = MemoryRecordsBuilder(magic=2, compression_type=codec, batch_size=1 << 20)
    for i in range(n):
        b.append(1_700_000_000_000 + i, b"\xff%d" % i if i % 2 else b"key%d" % i,
                 b"value %d" % i * 20, [("h", b"%d" % i), ("h", b"again")])
    b.close()
    return bytes(b.buffer())


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_batch_of_each_compression_becomes_messages_and_comes_back_the_same(codec):
    batch, _writer = to_batch("t", 3, kafka_batch(CODECS[codec]))
    assert batch.topics == "t" and batch.queue_ids == 3 and len(batch.bodies) == 5
    assert batch.bodies[1] == b"value 1" * 20 and batch.born_ms[4] == 1_700_000_000_004
    stored = [StoredMessage("t", 3, 10 + i, 0, 0, 0, batch.born_ms[i], 0, -1, 0, 0,
                            batch.keys[i], None, {}, batch.bodies[i], batch.headers[i])
              for i in range(5)]
    from kafka.record import MemoryRecords
    back = MemoryRecords(from_messages(stored))
    records = [r for b in iter(back.next_batch, None) for r in b]
    assert [r.offset for r in records] == [10, 11, 12, 13, 14]
    assert [r.key for r in records] == [b"key0", b"\xff1", b"key2", b"\xff3", b"key4"]
    assert records[3].headers == [("h", b"3"), ("h", b"again")]


def test_a_corrupt_or_empty_batch_is_refused_in_one_line():
    raw = bytearray(kafka_batch(0))
    raw[-3] ^= 0xFF  # (a byte of the last record: the CRC no longer matches)
    with pytest.raises(BadRecords, match="CRC"):
        to_batch("t", 0, bytes(raw))
    with pytest.raises(BadRecords):
        to_batch("t", 0, b"\x00" * 7)
    with pytest.raises(BadRecords, match="no record"):
        to_batch("t", 0, b"")


def test_sequences_take_batches_in_order_know_a_resend_and_refuse_a_gap():
    from raymq.storage.producers import INTERNAL_PRODUCER_BASE
    from raymq.wire.records import Producer
    from raymq.wire.sequences import OUT_OF_ORDER, Sequences
    seqs = Sequences(remembered=2)
    assert seqs.check(Producer(), "t", 0) == (0, 0)           # not idempotent
    pid, seq = seqs.check(Producer(7, 0, 0, 3), "t", 0)
    assert 0 < pid < INTERNAL_PRODUCER_BASE and seq == 3       # the put's sequence: past it
    seqs.stored(pid, seq)
    assert seqs.check(Producer(7, 0, 0, 3), "t", 0) == (pid, 3)  # a resend: the shard knows it
    assert seqs.check(Producer(7, 0, 5, 1), "t", 0)[1] == OUT_OF_ORDER
    assert seqs.check(Producer(7, 0, 3, 2), "t", 0) == (pid, 5)
    assert seqs.check(Producer(7, 0, 0, 1), "t", 1)[0] != pid  # each partition its own
    seqs.stored(seqs.check(Producer(8, 0, 0, 1), "t", 0)[0], 1)
    seqs.stored(seqs.check(Producer(9, 0, 0, 1), "t", 0)[0], 1)
    assert seqs.check(Producer(7, 0, 9, 1), "t", 0)[1] != OUT_OF_ORDER  # (forgotten: bounded)


def test_a_batch_whose_records_lie_about_their_size_is_refused_even_with_a_good_crc():
    """(The records are read in one pass by hand: a record length, a count or a varint
    that does not hold is refused, never read past.)"""
    import struct
    from crc32c import crc32c

    def recrc(raw: bytearray) -> bytes:
        struct.pack_into(">I", raw, 17, crc32c(bytes(raw[21:])))
        return bytes(raw)
    good = kafka_batch(0)
    assert len(to_batch("t", 0, good + good)[0].bodies) == 10  # (two batches: both read)
    count_off = 57  # (the header's record count)
    for lie in (4, 6, 10_000):
        raw = bytearray(good)
        struct.pack_into(">i", raw, count_off, lie)
        with pytest.raises(BadRecords):
            to_batch("t", 0, recrc(raw))
    raw = bytearray(good)
    raw[61] += 2  # (the first record's length, a varint: two bytes more than it has)
    with pytest.raises(BadRecords):
        to_batch("t", 0, recrc(raw))
    with pytest.raises(BadRecords):
        to_batch("t", 0, good[:-5])  # (cut short: the header's length says more)


def test_records_read_as_spans_become_the_batch_kafka_clients_read(tmp_path):
    """A Fetch's records straight from the log (no object per message): offsets with a gap,
    keys and none, long bodies, born times out of order; records a Kafka client wrote
    with headers or a binary key (their properties) the same through the slower path."""
    import os
    import pickle
    from kafka.record import MemoryRecords
    from raymq.storage import RecordBatch
    from raymq.wire.records import from_spans
    from tests.helpers import open_shard
    sh = open_shard(tmp_path, [("t", 0), ("u", 0)])
    try:
        bodies = [os.urandom(k * 37 % 300) for k in range(40)] + [os.urandom(20_000)]
        keys = [None if k % 3 else f"key-{k}" for k in range(41)]
        born = [1_700_000_000_000 + (k * 7919) % 1000 - 500 for k in range(41)]
        sh.send(RecordBatch("t", 0, bodies, keys=keys, born_ms=born))
        [(_t, _q, spans, _n, _e)] = sh.pull([("t", 0, 3, 100)], form="spans")
        spans = pickle.loads(pickle.dumps(spans, 5))  # (as the channel carries it)
        keep = np.ones(len(spans), bool)
        keep[[4, 5, 20]] = False  # (left out: as aborted records or markers are)
        spans = spans.select(keep)
        batches = list(iter(MemoryRecords(from_spans(spans)).next_batch, None))
        assert len(batches) == 1 and batches[0].validate_crc()
        records = list(batches[0])
        want = [k for k in range(3, 41) if k - 3 not in (4, 5, 20)]
        assert [r.offset for r in records] == want
        assert [r.value for r in records] == [bodies[k] for k in want]
        assert [r.key for r in records] == [None if keys[k] is None else keys[k].encode()
                                            for k in want]
        assert [r.timestamp for r in records] == [born[k] for k in want]
        assert all(r.headers == [] for r in records)
        kafka_written, _w = to_batch("u", 0, kafka_batch(0))
        sh.send(kafka_written)
        [(_t, _q, spans, _n, _e)] = sh.pull([("u", 0, 0, 100)], form="spans")
        [batch] = list(iter(MemoryRecords(from_spans(spans)).next_batch, None))
        back = list(batch)
        assert back[3].headers == [("h", b"3"), ("h", b"again")]
        assert [r.key for r in back][:2] == [b"key0", b"\xff1"]
        assert from_spans(spans.select(np.zeros(len(spans), bool))) == b""
    finally:
        sh.close()


def test_a_bumped_epoch_or_a_wrapped_sequence_is_never_taken_for_a_resend():
    """Kafka's sequences start again at 0 with a new producer epoch (KIP-360) and wrap past
    2^31 - 1: either must give a put sequence the shard has not stored yet (else it would
    answer a new batch as a resend of an old one, and drop it)."""
    from raymq.wire.records import Producer
    from raymq.wire.sequences import OUT_OF_ORDER, Sequences
    seqs = Sequences()
    pid, seq = seqs.check(Producer(7, 0, 0, 10), "t", 0)
    seqs.stored(pid, seq)
    bumped, again = seqs.check(Producer(7, 1, 0, 10), "t", 0)  # (epoch 1: from 0 again)
    assert bumped != pid and again == 10
    top = (1 << 31) - 5
    pid, seq = seqs.check(Producer(9, 0, top, 5), "t", 0)  # (the last five of the space)
    seqs.stored(pid, seq)
    wrapped, put = seqs.check(Producer(9, 0, 0, 3), "t", 0)  # (then 0, 1, 2)
    assert wrapped == pid and put == seq + 3  # (past what was stored: a new put)
    seqs.stored(wrapped, put)
    assert seqs.check(Producer(9, 0, 0, 3), "t", 0) == (pid, put)  # (a resend of it)
    assert seqs.check(Producer(9, 0, 7, 1), "t", 0)[1] == OUT_OF_ORDER  # (a gap)


def test_a_record_stored_by_the_earlier_version_reads_with_its_binary_key_and_headers():
    """Before the storage format had binary keys and headers, a Kafka client's were kept
    as properties: such a record reads as it was sent."""
    from kafka.record import MemoryRecords
    from raymq.wire.records import HEADERS_PROP, KEY_PROP
    legacy = StoredMessage("t", 0, 7, 0, 0, 0, 1_700_000_000_000, 0, -1, 0, 0, None, None,
                           {KEY_PROP: "//4w", HEADERS_PROP: '[["h", "MQ=="], ["n", null]]'},
                           b"value")
    [r] = list(MemoryRecords(from_messages([legacy])).next_batch())
    assert (r.offset, r.key, r.value) == (7, b"\xff\xfe0", b"value")
    assert list(r.headers) == [("h", b"1"), ("n", None)]


def test_a_listener_that_forgot_a_wrapped_producer_learns_its_sequence_from_the_shard(
        tmp_path):
    """A listener restarted (or one that forgot the producer as least recent) after the
    producer wrapped its sequences: the next batch must be stored, not answered as a
    resend of a stored one (which drops it), and a resend still answered, not stored
    twice.  The shard's producer table says where the producer is."""
    from raymq.storage import RecordBatch
    from raymq.wire.records import Producer
    from raymq.wire.sequences import OUT_OF_ORDER, Sequences
    from tests.helpers import open_shard
    sh = open_shard(tmp_path, [("t", 0)])
    try:
        def send(seqs, writer, body):
            pid, seq = seqs.check(writer, "t", 0, lambda p: sh.producer_sequences([p])[0])
            if seq == OUT_OF_ORDER:
                return "OUT_OF_ORDER"
            reply = sh.send(RecordBatch("t", 0, [body] * writer.count), pid, seq)
            seqs.stored(pid, seq)
            return "resend" if reply.duplicate else reply.queue_offsets[0]
        top = (1 << 31) - 5
        first = Sequences()
        assert send(first, Producer(9, 0, top, 5), b"before") == 0
        assert send(first, Producer(9, 0, 0, 3), b"wrapped") == 5
        restarted = Sequences()  # (nothing remembered)
        assert send(restarted, Producer(9, 0, 3, 2), b"after") == 8
        assert send(Sequences(), Producer(9, 0, 3, 2), b"after") == "resend"
        assert send(Sequences(), Producer(9, 0, 9, 1), b"gap") == "OUT_OF_ORDER"
        assert [m.body for m in sh.store.read_queue("t", 0, 0, 20)] == \
            [b"before"] * 5 + [b"wrapped"] * 3 + [b"after"] * 2
        with pytest.raises(Exception, match="producer id"):
            sh.producer_sequences([0])
    finally:
        sh.close()


def test_a_kafka_pull_marks_the_confirmed_end_of_a_replicated_queue_and_its_log_start(
        tmp_path):
    """A Fetch's high watermark on a replicated shard is what the in-sync replicas
    confirmed, not the leader's own end; the records past it are not read."""
    from raymq.storage import RecordBatch
    from tests.helpers import open_shard
    sh = open_shard(tmp_path, [("t", 0)])
    try:
        reply = sh.send(RecordBatch("t", 0, [b"%d" % i for i in range(10)]))
        [(_t, _q, spans, nxt, end, marks)] = sh.pull([("t", 0, 0, 100)], form="kafka")
        assert (len(spans), nxt, end, marks) == (10, 10, 10, (10, 0))
        sh.reads.confirmed = lambda: reply.phys[6]  # (records 6.. not yet confirmed)
        [(_t, _q, spans, nxt, end, marks)] = sh.pull([("t", 0, 0, 100)], form="kafka")
        assert (len(spans), marks) == (6, (6, 0))
        [(_t, _q, _s, _n, _e, marks)] = sh.pull([("t", 0, 8, 100)], form="kafka")
        assert marks == (6, 0)
        assert len(sh.pull([("t", 0, 0, 100)], form="spans")[0]) == 5  # (as before)
    finally:
        sh.close()
