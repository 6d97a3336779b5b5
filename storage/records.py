"""Records and their on-disk encoding.

A put is written as one or more *frames* (Kafka record batches): a frame
header with magic, length and one CRC over the whole frame, followed by the
records, each with a fixed little-endian header and its variable fields.  All
per-record header fields of a frame are built at once with numpy, so encoding
costs a few C-level passes rather than a ``struct.pack`` per record.

Frame header (28 bytes): magic u32, frame_len u32 (header included), crc u32
(over everything after the crc field), version u8, attrs u8, reserved u16,
count u32, store_ms i64.

Record (74-byte header, then topic, key, tags, properties, body):
rec_len u32, frame_delta u32 (distance back to its frame's start), queue_id u32,
flags u32, queue_offset i64, born_ms i64, store_ms i64, prepared_offset i64,
tag_code i64, reconsume_count u32, topic_len u16, key_len u16, tags_len u16,
props_len u32, body_len u32.
"""
from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from storage.errors import InvalidMessageError

FRAME_MAGIC = 0x31514D52  # b"RMQ1" little-endian
FRAME_VERSION = 1
FRAME = struct.Struct("<IIIBBHIq")
FRAME_HEADER_BYTES = FRAME.size  # 28
FRAME_CRC_START = 12  # bytes 0..11: magic, len, crc

REC_DTYPE = np.dtype([
    ("rec_len", "<u4"), ("frame_delta", "<u4"), ("queue_id", "<u4"), ("flags", "<u4"),
    ("queue_offset", "<i8"), ("born_ms", "<i8"), ("store_ms", "<i8"),
    ("prepared_offset", "<i8"), ("tag_code", "<i8"), ("reconsume", "<u4"),
    ("topic_len", "<u2"), ("key_len", "<u2"), ("tags_len", "<u2"),
    ("props_len", "<u4"), ("body_len", "<u4"),
])
REC = struct.Struct("<IIIIqqqqqIHHHII")
REC_HEADER_BYTES = REC.size  # 74
if REC_DTYPE.itemsize != REC_HEADER_BYTES:  # pragma: no cover - layout constant
    raise ImportError("record header dtype and struct disagree")
_REC_VOID = np.dtype((np.void, REC_HEADER_BYTES))

MAX_TOPIC_BYTES = 127
MAX_KEY_BYTES = 1024
MAX_TAGS_BYTES = 1024
MAX_PROPERTIES_BYTES = 32 * 1024
PROP_NAME_VALUE_SEP = "\x01"
PROP_SEP = "\x02"


class SysFlag(enum.IntFlag):
    """Flags stored with a record; values go to disk and never change."""

    NONE = 0
    TRANSACTION_PREPARED = 1   # RocketMQ half message
    TRANSACTION_COMMIT = 2     # real message written by a commit
    TRANSACTION_ROLLBACK = 4
    OP = 8                     # op record resolving a half message
    CONTROL = 16               # Kafka-style commit/abort marker
    SCHEDULED = 32             # waiting in the schedule topic; tag_code is the deliver time
    TRANSACTIONAL = 64         # data record of a Kafka-style transaction


@dataclass(slots=True)
class Record:
    """A message as handed to the store."""

    topic: str
    queue_id: int
    body: bytes
    key: str | None = None
    tags: str | None = None
    properties: dict[str, str] | None = None
    flags: int = 0
    born_ms: int = 0
    reconsume_count: int = 0
    prepared_offset: int = -1
    tag_code: int | None = None  # None: hash of tags; set for scheduled records


