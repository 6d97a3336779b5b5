"""Records and their on-disk encoding.
Owns the frame format: encoding, checking and decoding frames, and the record types.

A put is written as one or more *frames* (Kafka record batches) with one CRC
over the whole frame.  Inside a frame the records are laid out in columns, so
that encoding is a handful of C-level operations whatever the record count:

    frame header (44 bytes): magic u32, frame_len u32 (header included),
        crc u32 (over everything after the crc field), version u8, attrs u8
        (bit 0: last frame of its put), reserved u16, count u32, store_ms i64,
        producer_id i64 (0: none), sequence i64 (the producer's put number)
    record headers: count x 78 bytes (layout ``REC_DTYPE``)
    meta region: topic, key, tags and properties of each record (a topic
        shared by every record of the frame is stored once), then its header
        block when it has headers (flag HEADERS: ``HEADER_BLOCK`` below)
    body region: the bodies, back to back

Version 2 frames (written when a record of the frame has a binary key or headers;
version 1 otherwise, as before) add two record flags: BINARY_KEY (the key field holds
bytes that are not text) and HEADERS (a block of repeated binary headers, as Kafka's,
follows the record's properties: u32 block length, u16 count, then per header u16 name
length, the UTF-8 name, i32 value length -- -1: a null value -- and the value).  Both
versions read.

A record's *physical offset* is the commit-log offset of its header; its
*size* runs from there to the end of its body, so ``[phys, phys + size)``
holds the header, the meta fields and the body.  Offsets inside a record
header (``meta_off``, ``body_off``) are relative to the frame start, which is
``phys - frame_delta``.
"""
from __future__ import annotations

import enum
import pickle
import struct
import zlib
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from raymq.storage.errors import InvalidMessageError

FRAME_MAGIC = 0x31514D52  # b"RMQ1" little-endian
FRAME_VERSION = 1
#: The version of a frame that has a record with a binary key or headers.
FRAME_VERSION_HEADERS = 2
FRAME = struct.Struct("<IIIBBHIqqq")
FRAME_HEADER_BYTES = FRAME.size  # 44
FRAME_ATTR_LAST = 1  # the last frame of a put
FRAME_CRC_START = 12  # bytes 0..11: magic, len, crc

REC_DTYPE = np.dtype([
    ("queue_id", "<u4"), ("flags", "<u4"), ("queue_offset", "<i8"), ("born_ms", "<i8"),
    ("store_ms", "<i8"), ("prepared_offset", "<i8"), ("tag_code", "<i8"),
    ("reconsume", "<u4"), ("frame_delta", "<u4"), ("meta_off", "<u4"),
    ("topic_len", "<u2"), ("key_len", "<u2"), ("tags_len", "<u2"), ("props_len", "<u4"),
    ("body_off", "<u4"), ("body_len", "<u4"),
])
REC_HEADER_BYTES = REC_DTYPE.itemsize  # 78

MAX_TOPIC_BYTES = 127
MAX_KEY_BYTES = 1024
MAX_TAGS_BYTES = 1024
MAX_PROPERTIES_BYTES = 32 * 1024
#: What a producer's own properties may take: the broker adds its own to a message on its
#: way (transaction, delay, retry and dead-letter properties, a reason of up to 500
#: bytes), and a message it could not retry or dead-letter would be stuck.
MAX_USER_PROPERTIES_BYTES = MAX_PROPERTIES_BYTES - 4 * 1024
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
    BINARY_KEY = 128           # the key is bytes, not text (frame version 2)
    HEADERS = 256              # a header block follows the properties (frame version 2)


#: The flags the encoder sets from a record's own key and headers.
FIELD_FLAGS = int(SysFlag.BINARY_KEY | SysFlag.HEADERS)
MAX_HEADERS_BYTES = 64 * 1024


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
    headers: list | None = None  # [(name, bytes or None)], repeats and order kept


class StoredMessage:
    """A record read back from the commit log, with where it lives.

    ``properties`` is decoded on first access: most readers never look.  ``key`` is
    bytes for a binary key (``SysFlag.BINARY_KEY``); ``headers`` the record's
    ``[(name, value bytes or None)]`` (None: none).
    """

    __slots__ = ("topic", "queue_id", "queue_offset", "phys_offset", "size", "flags",
                 "born_ms", "store_ms", "prepared_offset", "tag_code",
                 "reconsume_count", "key", "tags", "_props", "body", "headers")
    FIELDS = ("topic", "queue_id", "queue_offset", "phys_offset", "size", "flags",
              "born_ms", "store_ms", "prepared_offset", "tag_code", "reconsume_count",
              "key", "tags", "properties", "body", "headers")

    def __init__(self, topic, queue_id, queue_offset, phys_offset, size, flags, born_ms,
                 store_ms, prepared_offset, tag_code, reconsume_count, key, tags,
                 properties, body, headers=None):
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
        self.headers = headers

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
                      self.tag_code, self.headers)


def tags_hash(tags: str | None) -> int:
    """Stable hash of a tag string for consume-queue filtering (0: no tags)."""
    if not tags:
        return 0
    return zlib.crc32(tags.encode()) or 1


