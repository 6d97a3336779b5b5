"""The schema of committed message datasets, and Arrow record batches built from what a
shard's pull returns (``RecordSpans``: the records undecoded).  Pure pyarrow and numpy:
no Ray, no Spark.

Columns (README, "Spark pipelines"):

==============  =====================  ==================================================
topic           string                 the message's topic
queue_id        int32                  its queue
queue_offset    int64                  its offset in the queue (``queue_offset + 1`` is
                                       what a group commits after it)
msg_id          string                 the id its producer got (as consumers see it)
key             string (null)          its key
tags            string (null)          its tags
properties      map<string, string>    its properties (the application's and RayMQ's)
body            binary                 its body
born_ms         int64                  when its producer made it (ms since the epoch)
store_ms        int64                  when its shard stored it
transaction_id  string (null)          a RocketMQ-style transaction's id
==============  =====================  ==================================================

Only standard Arrow types (never ``large_*``, unsigned or dictionary types): Spark 3.5
reads the batches into vectors built from its own schema.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raymq.actors.protocol import Prop
from raymq.storage.buffers import fresh_bytes
from raymq.storage.records import RecordSpans, SysFlag

MESSAGE_SCHEMA = pa.schema([
    ("topic", pa.string()), ("queue_id", pa.int32()), ("queue_offset", pa.int64()),
    ("msg_id", pa.string()), ("key", pa.string()), ("tags", pa.string()),
    ("properties", pa.map_(pa.string(), pa.string())), ("body", pa.binary()),
    ("born_ms", pa.int64()), ("store_ms", pa.int64()), ("transaction_id", pa.string())])

_KV, _SEP = "\x01", "\x02"  # a record's properties: "k\x01v\x02k\x01v" (storage/records.py)


def _null_if_empty(col: pa.Array) -> pa.Array:
    return pc.if_else(pc.equal(pc.binary_length(col), 0), pa.scalar(None, col.type), col)


def properties_map(raw) -> pa.MapArray:
    """The properties column from records' encoded properties (a binary column, or a list
    of bytes; empty or null for none)."""
    if not isinstance(raw, pa.Array):
        raw = pa.array([r or b"" for r in raw], pa.binary())
    s = _null_if_empty(raw.cast(pa.string()))
    parts = pc.split_pattern(s, _SEP)
    lens = pc.fill_null(pc.list_value_length(parts), 0).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(raw) + 1, np.int32)
    np.cumsum(lens, out=offsets[1:])
    kv = pc.split_pattern(parts.flatten(), _KV, max_splits=1)
    return pa.MapArray.from_arrays(pa.array(offsets), pc.list_element(kv, 0),
                                   pc.list_element(kv, 1))


#: Every byte's two hex digits, as the uint16 whose memory holds them.
_HEX2 = np.frombuffer(b"".join(b"%02X" % i for i in range(256)), np.uint16)


def msg_id_array(shard: int, phys_offsets: np.ndarray) -> pa.StringArray:
    """``make_msg_id(shard, p)`` for every physical offset, as one string column (built
    in numpy: a million ids in milliseconds, not a million Python strings)."""
    n = len(phys_offsets)
    chars = np.empty((n, 10), np.uint16)  # 20 characters an id
    chars[:, :2] = np.frombuffer(f"{shard:04X}".encode(), np.uint16)
    np.take(_HEX2, phys_offsets.astype(">u8").view(np.uint8).reshape(n, 8), out=chars[:, 2:])
    offsets = np.arange(0, 20 * n + 1, 20, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(chars))


def _cut(data: pa.Buffer, starts: np.ndarray, ends: np.ndarray, type_) -> pa.Array:
    """The values ``data[starts[i]:ends[i]]`` as one binary/string column, cut in C++: an
    array of the ranges and the gaps between them, filtered down to the ranges (each
    range's bytes are copied once; no Python object per value).  Ranges that are not in
    order take the slow way."""
    n = len(starts)
    bounds = np.empty(2 * n + 1, np.int64)
    bounds[0], bounds[1::2], bounds[2::2] = 0, starts, ends
    if n and len(data) < 2**31 and bounds[-1] <= len(data) and (np.diff(bounds) >= 0).all():
        both = pa.Array.from_buffers(pa.binary(), 2 * n,
                                     [None, pa.py_buffer(bounds.astype(np.int32)), data])
        odd = np.zeros(2 * n, bool)
        odd[1::2] = True
        return both.filter(pa.array(odd)).view(type_)
    return pa.array([data[a:b].to_pybytes() for a, b in zip(starts.tolist(), ends.tolist())],
                    pa.binary()).view(type_)


def message_record_batch(shard: int, topic: str, queue_id: int, spans: RecordSpans,
                         keep: np.ndarray | None = None) -> pa.RecordBatch:
    """The rows of pulled ``RecordSpans`` (those where ``keep`` is true) in
    ``MESSAGE_SCHEMA``; ``msg_id`` as consumers get it (the producer's id of a retried or
    committed copy, else the stored record's own).  Columns are cut straight out of the
    read buffer."""
    if keep is not None and not keep.all():
        spans = spans.select(keep)
    n, h, at = len(spans), spans.headers, spans.bounds
    data = pa.py_buffer(spans.buf)

    def text(starts, ends, present) -> pa.Array:
        if not present.any():
            return pa.nulls(n, pa.string())
        return _null_if_empty(_cut(data, starts, ends, pa.string()))

    def ints(name, dtype):
        return pa.array(np.ascontiguousarray(h[name]).astype(dtype))
    msg_id = msg_id_array(shard, spans.phys_offsets)
    if h["props_len"].any():
        props = properties_map(_cut(data, at.props, at.props_end, pa.binary()))
        msg_id = pc.coalesce(pc.map_lookup(props, Prop.PRODUCER_MSG_ID, "first"), msg_id)
        transaction_id = pc.map_lookup(props, Prop.TRANSACTION_ID, "first")
    else:  # (no properties: no copy's id, no transaction)
        props = pa.nulls(n, MESSAGE_SCHEMA.field("properties").type)
        transaction_id = pa.nulls(n, pa.string())
    return pa.record_batch([
        pa.repeat(pa.scalar(topic, pa.string()), n), pa.array(np.full(n, queue_id, np.int32)),
        ints("queue_offset", np.int64), msg_id,
        text(at.key, _text_key_ends(h, at), h["key_len"]),
        text(at.tags, at.props, h["tags_len"]),
        props, _cut(data, at.body, at.body_end, pa.binary()),
        ints("born_ms", np.int64), ints("store_ms", np.int64), transaction_id],
        schema=MESSAGE_SCHEMA)


def _text_key_ends(h: np.ndarray, at) -> np.ndarray:
    """Where each record's key ends, as text: a binary key (a Kafka client's, not UTF-8)
    reads as null in the ``key`` column, which is a string."""
    binary = (h["flags"] & SysFlag.BINARY_KEY) != 0
    return np.where(binary, at.key, at.tags) if binary.any() else at.tags


def to_ipc_bytes(batches) -> bytes:
    """Record batches as one Arrow IPC stream (what RayDP's executors read from Ray's
    object store directly: no pandas, no Python workers).  The stream is measured first,
    then written straight into a new ``bytes`` object (``fresh_bytes``, in huge pages):
    no second copy of a block of a hundred megabytes."""
    def write(sink) -> None:
        with pa.ipc.new_stream(sink, MESSAGE_SCHEMA) as writer:
            for b in batches:
                writer.write_batch(b)
    size = pa.MockOutputStream()
    write(size)
    out, memory = fresh_bytes(size.size())
    write(pa.FixedSizeBufferWriter(pa.py_buffer(memory)))
    return out


def from_ipc_bytes(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()