class StoredMessage:
    """A record read back from the commit log, with where it lives.

    ``properties`` is decoded on first access: most readers never look.
    """

    __slots__ = ("topic", "queue_id", "queue_offset", "phys_offset", "size", "flags",
                 "born_ms", "store_ms", "prepared_offset", "tag_code",
                 "reconsume_count", "key", "tags", "_props", "body")
    FIELDS = ("topic", "queue_id", "queue_offset", "phys_offset", "size", "flags",
              "born_ms", "store_ms", "prepared_offset", "tag_code", "reconsume_count",
              "key", "tags", "properties", "body")

    def __init__(self, topic, queue_id, queue_offset, phys_offset, size, flags, born_ms,
                 store_ms, prepared_offset, tag_code, reconsume_count, key, tags,
                 properties, body):
        self.topic = topic
        self.queue_id = queue_id
        self.queue_offset = queue_offset
        self.phys_offset = phys_offset
        self.size = size
        self.flags = flags
        self.born_ms = born_ms
        self.store_ms = store_ms
        self.prepared_offset = prepared_offset
        self.tag_code = tag_code
        self.reconsume_count = reconsume_count
        self.key = key
        self.tags = tags
        self._props = properties  # dict, or encoded bytes until first access
        self.body = body

    @property
    def properties(self) -> dict[str, str]:
        props = self._props
        if not isinstance(props, dict):
            props = self._props = decode_properties(props)
        return props

    @properties.setter
    def properties(self, value: dict[str, str]) -> None:
        self._props = value

    def __repr__(self) -> str:
        return (f"StoredMessage(topic={self.topic!r}, queue_id={self.queue_id}, "
                f"queue_offset={self.queue_offset}, phys_offset={self.phys_offset}, "
                f"flags={self.flags}, key={self.key!r}, tags={self.tags!r}, "
                f"body={self.body[:32]!r}{'...' if len(self.body) > 32 else ''})")

    def __eq__(self, other):
        if not isinstance(other, StoredMessage):
            return NotImplemented
        return all(getattr(self, s) == getattr(other, s) for s in self.FIELDS)

    __hash__ = None

    def __reduce__(self):
        return (StoredMessage, tuple(getattr(self, s) for s in self.__slots__))

    def to_record(self) -> Record:
        return Record(self.topic, self.queue_id, self.body, self.key, self.tags,
                      dict(self.properties) or None, self.flags,
                      self.born_ms, self.reconsume_count, self.prepared_offset,
                      self.tag_code)


def tags_hash(tags: str | None) -> int:
    """Stable hash of a tag string for consume-queue filtering (0: no tags)."""
    if not tags:
        return 0
    return zlib.crc32(tags.encode()) or 1


def encode_properties(props: dict[str, str] | None) -> bytes:
    if not props:
        return b""
    parts = []
    for name, value in props.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise InvalidMessageError(
                f"property names and values must be str, got {name!r}={value!r}")
        if (not name or PROP_NAME_VALUE_SEP in name or PROP_SEP in name
                or PROP_NAME_VALUE_SEP in value or PROP_SEP in value):
            raise InvalidMessageError(
                f"property {name!r} is empty or contains a reserved separator "
                "character (\\x01 or \\x02)")
        parts.append(f"{name}{PROP_NAME_VALUE_SEP}{value}")
    data = PROP_SEP.join(parts).encode()
    if len(data) > MAX_PROPERTIES_BYTES:
        raise InvalidMessageError(
            f"properties take {len(data)} bytes, more than {MAX_PROPERTIES_BYTES}")
    return data


def decode_properties(data: bytes) -> dict[str, str]:
    if not data:  # fresh dict: callers may change it
        return {}
    return dict(item.split(PROP_NAME_VALUE_SEP, 1) for item in data.decode().split(PROP_SEP))