def encode_properties(props: dict[str, str] | None) -> bytes:
    """``name\x01value`` pairs joined by ``\x02``; bad names or values raise.

    The common case is checked on the joined text (one separator of each kind
    per pair, no empty name); anything else goes through the per-item checks,
    which say what is wrong.
    """
    if not props:
        return b""
    try:
        text = PROP_SEP.join([k + PROP_NAME_VALUE_SEP + v for k, v in props.items()])
    except TypeError:  # a name or value that is not a str
        text = None
    if text is not None and text.count(PROP_NAME_VALUE_SEP) == len(props) \
            and text.count(PROP_SEP) == len(props) - 1 and "" not in props:
        data = text.encode()
        if len(data) > MAX_PROPERTIES_BYTES:
            raise InvalidMessageError(
                f"properties take {len(data)} bytes, more than {MAX_PROPERTIES_BYTES}")
        return data
    return _encode_properties_checked(props)


def encode_properties_list(props_list) -> list[bytes]:
    """``encode_properties`` of each; a dict shared by many records is encoded once."""
    out, seen = [], {}
    for p in props_list:
        if not p:
            out.append(b"")
            continue
        enc = seen.get(id(p))
        if enc is None:
            enc = seen[id(p)] = encode_properties(p)
        out.append(enc)
    return out


def _encode_properties_checked(props: dict[str, str]) -> bytes:
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


def check_user_properties(props: dict | None, limit: int = MAX_USER_PROPERTIES_BYTES) -> None:
    """Refuse a producer's properties over ``limit`` (cheap for small ones: the exact
    size is computed only when the characters could reach it)."""
    if not props:
        return
    try:
        chars = sum(len(k) + len(v) + 2 for k, v in props.items())
    except TypeError:  # not str: the encoder says what is wrong
        return
    if chars * 4 <= limit:
        return
    size = len(encode_properties(props))
    if size > limit:
        raise InvalidMessageError(f"properties take {size} bytes, more than {limit} (the "
                                  "rest is kept for the broker's own properties)")


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
                 "born_ms", "reconsume", "prepared_offsets", "tag_codes", "headers")

    def __init__(self, topics, queue_ids, bodies: list, *, keys=None, tags=None,
                 properties=None, flags=0, born_ms=0, reconsume=0, prepared_offsets=-1,
                 tag_codes=None, headers=None):
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
        self.headers = headers
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
            shared_value(list(map(_get_topic, records))), shared_value(list(map(_get_qid, records))),
            list(map(_get_body, records)), keys=none_if_empty(list(map(_get_key, records))),
            tags=none_if_empty(list(map(_get_tags, records))),
            properties=none_if_empty(list(map(_get_props, records))),
            flags=shared_value(list(map(_get_flags, records))),
            born_ms=shared_value(list(map(_get_born, records))),
            reconsume=shared_value(list(map(_get_recon, records))),
            prepared_offsets=shared_value(list(map(_get_prep, records))),
            tag_codes=none_if_empty(list(map(_get_tagcode, records))),
            headers=none_if_empty(list(map(_get_headers, records))))

    def column(self, name: str) -> list:
        col = getattr(self, name)
        return col if isinstance(col, list) else [col] * len(self.bodies)

    def queues(self) -> set[tuple[str, int]]:
        """The (topic, queue id) pairs its records go to."""
        if isinstance(self.topics, list) or isinstance(self.queue_ids, list):
            return set(zip(self.column("topics"), self.column("queue_ids")))
        return {(self.topics, self.queue_ids)}

    def slice(self, lo: int, hi: int) -> "RecordBatch":
        if lo == 0 and hi == len(self.bodies):
            return self
        return RecordBatch(*(c[lo:hi] if isinstance(c, list) else c
                             for c in (getattr(self, s) for s in self.__slots__[:3])),
                           **{s: (c[lo:hi] if isinstance(c, list) else c)
                              for s, c in ((s, getattr(self, s)) for s in self.__slots__[3:])})

    _OPTIONAL = ("keys", "tags", "properties", "tag_codes", "headers")

    def with_records(self, records: Sequence[Record]) -> "RecordBatch":
        """This batch's records, then ``records``: ``concat`` without a batch of them first."""
        if not records:
            return self
        n = len(self.bodies)
        cols = []
        for name, get in _RECORD_GETTERS:
            mine, theirs = getattr(self, name), list(map(get, records))
            if name in self._OPTIONAL:
                if mine is None:
                    cols.append(None if theirs.count(None) == len(theirs)
                                else [None] * n + theirs)
                else:
                    cols.append(mine + theirs)
            elif name == "bodies":
                cols.append(mine + theirs)
            else:
                cols.append(shared_value((mine if isinstance(mine, list) else [mine] * n)
                                         + theirs))
        topics, qids, bodies, *rest = cols
        return RecordBatch(topics, qids, bodies, **dict(zip(self.__slots__[3:], rest)))

    @classmethod
    def concat(cls, batches: Sequence["RecordBatch"]) -> "RecordBatch":
        """One batch of all the records of ``batches``, in order."""
        if len(batches) == 1:
            return batches[0]
        cols = {}
        for name in cls.__slots__:
            values = [getattr(b, name) for b in batches]
            if name in cls._OPTIONAL and all(v is None for v in values):
                cols[name] = None
                continue
            merged = []
            for b, v in zip(batches, values):
                merged.extend(v if isinstance(v, list) else [v] * len(b))
            # optional columns stay lists (None there means "none for this record")
            cols[name] = merged if name == "bodies" or name in cls._OPTIONAL \
                else shared_value(merged)
        return cls(cols.pop("topics"), cols.pop("queue_ids"), cols.pop("bodies"), **cols)


