"""Kafka record batches <-> RayMQ messages, with kafka-python's record module (magic 2;
gzip, snappy, lz4 and zstd as its codecs have them).  Pure: no sockets, no Ray.

A Kafka record's value is the message body; its key is the message key (UTF-8 text in
RayMQ's record format: a binary key is kept in the ``KAFKA_KEY_B64`` property);
its headers, in order and repeats kept, are the ``KAFKA_HEADERS`` property (JSON of
``[name, base64 value]`` pairs); its timestamp is the message's born time.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import struct

from kafka.record import MemoryRecords, MemoryRecordsBuilder
from kafka.record.default_records import DefaultRecordBatchBuilder

from raymq.storage import RecordBatch

KEY_PROP, HEADERS_PROP = "KAFKA_KEY_B64", "KAFKA_HEADERS"


class BadRecords(Exception):
    """Record batches that do not parse or fail their CRC (CORRUPT_MESSAGE)."""


@dataclass(frozen=True)
class Producer:
    """Who wrote a Produce request's records: Kafka's producer id (-1: not an idempotent
    producer), epoch, the first record's sequence and how many records there are."""

    id: int = -1
    epoch: int = -1
    base_sequence: int = -1
    count: int = 0
    transactional: bool = False


def to_batch(topic: str, queue: int, data: bytes) -> tuple[RecordBatch, Producer]:
    """The records of a Produce request's ``data`` for ``topic``/``queue`` as one batch, and
    who wrote them (the fields of its first record batch: Kafka sends one a partition)."""
    bodies, keys, props, born = [], [], [], []
    writer = None
    try:
        records = MemoryRecords(bytes(data))
        while (batch := records.next_batch()) is not None:
            if not batch.validate_crc():
                raise BadRecords("a record batch fails its CRC")
            if writer is None:
                writer = Producer(batch.producer_id, batch.producer_epoch,
                                  batch.base_sequence, batch.last_offset_delta + 1,
                                  batch.is_transactional) \
                    if batch.producer_id >= 0 else Producer()
            for r in batch:
                p = {}
                key = r.key
                if key is not None:
                    try:
                        key = key.decode()
                    except UnicodeDecodeError:
                        p[KEY_PROP], key = base64.b64encode(key).decode(), None
                if r.headers:
                    p[HEADERS_PROP] = json.dumps(
                        [[k, None if v is None else base64.b64encode(v).decode()]
                         for k, v in r.headers])
                bodies.append(r.value if r.value is not None else b"")
                keys.append(key)
                props.append(p or None)
                born.append(int(r.timestamp))
    except BadRecords:
        raise
    except Exception as err:  # (whatever a malformed batch decodes into)
        raise BadRecords(f"record batch does not parse: {type(err).__name__}: {err}") from None
    if not bodies:
        raise BadRecords("no record in the request")
    return RecordBatch(topic, queue, bodies, keys=keys,
                       properties=props if any(props) else None, born_ms=born), writer


def from_messages(messages) -> bytes:
    """Stored messages (in queue order, gaps allowed) as Kafka record batches: one batch
    per run of consecutive offsets."""
    out = []
    builder, next_offset = None, None
    for m in messages:
        if builder is None or m.queue_offset != next_offset:
            if builder is not None:
                builder.close()
                out.append(bytes(builder.buffer()))
            builder = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 30,
                                           offset=m.queue_offset)
        p = m.properties or {}
        key = base64.b64decode(p[KEY_PROP]) if KEY_PROP in p else (
            m.key.encode() if m.key is not None else None)
        headers = [(k, None if v is None else base64.b64decode(v))
                   for k, v in json.loads(p[HEADERS_PROP])] if HEADERS_PROP in p else []
        builder.append(int(m.born_ms), key, bytes(m.body), headers)
        next_offset = m.queue_offset + 1
    if builder is not None:
        builder.close()
        out.append(bytes(builder.buffer()))
    return b"".join(out)


class _ControlBatch(DefaultRecordBatchBuilder):
    def _get_attributes(self, include_compression_type=True):
        return super()._get_attributes(include_compression_type) | self.CONTROL_MASK


#: A control record's key: version 0, type 1 (a commit marker).
_COMMIT_KEY, _MARKER_VALUE = struct.pack(">hh", 0, 1), struct.pack(">hi", 0, 0)


def control_batch(offset: int, timestamp_ms: int) -> bytes:
    """A control batch (a transaction marker, as Kafka writes them) at ``offset``.  Placed
    where a read leaves offsets out -- RayMQ's own markers, aborted records -- so that a
    Kafka consumer, which skips control batches, moves its position past them."""
    b = _ControlBatch(magic=2, compression_type=0, is_transactional=True, producer_id=-1,
                      producer_epoch=-1, base_sequence=-1, batch_size=1 << 16)
    b.append(0, timestamp_ms, _COMMIT_KEY, _MARKER_VALUE, [])
    out = b.build()
    struct.pack_into(">q", out, 0, offset)  # (the base offset: outside the CRC)
    return bytes(out)