class RecordBatch:
    """Records in columns: what the store encodes and what crosses Ray calls.

    Every column is either a list with one value per record or a single value
    shared by all records (``topics="orders"``, ``flags=0``); ``None`` for
    keys, tags, properties and tag codes means "none for any record".  Columns
    pickle and encode far cheaper than one object per record.
    """

    __slots__ = ("topics", "queue_ids", "bodies", "keys", "tags", "properties", "flags",
                 "born_ms", "reconsume", "prepared_offsets", "tag_codes")

    def __init__(self, topics, queue_ids, bodies: list, *, keys=None, tags=None,
                 properties=None, flags=0, born_ms=0, reconsume=0, prepared_offsets=-1,
                 tag_codes=None):
        self.topics = topics
        self.queue_ids = queue_ids
        self.bodies = bodies if isinstance(bodies, list) else list(bodies)
        self.keys = keys
        self.tags = tags
        self.properties = properties
        self.flags = flags
        self.born_ms = born_ms
        self.reconsume = reconsume
        self.prepared_offsets = prepared_offsets
        self.tag_codes = tag_codes
        n = len(self.bodies)
        for name in self.__slots__:
            col = getattr(self, name)
            if isinstance(col, list) and len(col) != n:
                raise InvalidMessageError(f"column {name} has {len(col)} values for {n} records")

    def __len__(self) -> int:
        return len(self.bodies)

    def __reduce__(self):
        return (_rebuild_batch, tuple(getattr(self, s) for s in self.__slots__))

    @classmethod
    def from_records(cls, records: Sequence[Record]) -> "RecordBatch":
        return cls(
            _shared(list(map(_get_topic, records))), _shared(list(map(_get_qid, records))),
            list(map(_get_body, records)), keys=_none_if_empty(list(map(_get_key, records))),
            tags=_none_if_empty(list(map(_get_tags, records))),
            properties=_none_if_empty(list(map(_get_props, records))),
            flags=_shared(list(map(_get_flags, records))),
            born_ms=_shared(list(map(_get_born, records))),
            reconsume=_shared(list(map(_get_recon, records))),
            prepared_offsets=_shared(list(map(_get_prep, records))),
            tag_codes=_none_if_empty(list(map(_get_tagcode, records))))

    def column(self, name: str) -> list:
        col = getattr(self, name)
        return col if isinstance(col, list) else [col] * len(self.bodies)

    def slice(self, lo: int, hi: int) -> "RecordBatch":
        if lo == 0 and hi == len(self.bodies):
            return self
        return RecordBatch(*(c[lo:hi] if isinstance(c, list) else c
                             for c in (getattr(self, s) for s in self.__slots__[:3])),
                           **{s: (c[lo:hi] if isinstance(c, list) else c)
                              for s, c in ((s, getattr(self, s)) for s in self.__slots__[3:])})

    def record(self, i: int) -> Record:
        def at(name):
            col = getattr(self, name)
            return col[i] if isinstance(col, list) else col
        return Record(at("topics"), at("queue_ids"), self.bodies[i], at("keys"), at("tags"),
                      at("properties"), at("flags"), at("born_ms"), at("reconsume"),
                      at("prepared_offsets"), at("tag_codes"))

    def records(self) -> list[Record]:
        return [self.record(i) for i in range(len(self.bodies))]


def _rebuild_batch(topics, queue_ids, bodies, keys, tags, properties, flags, born_ms,
                   reconsume, prepared_offsets, tag_codes):
    batch = RecordBatch.__new__(RecordBatch)
    for name, value in zip(RecordBatch.__slots__, (topics, queue_ids, bodies, keys, tags,
                                                  properties, flags, born_ms, reconsume,
                                                  prepared_offsets, tag_codes)):
        setattr(batch, name, value)
    return batch


def _shared(values: list):
    """A single value when all are equal, else the list."""
    first = values[0] if values else None
    if values and values.count(first) == len(values):
        return first
    return values


def _none_if_empty(values: list):
    if values.count(None) == len(values):
        return None
    return values


_get_topic = attrgetter("topic")
_get_qid = attrgetter("queue_id")
_get_body = attrgetter("body")
_get_key = attrgetter("key")
_get_tags = attrgetter("tags")
_get_props = attrgetter("properties")
_get_flags = attrgetter("flags")
_get_born = attrgetter("born_ms")
_get_recon = attrgetter("reconsume_count")
_get_prep = attrgetter("prepared_offset")
_get_tagcode = attrgetter("tag_code")
_TOPIC_DECODE: dict[bytes, str] = {}


def _encode_text(value: str, limit: int, what: str) -> bytes:
    if not isinstance(value, str):
        raise InvalidMessageError(f"{what} must be a str, got {type(value).__name__}")
    data = value.encode()
    if len(data) > limit:
        raise InvalidMessageError(f"{what} {value[:40]!r}... is longer than {limit} bytes")
    return data


def _optional_texts(values: list | None, n: int, limit: int, what: str):
    """(encoded list or None, lengths array or 0)."""
    if values is None:
        return None, 0
    out = [_encode_text(v, limit, what) if v else b"" for v in values]
    return out, np.fromiter(map(len, out), np.int64, n)


def _int_column(col, n: int, dtype):
    if isinstance(col, list):
        return np.fromiter(col, dtype, n)
    return col