def _rebuild_batch(*columns):
    batch = RecordBatch.__new__(RecordBatch)
    for name, value in zip(RecordBatch.__slots__, columns):
        setattr(batch, name, value)
    if len(columns) < len(RecordBatch.__slots__):  # (pickled before headers were a column)
        batch.headers = None
    return batch


def shared_value(values: list):
    """A single value when all are equal, else the list (a column of a ``RecordBatch``)."""
    first = values[0] if values else None
    if values and values.count(first) == len(values):
        return first
    return values


def none_if_empty(values: list):
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
_get_headers = attrgetter("headers")
#: Each column of a RecordBatch, with how to read it from a Record.
_RECORD_GETTERS = tuple(zip(RecordBatch.__slots__, (
    _get_topic, _get_qid, _get_body, _get_key, _get_tags, _get_props, _get_flags, _get_born,
    _get_recon, _get_prep, _get_tagcode, _get_headers)))
_TOPIC_DECODE: dict[bytes, str] = {}


def _encode_text(value: str, limit: int, what: str) -> bytes:
    if not isinstance(value, str):
        raise InvalidMessageError(f"{what} must be a str, got {type(value).__name__}")
    data = value.encode()
    if len(data) > limit:
        raise InvalidMessageError(f"{what} {value[:40]!r}... is longer than {limit} bytes")
    return data


def _texts(values: list | None, limit: int, what: str) -> list[bytes] | None:
    """An optional text column encoded (None stays None; an empty value is b"")."""
    if values is None:
        return None
    return [_encode_text(v, limit, what) if v else b"" for v in values]


def _optional_texts(values: list | None, n: int, limit: int, what: str):
    """(encoded list or None, lengths array or 0)."""
    out = _texts(values, limit, what)
    return out, _lengths(out, n)


def _keys(values: list | None, n: int):
    """The key column encoded: (list or None, which are binary or None).  A ``bytes`` key
    is kept as it is (``SysFlag.BINARY_KEY``), a ``str`` as UTF-8."""
    if values is None:
        return None, None
    out, binary = [], None
    for i, v in enumerate(values):
        if isinstance(v, (bytes, bytearray, memoryview)):
            v = bytes(v)
            if len(v) > MAX_KEY_BYTES:
                raise InvalidMessageError(f"key of {len(v)} bytes is longer than "
                                          f"{MAX_KEY_BYTES} bytes")
            if binary is None:
                binary = [False] * n
            binary[i] = True
            out.append(v)
        else:
            out.append(_encode_text(v, MAX_KEY_BYTES, "key") if v else b"")
    return out, binary


def _lengths(encoded: list | None, n: int):
    """The lengths of an encoded optional column (0: absent), for the column encoder."""
    return 0 if encoded is None else np.fromiter(map(len, encoded), np.int64, n)


_HEADER_BLOCK = struct.Struct("<IH")
_HEADER_NAME = struct.Struct("<H")
_HEADER_VALUE = struct.Struct("<i")


def encode_headers(headers) -> bytes:
    """A record's header block (``HEADER_BLOCK`` in the module's docstring); b"" for none.
    Bad headers raise ``InvalidMessageError`` saying which."""
    if not headers:
        return b""
    if isinstance(headers, (str, bytes, dict)) or not hasattr(headers, "__iter__"):
        raise InvalidMessageError("headers must be a list of (name, value) pairs, got "
                                  f"{type(headers).__name__}")
    parts, count = [], 0
    for item in headers:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InvalidMessageError(f"a header must be a (name, value) pair, got {item!r:.60}")
        name, value = item
        if not isinstance(name, str):
            raise InvalidMessageError(f"a header's name must be a str, got {name!r:.60}")
        name_b = name.encode()
        if len(name_b) > 0xFFFF:
            raise InvalidMessageError(f"header name {name[:40]!r}... is over 65535 bytes")
        parts += (_HEADER_NAME.pack(len(name_b)), name_b)
        if value is None:
            parts.append(_HEADER_VALUE.pack(-1))
        elif isinstance(value, (bytes, bytearray, memoryview)):
            parts += (_HEADER_VALUE.pack(len(value)), bytes(value))
        else:
            raise InvalidMessageError(f"header {name!r}'s value must be bytes or None, got "
                                      f"{type(value).__name__}")
        count += 1
    body = b"".join(parts)
    size = _HEADER_BLOCK.size + len(body)
    if size > MAX_HEADERS_BYTES or count > 0xFFFF:
        raise InvalidMessageError(f"headers take {size} bytes, more than {MAX_HEADERS_BYTES}")
    return _HEADER_BLOCK.pack(size, count) + body


