"""Kafka record batches <-> RayMQ messages, with kafka-python's record module (magic 2;
gzip, snappy, lz4 and zstd as its codecs have them).  Pure: no sockets, no Ray.

A Kafka record's value is the message body; its key is the message key (text when it is
UTF-8, else bytes: the storage format's binary key); its headers, in order and repeats
kept, are the message's headers; its timestamp is the message's born time.  Records that
an earlier version stored kept a binary key in the ``KAFKA_KEY_B64`` property and the
headers in ``KAFKA_HEADERS`` (JSON of ``[name, base64 value]`` pairs): they read the same.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import struct

import numpy as np

from crc32c import crc32c
from kafka.codec import gzip_decode, lz4_decode, snappy_decode, zstd_decode
from kafka.record.default_records import DefaultRecordBatchBuilder

from raymq.storage import RecordBatch
from raymq.storage.records import FIELD_FLAGS

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
    bodies, keys, headers, born = [], [], [], []
    writer = None
    buf = memoryview(bytes(data))
    pos = 0
    try:
        while pos < len(buf):
            if len(buf) - pos < _BATCH.size:
                raise BadRecords("a record batch shorter than its header")
            (_base, length, _epoch, magic, crc, attrs, last_delta, first_ts, _max_ts, pid,
             p_epoch, base_seq, count) = _BATCH.unpack_from(buf, pos)
            end = pos + 12 + length
            if magic != 2 or length < _BATCH.size - 12 or end > len(buf):
                raise BadRecords(f"a record batch of magic {magic} and {length} bytes")
            if crc32c(buf[pos + _CRC_FROM:end]) != crc:
                raise BadRecords("a record batch fails its CRC")
            if writer is None:
                writer = Producer(pid, p_epoch, base_seq, last_delta + 1,
                                  bool(attrs & 0x10)) if pid >= 0 else Producer()
            records = bytes(buf[pos + _BATCH.size:end])
            if attrs & 0x07:
                records = bytes(_DECOMPRESS[attrs & 0x07](records))
            if not attrs & 0x20:  # (a control batch: a producer's marker, no message)
                _records(records, count, first_ts, bodies, keys, headers, born)
            pos = end
    except BadRecords:
        raise
    except Exception as err:  # (whatever a malformed batch decodes into)
        raise BadRecords(f"record batch does not parse: {type(err).__name__}: {err}") from None
    if not bodies:
        raise BadRecords("no record in the request")
    return RecordBatch(topic, queue, bodies, keys=keys,
                       headers=headers if any(headers) else None, born_ms=born), writer


def _records(buf, count: int, first_ts: int, bodies: list, keys: list, headers_col: list,
             born: list) -> None:
    """The ``count`` records of a batch's (decompressed) bytes ``buf``, appended to the
    columns (one tight pass; kafka-python's record objects took 3.5 us a record, this
    takes about 1)."""
    pos = 0
    for _ in range(count):
        length, pos = _varint(buf, pos)
        nxt = pos + length
        ts, pos = _varint(buf, pos + 1)  # (past the record's attributes)
        _off, pos = _varint(buf, pos)
        n, pos = _varint(buf, pos)
        key = None
        if n >= 0:
            key, pos = buf[pos:pos + n], pos + n
        n, pos = _varint(buf, pos)
        if n >= 0:
            bodies.append(buf[pos:pos + n])
            pos += n
        else:
            bodies.append(b"")
        n, pos = _varint(buf, pos)
        headers = None
        if n:
            headers = []
            for _h in range(n):
                k, pos = _varint(buf, pos)
                name, pos = bytes(buf[pos:pos + k]).decode(), pos + k
                k, pos = _varint(buf, pos)
                if k < 0:
                    headers.append((name, None))
                else:
                    headers.append((name, bytes(buf[pos:pos + k])))
                    pos += k
        if key is not None:
            try:
                key = key.decode()
            except UnicodeDecodeError:
                key = bytes(key)
        if pos != nxt:
            raise BadRecords(f"a record's fields end at {pos}, its length says {nxt}")
        keys.append(key)
        headers_col.append(headers)
        born.append(first_ts + ts)
    if pos != len(buf):
        raise BadRecords(f"{len(buf) - pos} bytes after the batch's {count} records")


def _varint(buf, pos: int) -> tuple[int, int]:
    """A zig-zag varint at ``pos``: (its value, the position after it)."""
    b = buf[pos]
    if b < 0x80:
        return (b >> 1) ^ -(b & 1), pos + 1
    value, shift = b & 0x7F, 7
    while True:
        pos += 1
        b = buf[pos]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return (value >> 1) ^ -(value & 1), pos + 1
        shift += 7
        if shift > 63:
            raise BadRecords("a varint longer than 10 bytes")


#: A record batch's header (magic 2); the CRC covers from the attributes on.
_BATCH = struct.Struct(">qiibIhiqqqhii")
_CRC_FROM = struct.calcsize(">qiibI")
_DECOMPRESS = {1: lambda b: gzip_decode(b), 2: lambda b: snappy_decode(bytes(b)),
               3: lambda b: lz4_decode(bytes(b)), 4: lambda b: zstd_decode(bytes(b))}


def from_messages(messages) -> bytes:
    """Stored messages (in queue order, gaps allowed) as Kafka record batches: one batch
    per run of consecutive offsets (uncompressed, CreateTime)."""
    out, run = [], []
    for m in messages:
        if run and m.queue_offset != run[-1].queue_offset + 1:
            out.append(_batch_of(run))
            run = []
        run.append(m)
    if run:
        out.append(_batch_of(run))
    return b"".join(out)


def from_spans(spans) -> bytes:
    """A read's records as they lie in the log (``RecordSpans``) as one Kafka record batch
    (offset deltas carry any gaps): the records' fields laid out with numpy, each key and
    body copied once, no object per message.  Records with properties (a Kafka client's
    binary key or headers, or properties: an earlier version's Kafka key and headers) go
    through ``from_messages``."""
    h = spans.headers
    n = len(h)
    if not n:
        return b""
    if h["props_len"].any() or (h["flags"] & FIELD_FLAGS).any():
        return from_messages(spans.decode().messages())
    at = spans.bounds
    offsets, born = h["queue_offset"].astype(np.int64), h["born_ms"].astype(np.int64)
    klen, blen = h["key_len"].astype(np.int64), h["body_len"].astype(np.int64)
    fields = [_zigzag(born - born[0]), _zigzag(offsets - offsets[0]),
              _zigzag(np.where(klen > 0, klen, -1))]
    size_b = _zigzag(blen)
    body = 1 + sum(_varint_size(u) for u in fields) + klen + _varint_size(size_b) + blen + 1
    size_r = _zigzag(body)
    starts = np.cumsum(_varint_size(size_r) + body) - (_varint_size(size_r) + body)
    out = np.zeros(int(starts[-1] + _varint_size(size_r[-1:])[0] + body[-1]), np.uint8)
    pos = _put_varints(out, starts, size_r) + 1  # (then the attributes: 0)
    for u in fields:
        pos = _put_varints(out, pos, u)
    key_at = pos
    body_at = _put_varints(out, pos + klen, size_b)  # (the header count after it: 0)
    view, src = memoryview(out), spans.buf
    for dst, start, length in ((body_at, at.body, blen), (key_at, at.key, klen)):
        for d, a, k in zip(dst.tolist(), start.tolist(), length.tolist()):
            if k:
                view[d:d + k] = src[a:a + k]
    tail = _AFTER_CRC.pack(0, int(offsets[-1] - offsets[0]), int(born[0]), int(born.max()),
                           -1, -1, -1, n) + out.tobytes()
    return _BEFORE_CRC.pack(int(offsets[0]), len(tail) + 9, 0, 2, crc32c(tail)) + tail


def _zigzag(values: np.ndarray) -> np.ndarray:
    return ((values << 1) ^ (values >> 63)).view(np.uint64)


def _varint_size(u: np.ndarray) -> np.ndarray:
    size = np.ones(len(u), np.int64)
    for bits in range(7, 64, 7):
        size += u >= np.uint64(1 << bits)
    return size


def _put_varints(out: np.ndarray, pos: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Write varints ``u`` at ``pos`` in ``out``; the positions after them."""
    size = _varint_size(u)
    for k in range(int(size.max())):
        m = size > k
        byte = ((u[m] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        out[pos[m] + k] = byte | np.where(size[m] > k + 1, 0x80, 0).astype(np.uint8)
    return pos + size


def _batch_of(run: list) -> bytes:
    """One record batch of messages of consecutive offsets (records written in one pass,
    then the header and its CRC)."""
    first_ts = int(run[0].born_ms)
    max_ts = first_ts
    parts = []
    for delta, m in enumerate(run):
        ts = int(m.born_ms)
        max_ts = ts if ts > max_ts else max_ts
        key, headers = _key_and_headers(m)
        body = bytes(m.body)
        rec = [b"\x00", _var(ts - first_ts), _var(delta)]
        rec += (b"\x01",) if key is None else (_var(len(key)), key)
        rec += (_var(len(body)), body, _var(len(headers)))
        for name, value in headers:
            name = name.encode()
            rec += (_var(len(name)), name)
            rec += (b"\x01",) if value is None else (_var(len(value)), value)
        body = b"".join(rec)
        parts += (_var(len(body)), body)
    records = b"".join(parts)
    n = len(run)
    tail = _AFTER_CRC.pack(0, n - 1, first_ts, max_ts, -1, -1, -1, n) + records
    return _BEFORE_CRC.pack(run[0].queue_offset, len(tail) + 9, 0, 2, crc32c(tail)) + tail


def _key_and_headers(m) -> tuple[bytes | None, list]:
    """A stored message's key as bytes and its headers (those of the storage format, or
    the properties an earlier version kept them in)."""
    key = m.key.encode() if isinstance(m.key, str) else m.key
    headers = m.headers or ()
    if m._props:  # (a legacy record's Kafka key and headers)
        p = m.properties
        if KEY_PROP in p:
            key = base64.b64decode(p[KEY_PROP])
        if HEADERS_PROP in p:
            headers = [(name, None if v is None else base64.b64decode(v))
                       for name, v in json.loads(p[HEADERS_PROP])]
    return key, headers


def _var(value: int) -> bytes:
    """``value`` as a zig-zag varint."""
    u = (value << 1) ^ (value >> 63)
    if u < len(_VARINTS):
        return _VARINTS[u]
    out = bytearray()
    while u >= 0x80:
        out.append((u & 0x7F) | 0x80)
        u >>= 7
    out.append(u)
    return bytes(out)


def _encode_small(u: int) -> bytes:
    return bytes([u]) if u < 0x80 else bytes([(u & 0x7F) | 0x80, u >> 7])


#: The varints of 0 .. 2^14 - 1, made once.
_VARINTS = [_encode_small(u) for u in range(1 << 14)]
#: A record batch's header: before the CRC (which covers what follows it), and after.
_BEFORE_CRC = struct.Struct(">qiibI")
_AFTER_CRC = struct.Struct(">hiqqqhii")


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