@dataclass(frozen=True, slots=True)
class EncodedFrame:
    header: bytes
    payload: bytes
    rel_offsets: np.ndarray  # record start, relative to the frame start
    rec_lens: np.ndarray
    tag_codes: np.ndarray

    @property
    def size(self) -> int:
        return len(self.header) + len(self.payload)


def encode_frame(batch: RecordBatch, queue_offsets: np.ndarray, store_ms: int) -> EncodedFrame:
    """Encode ``batch`` (bodies already checked for size) into one frame."""
    n = len(batch.bodies)
    bodies = batch.bodies
    body_lens = np.fromiter(map(len, bodies), np.int64, n)
    keys_b, key_lens = _optional_texts(batch.keys, n, MAX_KEY_BYTES, "key")
    tags_b, tags_lens = _optional_texts(batch.tags, n, MAX_TAGS_BYTES, "tags")
    props = batch.properties
    if props is None:
        props_b, props_lens = None, 0
    else:
        props_b = [encode_properties(p) for p in props]
        props_lens = np.fromiter(map(len, props_b), np.int64, n)

    if isinstance(batch.topics, str):  # one topic: its bytes ride in the header view
        topic_b = _encode_text(batch.topics, MAX_TOPIC_BYTES, "topic")
        topics_b, topic_lens = None, len(topic_b)
        dtype = np.dtype(REC_DTYPE.descr + [("topic", f"S{len(topic_b)}")]) if topic_b else REC_DTYPE
    else:
        cache: dict[str, bytes] = {}
        for t in set(batch.topics):
            cache[t] = _encode_text(t, MAX_TOPIC_BYTES, "topic")
        topics_b = list(map(cache.__getitem__, batch.topics))
        topic_lens = np.fromiter(map(len, topics_b), np.int64, n)
        dtype = REC_DTYPE

    tag_given = batch.tag_codes
    if tag_given is None:
        if tags_b is None:
            tag_codes = np.zeros(n, np.int64)
        else:
            tag_codes = np.fromiter(map(tags_hash, batch.tags), np.int64, n)
    else:
        tags_list = batch.column("tags")
        tag_codes = np.fromiter(
            (t if t is not None else tags_hash(s) for t, s in zip(tag_given, tags_list)),
            np.int64, n)

    rec_lens = REC_HEADER_BYTES + topic_lens + key_lens + tags_lens + props_lens + body_lens
    rel = np.empty(n, np.int64)
    rel[0] = FRAME_HEADER_BYTES
    np.cumsum(rec_lens[:-1], out=rel[1:])
    rel[1:] += FRAME_HEADER_BYTES

    h = np.empty(n, dtype)
    h["rec_len"] = rec_lens
    h["frame_delta"] = rel
    h["queue_id"] = _int_column(batch.queue_ids, n, np.uint32)
    h["flags"] = _int_column(batch.flags, n, np.uint32)
    h["queue_offset"] = queue_offsets
    h["born_ms"] = _int_column(batch.born_ms, n, np.int64)
    h["store_ms"] = store_ms
    h["prepared_offset"] = _int_column(batch.prepared_offsets, n, np.int64)
    h["tag_code"] = tag_codes
    h["reconsume"] = _int_column(batch.reconsume, n, np.uint32)
    h["topic_len"] = topic_lens
    h["key_len"] = key_lens
    h["tags_len"] = tags_lens
    h["props_len"] = props_lens
    h["body_len"] = body_lens
    if topics_b is None and topic_lens:
        h["topic"] = topic_b
    headers = h.view(np.dtype((np.void, dtype.itemsize))).tolist()
    columns = [headers]
    for col in (topics_b, keys_b, tags_b, props_b):
        if col is not None:
            columns.append(col)
    columns.append(bodies)
    payload = b"".join(chain.from_iterable(zip(*columns)))
    frame_len = FRAME_HEADER_BYTES + len(payload)
    tail = FRAME.pack(0, 0, 0, FRAME_VERSION, 0, 0, n, store_ms)[FRAME_CRC_START:]
    crc = zlib.crc32(payload, zlib.crc32(tail))
    header = FRAME.pack(FRAME_MAGIC, frame_len, crc, FRAME_VERSION, 0, 0, n, store_ms)
    return EncodedFrame(header, payload, rel, rec_lens, tag_codes)