def decode_headers(buf, pos: int) -> list[tuple[str, bytes | None]]:
    """The headers of the block at ``buf[pos:]``."""
    size, count = _HEADER_BLOCK.unpack_from(buf, pos)
    end, pos, out = pos + size, pos + _HEADER_BLOCK.size, []
    for _ in range(count):
        (k,) = _HEADER_NAME.unpack_from(buf, pos)
        name = bytes(buf[pos + 2:pos + 2 + k]).decode()
        (v,) = _HEADER_VALUE.unpack_from(buf, pos + 2 + k)
        pos += 6 + k
        if v < 0:
            out.append((name, None))
        else:
            out.append((name, bytes(buf[pos:pos + v])))
            pos += v
    if pos != end:
        raise FrameError(f"a header block's {count} headers end at {pos}, its length says {end}")
    return out


def _header_blocks(headers: list | None) -> list[bytes] | None:
    """The headers column encoded (None: absent)."""
    return None if headers is None else [encode_headers(h) for h in headers]


def _field_flags(flags: np.ndarray, binary: list | None,
                 blocks: list | None) -> tuple[np.ndarray, int]:
    """``flags`` with BINARY_KEY and HEADERS set as the records' own key and headers say
    (a copy of a stored record may come with either set), and the frame's version."""
    out = flags & ~np.uint32(FIELD_FLAGS)
    if binary is not None:
        out |= np.where(binary, np.uint32(SysFlag.BINARY_KEY), np.uint32(0))
    if blocks is not None:
        out |= np.where([bool(b) for b in blocks], np.uint32(SysFlag.HEADERS), np.uint32(0))
    return out, FRAME_VERSION_HEADERS if (out & FIELD_FLAGS).any() else FRAME_VERSION


def _topic_texts(topics: list[str]) -> list[bytes]:
    """A per-record topic column encoded (each distinct topic once)."""
    cache = {t: _encode_text(t, MAX_TOPIC_BYTES, "topic") for t in set(topics)}
    return list(map(cache.__getitem__, topics))


def _join_bodies(bodies: list) -> bytes:
    try:
        return b"".join(bodies)
    except TypeError:
        bad = next(b for b in bodies if not isinstance(b, (bytes, bytearray, memoryview)))
        raise InvalidMessageError(f"message body must be bytes, got {type(bad).__name__}") from None


def _frame_header(n: int, frame_len: int, store_ms: int, producer_id: int, sequence: int,
                  last: bool, headers: bytes, meta: bytes, body_blob: bytes,
                  version: int = FRAME_VERSION) -> bytes:
    """The frame header: its CRC covers the header fields after the CRC and every region."""
    attrs = FRAME_ATTR_LAST if last else 0
    tail = FRAME.pack(0, 0, 0, version, attrs, 0, n, store_ms, producer_id,
                      sequence)[FRAME_CRC_START:]
    crc = zlib.crc32(body_blob, zlib.crc32(meta, zlib.crc32(headers, zlib.crc32(tail))))
    return FRAME.pack(FRAME_MAGIC, frame_len, crc, version, attrs, 0, n, store_ms,
                      producer_id, sequence)


def _int_column(col, n: int, dtype):
    if isinstance(col, list):
        return np.fromiter(col, dtype, n)
    return col


_TEMPLATE_DEFAULTS = {"queue_id": 0, "flags": 0, "born_ms": 0, "prepared_offset": -1,
                      "reconsume": 0}
_TEMPLATE = np.zeros(1, REC_DTYPE)
for _field, _value in _TEMPLATE_DEFAULTS.items():
    _TEMPLATE[_field] = _value
_TEMPLATE.flags.writeable = False


@dataclass(frozen=True, slots=True)
class EncodedFrame:
    parts: tuple  # frame header, record headers, meta region, body region
    size: int
    rel_offsets: np.ndarray  # record header, relative to the frame start
    rec_lens: np.ndarray     # record size: header to end of body
    tag_codes: np.ndarray


def encode_frame(batch: RecordBatch, queue_offsets: np.ndarray, store_ms: int,
                 body_lens: np.ndarray | None = None, *, producer_id: int = 0,
                 sequence: int = 0, last: bool = True) -> EncodedFrame:
    """Encode ``batch`` (bodies already checked for size) into one frame."""
    n = len(batch.bodies)
    if n <= SMALL_FRAME_RECORDS:
        try:
            return _encode_small_frame(batch, queue_offsets, store_ms, body_lens,
                                       producer_id, sequence, last)
        except struct.error:
            pass  # a value out of range: the column path below says which
    return _encode_column_frame(batch, queue_offsets, store_ms, body_lens, producer_id,
                                sequence, last)


