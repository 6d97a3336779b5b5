"""Kafka record batches <-> RayMQ batches (``raymq.wire.records``): every compression a
Kafka client may use, binary keys and repeated headers, a corrupt batch refused.  No
Ray, no sockets."""
from __future__ import annotations

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
    batch = to_batch("t", 3, kafka_batch(CODECS[codec]))
    assert batch.topics == "t" and batch.queue_ids == 3 and len(batch.bodies) == 5
    assert batch.bodies[1] == b"value 1" * 20 and batch.born_ms[4] == 1_700_000_000_004
    stored = [StoredMessage("t", 3, 10 + i, 0, 0, 0, batch.born_ms[i], 0, -1, 0, 0,
                            batch.keys[i], None, (batch.properties or [None] * 5)[i] or {},
                            batch.bodies[i]) for i in range(5)]
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