class FrameError(Exception):
    """Raised by ``check_frame``; ``reason`` says what was wrong."""

    def __init__(self, reason: str, frame_len: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.frame_len = frame_len


def check_frame(buf, pos: int, end: int) -> tuple[int, int]:
    """Verify the frame at ``buf[pos:]``; return (frame_len, count) or raise FrameError."""
    if end - pos < FRAME_HEADER_BYTES:
        raise FrameError(f"{end - pos} bytes left, fewer than a frame header")
    magic, frame_len, crc, version, _attrs, _res, count, _store = FRAME.unpack_from(buf, pos)
    if magic != FRAME_MAGIC:
        raise FrameError(f"bad frame magic {magic:#x}")
    if version != FRAME_VERSION:
        raise FrameError(f"unknown frame version {version}", frame_len)
    if frame_len < FRAME_HEADER_BYTES or pos + frame_len > end:
        raise FrameError(f"frame length {frame_len} runs past the end ({end - pos} bytes left)",
                         frame_len)
    actual = zlib.crc32(memoryview(buf)[pos + FRAME_CRC_START:pos + frame_len])
    if actual != crc:
        raise FrameError(f"CRC mismatch (stored {crc:#010x}, computed {actual:#010x})", frame_len)
    return frame_len, count


def iter_frame_records(buf, pos: int, frame_len: int):
    """Yield (rel_offset, header tuple) for each record of a checked frame."""
    off = pos + FRAME_HEADER_BYTES
    end = pos + frame_len
    unpack = REC.unpack_from
    while off < end:
        hdr = unpack(buf, off)
        yield off - pos, hdr
        off += hdr[0]


def decode_record(buf, off: int, phys_offset: int) -> StoredMessage:
    """Decode the record at ``buf[off:]``; ``phys_offset`` is its commit-log offset."""
    (rec_len, _delta, queue_id, flags, queue_offset, born_ms, store_ms, prepared,
     tag_code, reconsume, topic_len, key_len, tags_len, props_len, body_len) = REC.unpack_from(buf, off)
    p = off + REC_HEADER_BYTES
    tb = bytes(buf[p:p + topic_len])
    topic = _TOPIC_DECODE.get(tb)
    if topic is None:
        if len(_TOPIC_DECODE) > 4096:
            _TOPIC_DECODE.clear()
        topic = _TOPIC_DECODE[tb] = tb.decode()
    p += topic_len
    key = bytes(buf[p:p + key_len]).decode() if key_len else None
    p += key_len
    tags = bytes(buf[p:p + tags_len]).decode() if tags_len else None
    p += tags_len
    props = bytes(buf[p:p + props_len])
    p += props_len
    body = bytes(buf[p:p + body_len])
    return StoredMessage(topic, queue_id, queue_offset, phys_offset, rec_len, flags, born_ms,
                         store_ms, prepared, tag_code, reconsume, key, tags, props, body)


class MessageBatch:
    """Messages read back, in columns: what the broker returns to a pull.

    ``headers`` is the structured array of record headers (queue offsets,
    flags, timestamps...), the rest are lists.  Objects per message are made
    only when a reader asks (``messages()``, indexing, iteration).
    """

    __slots__ = ("headers", "phys_offsets", "topics", "keys", "tags", "properties", "bodies")

    def __init__(self, headers, phys_offsets, topics, keys, tags, properties, bodies):
        self.headers = headers
        self.phys_offsets = phys_offsets
        self.topics = topics
        self.keys = keys
        self.tags = tags
        self.properties = properties
        self.bodies = bodies

    def __reduce__(self):
        return (MessageBatch, tuple(getattr(self, s) for s in self.__slots__))

    def __len__(self) -> int:
        return len(self.bodies)

    @classmethod
    def empty(cls) -> "MessageBatch":
        return cls(np.empty(0, REC_DTYPE), [], [], None, None, None, [])

    @property
    def queue_offsets(self) -> np.ndarray:
        return self.headers["queue_offset"]

    def __getitem__(self, i: int) -> StoredMessage:
        h = self.headers[i]
        return StoredMessage(
            self.topics[i], int(h["queue_id"]), int(h["queue_offset"]), self.phys_offsets[i],
            int(h["rec_len"]), int(h["flags"]), int(h["born_ms"]), int(h["store_ms"]),
            int(h["prepared_offset"]), int(h["tag_code"]), int(h["reconsume"]),
            self.keys[i] if self.keys else None, self.tags[i] if self.tags else None,
            self.properties[i] if self.properties else b"", self.bodies[i])

    def messages(self) -> list[StoredMessage]:
        n = len(self.bodies)
        h = self.headers
        return list(map(StoredMessage, self.topics, h["queue_id"].tolist(),
                        h["queue_offset"].tolist(), self.phys_offsets, h["rec_len"].tolist(),
                        h["flags"].tolist(), h["born_ms"].tolist(), h["store_ms"].tolist(),
                        h["prepared_offset"].tolist(), h["tag_code"].tolist(),
                        h["reconsume"].tolist(), self.keys or [None] * n,
                        self.tags or [None] * n, self.properties or [b""] * n, self.bodies))

    __iter__ = lambda self: iter(self.messages())  # noqa: E731

    def concat(self, other: "MessageBatch") -> "MessageBatch":
        def join(a, b, n_a, n_b, fill):
            if a is None and b is None:
                return None
            return (a or [fill] * n_a) + (b or [fill] * n_b)
        na, nb = len(self), len(other)
        return MessageBatch(np.concatenate([self.headers, other.headers]),
                            self.phys_offsets + other.phys_offsets, self.topics + other.topics,
                            join(self.keys, other.keys, na, nb, None),
                            join(self.tags, other.tags, na, nb, None),
                            join(self.properties, other.properties, na, nb, b""),
                            self.bodies + other.bodies)


def decode_records(buf: bytes, rel_offsets: list[int], phys_offsets: list[int]) -> MessageBatch:
    """Decode many records of one buffer at once (headers gathered with numpy)."""
    n = len(rel_offsets)
    if not n:
        return MessageBatch.empty()
    raw = np.frombuffer(buf, np.uint8)
    rel = np.asarray(rel_offsets, np.int64)
    window = as_strided(raw, shape=(len(raw) - REC_HEADER_BYTES + 1, REC_HEADER_BYTES),
                        strides=(1, 1), writeable=False)
    h = window[rel].view(REC_DTYPE).reshape(n)
    t0 = rel + REC_HEADER_BYTES
    k0 = t0 + h["topic_len"]
    g0 = k0 + h["key_len"]
    p0 = g0 + h["tags_len"]
    b0 = p0 + h["props_len"]
    b1 = b0 + h["body_len"]
    t0l, k0l, g0l, p0l, b0l, b1l = (a.tolist() for a in (t0, k0, g0, p0, b0, b1))
    topics = _decode_topics(buf, t0l, k0l)
    keys = tags = props = None
    if h["key_len"].any():
        keys = [buf[a:b].decode() if b > a else None for a, b in zip(k0l, g0l)]
    if h["tags_len"].any():
        tags = [buf[a:b].decode() if b > a else None for a, b in zip(g0l, p0l)]
    if h["props_len"].any():
        props = [buf[a:b] for a, b in zip(p0l, b0l)]
    bodies = [buf[a:b] for a, b in zip(b0l, b1l)]
    return MessageBatch(h, list(phys_offsets), topics, keys, tags, props, bodies)


def _decode_topics(buf: bytes, starts: list[int], ends: list[int]) -> list[str]:
    first = buf[starts[0]:ends[0]]
    topic = _TOPIC_DECODE.get(first)
    if topic is None:
        if len(_TOPIC_DECODE) > 4096:
            _TOPIC_DECODE.clear()
        topic = _TOPIC_DECODE[first] = first.decode()
    n = len(starts)
    if all(e - s == len(first) for s, e in zip(starts, ends)) and \
            all(buf[s:e] == first for s, e in zip(starts, ends)):
        return [topic] * n
    out = []
    for a, b in zip(starts, ends):
        tb = buf[a:b]
        name = _TOPIC_DECODE.get(tb)
        if name is None:
            name = _TOPIC_DECODE[tb] = tb.decode()
        out.append(name)
    return out