def _encode_column_frame(batch: RecordBatch, queue_offsets, store_ms: int, body_lens,
                         producer_id: int, sequence: int, last: bool) -> EncodedFrame:
    """``encode_frame`` in columns: a handful of numpy calls whatever the record count."""
    n = len(batch.bodies)
    bodies = batch.bodies
    if body_lens is None:
        body_lens = np.array(list(map(len, bodies)), np.int64)
    keys_b, binary = _keys(batch.keys, n)
    key_lens = _lengths(keys_b, n)
    tags_b, tags_lens = _optional_texts(batch.tags, n, MAX_TAGS_BYTES, "tags")
    blocks = _header_blocks(batch.headers)
    block_lens = _lengths(blocks, n)
    props = batch.properties
    if props is None:
        props_b, props_lens = None, 0
    else:
        props_b = encode_properties_list(props)
        props_lens = np.full(n, len(props_b[0]), np.int64) \
            if props_b.count(props_b[0]) == n else np.fromiter(map(len, props_b), np.int64, n)

    headers_end = FRAME_HEADER_BYTES + n * REC_HEADER_BYTES
    meta, meta_off, topic_lens = _column_meta(batch.topics, n, headers_end,
                                              (keys_b, tags_b, props_b, blocks),
                                              (key_lens, tags_lens, props_lens, block_lens))
    body_blob = _join_bodies(bodies)
    bodies_start = headers_end + len(meta)
    body_off = _starts(body_lens, bodies_start, n)
    rel = np.arange(FRAME_HEADER_BYTES, headers_end, REC_HEADER_BYTES, dtype=np.int64)
    tag_codes = _column_tag_codes(batch, tags_b, n)

    h = np.repeat(_TEMPLATE, n)
    h["queue_offset"] = queue_offsets
    h["store_ms"] = store_ms
    h["frame_delta"] = rel
    h["meta_off"] = meta_off
    h["topic_len"] = topic_lens
    h["body_off"] = body_off
    h["body_len"] = body_lens
    _set_optional_columns(h, batch, n, tag_codes, (("key_len", key_lens),
                                                   ("tags_len", tags_lens),
                                                   ("props_len", props_lens)))
    version = FRAME_VERSION
    if binary is not None or blocks is not None or (h["flags"] & FIELD_FLAGS).any():
        h["flags"], version = _field_flags(h["flags"], binary, blocks)
    headers = h.tobytes()
    frame_len = bodies_start + len(body_blob)
    header = _frame_header(n, frame_len, store_ms, producer_id, sequence, last, headers, meta,
                           body_blob, version)
    rec_lens = body_off + body_lens - rel
    return EncodedFrame((header, headers, meta, body_blob), frame_len, rel, rec_lens, tag_codes)


def _column_meta(topics, n: int, headers_end: int, optional: tuple, optional_lens: tuple):
    """The meta region of a column frame: (bytes, each record's meta offset, topic lengths).

    ``optional`` are the encoded keys, tags, properties and header blocks (None:
    absent), ``optional_lens`` their lengths (0 when absent).
    """
    shared_topic = isinstance(topics, str)
    if shared_topic:
        topic_b = _encode_text(topics, MAX_TOPIC_BYTES, "topic")
        topic_lens: np.ndarray | int = len(topic_b)
        topics_b = None
    else:
        topics_b = _topic_texts(topics)
        topic_lens = np.fromiter(map(len, topics_b), np.int64, n)

    if shared_topic and all(c is None for c in optional):
        return topic_b, headers_end, topic_lens  # every record points at the one copy
    columns = [c for c in ([topic_b] * n if shared_topic else topics_b, *optional)
               if c is not None]
    meta = b"".join(chain.from_iterable(zip(*columns)))
    meta_lens = topic_lens + sum(optional_lens)
    return meta, _starts(meta_lens, headers_end, n), topic_lens


def _starts(lens: np.ndarray, first: int, n: int) -> np.ndarray:
    """Where each of ``n`` regions of ``lens`` bytes starts, laid back to back from ``first``."""
    out = np.empty(n, np.int64)
    out[0] = first
    np.cumsum(lens[:-1], out=out[1:])
    out[1:] += first
    return out


def _column_tag_codes(batch: RecordBatch, tags_b: list | None, n: int) -> np.ndarray:
    """Each record's tag code: the given one, else the hash of its tags (0: none)."""
    tag_given = batch.tag_codes
    if tag_given is None:
        if tags_b is None:
            return np.zeros(n, np.int64)
        return np.fromiter(map(tags_hash, batch.tags), np.int64, n)
    if batch.tags is None and None not in tag_given:  # (e.g. a batch of timer records)
        return np.array(tag_given, np.int64)
    tags_list = batch.column("tags")
    return np.fromiter(
        (t if t is not None else tags_hash(s) for t, s in zip(tag_given, tags_list)),
        np.int64, n)


def _set_optional_columns(h: np.ndarray, batch: RecordBatch, n: int, tag_codes: np.ndarray,
                          optional_lens: tuple) -> None:
    """Set the header fields that may keep the template's value: the batch's integer
    columns where not the default, tag codes where any, lengths of present fields."""
    for field, col, dt in (("queue_id", batch.queue_ids, np.uint32),
                           ("flags", batch.flags, np.uint32),
                           ("born_ms", batch.born_ms, np.int64),
                           ("prepared_offset", batch.prepared_offsets, np.int64),
                           ("reconsume", batch.reconsume, np.uint32)):
        if isinstance(col, list) or col != _TEMPLATE_DEFAULTS[field]:
            h[field] = _int_column(col, n, dt)
    if tag_codes.any():
        h["tag_code"] = tag_codes
    for field, lens in optional_lens:
        if not isinstance(lens, int):
            h[field] = lens


#: Frames of at most this many records are encoded record by record with ``struct``:
#: the column path costs ~0.1 ms of numpy calls however few the records are.
SMALL_FRAME_RECORDS = 16
_REC = struct.Struct("<IIqqqqqIIIHHHIII")  # REC_DTYPE's layout, field for field
assert _REC.size == REC_HEADER_BYTES


def _encode_small_frame(batch: RecordBatch, queue_offsets, store_ms: int, body_lens,
                        producer_id: int, sequence: int, last: bool) -> EncodedFrame:
    """``encode_frame`` for a few records: the same bytes, without numpy per field."""
    n = len(batch.bodies)
    bodies = batch.bodies
    blens = list(map(len, bodies)) if body_lens is None else \
        (body_lens.tolist() if isinstance(body_lens, np.ndarray) else list(body_lens))
    if isinstance(batch.topics, str):
        topics_b = [_encode_text(batch.topics, MAX_TOPIC_BYTES, "topic")] * n
        shared_topic = True
    else:
        topics_b = _topic_texts(batch.topics)
        shared_topic = False
    keys_b, binary = _keys(batch.keys, n)
    tags_b = _texts(batch.tags, MAX_TAGS_BYTES, "tags")
    props_b = None if batch.properties is None else encode_properties_list(batch.properties)
    blocks = _header_blocks(batch.headers)
    headers_end = FRAME_HEADER_BYTES + n * REC_HEADER_BYTES
    meta, meta_offs = _small_meta(shared_topic, topics_b, (keys_b, tags_b, props_b, blocks),
                                  headers_end, n)
    body_blob = _join_bodies(bodies)
    tags_list = batch.tags if batch.tags is not None else [None] * n
    if batch.tag_codes is None:
        tag_codes = [tags_hash(t) for t in tags_list] if tags_b is not None else [0] * n
    else:
        tag_codes = [t if t is not None else tags_hash(s)
                     for t, s in zip(batch.tag_codes, tags_list)]
    qids, flags, born = batch.column("queue_ids"), batch.column("flags"), batch.column("born_ms")
    version = FRAME_VERSION
    if binary is not None or blocks is not None or any(f & FIELD_FLAGS for f in flags):
        flags, version = _field_flags(np.array(flags, np.uint32), binary, blocks)
        flags = flags.tolist()
    prepared, reconsume = batch.column("prepared_offsets"), batch.column("reconsume")
    qoffs = queue_offsets.tolist() if isinstance(queue_offsets, np.ndarray) else queue_offsets
    body_at = headers_end + len(meta)
    headers, rel, rec_lens = [], [], []
    for i in range(n):
        delta = FRAME_HEADER_BYTES + i * REC_HEADER_BYTES
        headers.append(_REC.pack(
            qids[i], flags[i], qoffs[i], born[i], store_ms, prepared[i], tag_codes[i],
            reconsume[i], delta, meta_offs[i], len(topics_b[i]),
            len(keys_b[i]) if keys_b is not None else 0,
            len(tags_b[i]) if tags_b is not None else 0,
            len(props_b[i]) if props_b is not None else 0, body_at, blens[i]))
        rel.append(delta)
        rec_lens.append(body_at + blens[i] - delta)
        body_at += blens[i]
    headers_b = b"".join(headers)
    frame_len = headers_end + len(meta) + len(body_blob)
    header = _frame_header(n, frame_len, store_ms, producer_id, sequence, last, headers_b, meta,
                           body_blob, version)
    return EncodedFrame((header, headers_b, meta, body_blob), frame_len,
                        np.array(rel, np.int64), np.array(rec_lens, np.int64),
                        np.array(tag_codes, np.int64))


def _small_meta(shared_topic: bool, topics_b: list, optional: tuple, headers_end: int,
                n: int) -> tuple[bytes, list[int]]:
    """The meta region of a small frame and where each record's meta starts."""
    if shared_topic and all(c is None for c in optional):
        return topics_b[0], [headers_end] * n  # every record points at the one copy
    columns = [c for c in (topics_b, *optional) if c is not None]
    per_record = [b"".join(parts) for parts in zip(*columns)]
    meta_offs, at = [], headers_end
    for m in per_record:
        meta_offs.append(at)
        at += len(m)
    return b"".join(per_record), meta_offs


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
    magic, frame_len, crc, version, _attrs, _res, count, _store, _pid, _seq = \
        FRAME.unpack_from(buf, pos)
    if magic != FRAME_MAGIC:
        raise FrameError(f"bad frame magic {magic:#x}")
    if version != FRAME_VERSION and version != FRAME_VERSION_HEADERS:
        raise FrameError(f"unknown frame version {version}", frame_len)
    if frame_len < FRAME_HEADER_BYTES or pos + frame_len > end:
        raise FrameError(f"frame length {frame_len} runs past the end ({end - pos} bytes left)",
                         frame_len)
    actual = zlib.crc32(memoryview(buf)[pos + FRAME_CRC_START:pos + frame_len])
    if actual != crc:
        raise FrameError(f"CRC mismatch (stored {crc:#010x}, computed {actual:#010x})", frame_len)
    return frame_len, count


def frame_producer(buf, pos: int) -> tuple[int, int, int, int]:
    """(producer_id, sequence, store_ms, attrs) of the frame at ``buf[pos:]``."""
    fields = FRAME.unpack_from(buf, pos)
    return fields[8], fields[9], fields[7], fields[4]


def frame_headers(buf, pos: int, count: int) -> np.ndarray:
    """The record headers of the checked frame at ``buf[pos:]`` (a copy)."""
    return np.frombuffer(buf, REC_DTYPE, count, pos + FRAME_HEADER_BYTES).copy()


def record_sizes(h: np.ndarray) -> np.ndarray:
    """Size of each record (header to end of body) from its header."""
    return h["body_off"].astype(np.int64) + h["body_len"] - h["frame_delta"]


class MessageBatch:
    """Messages read back, in columns: what the broker returns to a pull.

    ``headers`` is the structured array of record headers (queue offsets,
    flags, timestamps...), the rest are lists.  Objects per message are made
    only when a reader asks (``messages()``, indexing, iteration).
    """

    __slots__ = ("headers", "phys_offsets", "topics", "keys", "tags", "properties", "bodies",
                 "record_headers")

    def __init__(self, headers, phys_offsets, topics, keys, tags, properties, bodies,
                 record_headers=None):
        self.headers = headers
        self.phys_offsets = phys_offsets
        self.topics = topics
        self.keys = keys
        self.tags = tags
        self.properties = properties
        self.bodies = bodies
        self.record_headers = record_headers  # each record's own headers (None: none has)

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
            int(h["body_off"]) + int(h["body_len"]) - int(h["frame_delta"]), int(h["flags"]), int(h["born_ms"]), int(h["store_ms"]),
            int(h["prepared_offset"]), int(h["tag_code"]), int(h["reconsume"]),
            self.keys[i] if self.keys else None, self.tags[i] if self.tags else None,
            self.properties[i] if self.properties else b"", self.bodies[i],
            self.record_headers[i] if self.record_headers else None)

    def messages(self) -> list[StoredMessage]:
        n = len(self.bodies)
        h = self.headers
        return list(map(StoredMessage, self.topics, h["queue_id"].tolist(),
                        h["queue_offset"].tolist(), self.phys_offsets,
                        record_sizes(h).tolist(),
                        h["flags"].tolist(), h["born_ms"].tolist(), h["store_ms"].tolist(),
                        h["prepared_offset"].tolist(), h["tag_code"].tolist(),
                        h["reconsume"].tolist(), self.keys or [None] * n,
                        self.tags or [None] * n, self.properties or [b""] * n, self.bodies,
                        self.record_headers or [None] * n))

    __iter__ = lambda self: iter(self.messages())  # noqa: E731


def decode_records(buf: bytes, rel_offsets: np.ndarray, phys_offsets: list[int]) -> MessageBatch:
    """Decode the records whose headers sit at ``rel_offsets`` in ``buf``.

    ``buf`` must hold each record whole: header, meta fields and body.
    """
    if not len(rel_offsets):
        return MessageBatch.empty()
    return RecordSpans.read(buf, rel_offsets, phys_offsets).decode()


def _decode(buf: bytes, h: np.ndarray, at: "FieldBounds", phys_offsets) -> MessageBatch:
    def cut(starts, ends, text: bool):
        if text:
            return [buf[a:b].decode() if b > a else None
                    for a, b in zip(starts.tolist(), ends.tolist())]
        return [buf[a:b] for a, b in zip(starts.tolist(), ends.tolist())]
    topics = _decode_topics(np.frombuffer(buf, np.uint8), buf, at.topic, h["topic_len"])
    field_flags = h["flags"] & FIELD_FLAGS
    binary = np.flatnonzero(field_flags & SysFlag.BINARY_KEY) if field_flags.any() else ()
    if len(binary):
        keys = [buf[a:b] for a, b in zip(at.key.tolist(), at.tags.tolist())]
        for i in set(range(len(keys))) - set(binary.tolist()):
            keys[i] = keys[i].decode() if keys[i] else None
    else:
        keys = cut(at.key, at.tags, True) if h["key_len"].any() else None
    tags = cut(at.tags, at.props, True) if h["tags_len"].any() else None
    props = cut(at.props, at.props_end, False) if h["props_len"].any() else None
    record_headers = None
    if field_flags.any() and (field_flags & SysFlag.HEADERS).any():
        record_headers = [decode_headers(buf, a) if f & SysFlag.HEADERS else None
                          for a, f in zip(at.props_end.tolist(), field_flags.tolist())]
    return MessageBatch(h, list(phys_offsets), topics, keys, tags, props,
                        cut(at.body, at.body_end, False), record_headers)


@dataclass(frozen=True)
class FieldBounds:
    """Where each record's fields start in a buffer of whole records (numpy int64 arrays):
    its topic at ``topic``, key at ``key``, tags at ``tags``, properties at ``props``, each
    running to the next field's start; its body from ``body`` to ``body_end``."""

    topic: np.ndarray
    key: np.ndarray
    tags: np.ndarray
    props: np.ndarray
    props_end: np.ndarray
    body: np.ndarray
    body_end: np.ndarray

    @classmethod
    def of(cls, h: np.ndarray, rel: np.ndarray) -> "FieldBounds":
        frame = rel - h["frame_delta"]
        t0 = frame + h["meta_off"]
        k0 = t0 + h["topic_len"]
        g0 = k0 + h["key_len"]
        p0 = g0 + h["tags_len"]
        b0 = frame + h["body_off"]
        return cls(t0, k0, g0, p0, p0 + h["props_len"], b0, b0 + h["body_len"])


class RecordSpans:
    """Records as read from the log, undecoded: the buffer holding them whole, where each
    one's header sits in it (``rel``), the headers and the physical offsets.  What a
    columnar reader takes (``raymq.jobs.schema`` cuts Arrow columns straight out of the
    buffer): no Python object per message on either side of the wire."""

    __slots__ = ("buf", "rel", "headers", "phys_offsets")

    def __init__(self, buf: bytes, rel: np.ndarray, headers: np.ndarray,
                 phys_offsets: np.ndarray):
        self.buf = buf
        self.rel = rel
        self.headers = headers
        self.phys_offsets = phys_offsets

    def __reduce_ex__(self, protocol):
        # (the headers are in the buffer: read again, not sent twice; with pickle 5 the
        # buffer may travel out of band: the data channel sends it as a frame of its own)
        buf = pickle.PickleBuffer(self.buf) if protocol >= 5 else bytes(self.buf)
        return (RecordSpans.read, (buf, self.rel, self.phys_offsets))

    @classmethod
    def read(cls, buf: bytes, rel_offsets, phys_offsets) -> "RecordSpans":
        """The records whose headers sit at ``rel_offsets`` in ``buf``."""
        if not len(rel_offsets):
            return cls.empty()
        raw = np.frombuffer(buf, np.uint8)
        rel = np.asarray(rel_offsets, np.int64)
        window = as_strided(raw, shape=(len(raw) - REC_HEADER_BYTES + 1, REC_HEADER_BYTES),
                            strides=(1, 1), writeable=False)
        return cls(buf, rel, window[rel].view(REC_DTYPE).reshape(len(rel)),
                   np.asarray(phys_offsets, np.uint64))

    @classmethod
    def empty(cls) -> "RecordSpans":
        return cls(b"", np.zeros(0, np.int64), np.empty(0, REC_DTYPE), np.zeros(0, np.uint64))

    def __len__(self) -> int:
        return len(self.rel)

    @property
    def queue_offsets(self) -> np.ndarray:
        return self.headers["queue_offset"]

    @property
    def bounds(self) -> FieldBounds:
        return FieldBounds.of(self.headers, self.rel)

    def select(self, keep) -> "RecordSpans":
        """Only the records at indexes ``keep`` (or where a boolean mask is true)."""
        return RecordSpans(self.buf, self.rel[keep], self.headers[keep], self.phys_offsets[keep])

    def compact(self) -> "RecordSpans":
        """The same records in a buffer of only their bytes (a read of one queue also gets
        the records of others written between its own): per frame, from its first such
        record's header to the end of its last one's body (the frame's headers, meta
        fields and bodies lie in that order)."""
        rel, n = self.rel, len(self.rel)
        if n < 2 or not (np.diff(rel) > 0).all():
            return self
        frame = rel - self.headers["frame_delta"]
        first = np.flatnonzero(np.r_[True, frame[1:] != frame[:-1]])
        lo = rel[first]
        hi = np.maximum.reduceat(self.bounds.body_end, first)
        if int((hi - lo).sum()) * 4 > len(self.buf) * 3:
            return self  # (little to gain)
        moved = np.zeros(len(first), np.int64)
        np.cumsum((hi - lo)[:-1], out=moved[1:])
        group = np.repeat(np.arange(len(first)), np.diff(np.r_[first, n]))
        with memoryview(self.buf) as view:
            buf = b"".join(view[a:b] for a, b in zip(lo.tolist(), hi.tolist()))
        return RecordSpans(buf, rel - lo[group] + moved[group], self.headers, self.phys_offsets)

    def decode(self) -> MessageBatch:
        if not len(self.rel):
            return MessageBatch.empty()
        buf = self.buf if isinstance(self.buf, bytes) else bytes(self.buf)  # (out of band)
        return _decode(buf, self.headers, self.bounds, self.phys_offsets.tolist())


def _decode_topics(raw: np.ndarray, buf: bytes, starts: np.ndarray,
                   lens: np.ndarray) -> list[str]:
    n = len(starts)
    a0 = int(starts[0])
    first = buf[a0:a0 + int(lens[0])]
    topic = _TOPIC_DECODE.get(first)
    if topic is None:
        if len(_TOPIC_DECODE) > 4096:
            _TOPIC_DECODE.clear()
        topic = _TOPIC_DECODE[first] = first.decode()
    tl = len(first)
    if tl and (lens == tl).all():
        window = as_strided(raw, shape=(len(raw) - tl + 1, tl), strides=(1, 1), writeable=False)
        if (window[starts] == np.frombuffer(first, np.uint8)).all():
            return [topic] * n
    out = []
    for a, b in zip(starts.tolist(), (starts + lens).tolist()):
        tb = buf[a:b]
        name = _TOPIC_DECODE.get(tb)
        if name is None:
            name = _TOPIC_DECODE[tb] = tb.decode()
        out.append(name)
    return out
