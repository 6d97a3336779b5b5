"""Messages as applications see them: what a producer sends and a consumer gets.

Pure logic: no Ray.  ``to_batch`` turns the messages of one producer request
into the columnar ``RecordBatch`` that crosses the Ray call.
"""
from __future__ import annotations

import enum
import time
import zlib
from dataclasses import dataclass
from operator import attrgetter, itemgetter

import numpy as np

from raymq.storage.errors import InvalidMessageError, ReservedNameError
from raymq.actors.front.admission import (DEFAULT_MAX_DELAY_MS, key_problem,
                                          properties_problem, text_problem)
# the client's names for what it shares with the broker (users import them from here)
from raymq.actors.protocol import (CHECK_EXPIRED_TOPIC, DLQ_PREFIX, HALF_TOPIC, ISOLATIONS,  # noqa: F401
                                   OP_TOPIC, RETRY_PREFIX, SCHEDULE_TOPIC, SYSTEM_PROPERTIES,
                                   SYSTEM_TOPICS, Prop, check_group, check_user_topic, dlq_topic,
                                   is_system_topic, make_msg_id, parse_msg_id, retry_topic)
from raymq.storage.records import (MAX_KEY_BYTES, MAX_TAGS_BYTES, MessageBatch, RecordBatch,
                                   StoredMessage, SysFlag, check_user_properties,
                                   decode_properties, encode_headers, shared_value)

# --- application messages ----------------------------------------------------------
@dataclass
class Message:
    """A message to send.  One of ``delay_level`` (1-based), ``deliver_at_ms`` (epoch ms;
    a time not ahead delivers now) or ``deliver_after_ms`` (from when the shard stores it,
    or from the commit of a transactional message) delays it, up to ``max_delay_ms``.
    ``key`` is text or bytes (a Kafka client's binary key); ``headers`` are
    ``[(name, value bytes or None)]``, repeats and order kept (what Kafka clients see as a
    record's headers)."""

    topic: str
    body: bytes
    key: str | bytes | None = None
    tags: str | None = None
    properties: dict[str, str] | None = None
    delay_level: int = 0
    deliver_at_ms: int | None = None
    deliver_after_ms: int | None = None
    transaction_id: str | None = None  # set by the transaction producer
    headers: list[tuple[str, bytes | None]] | None = None

    def validate(self, max_bytes: int, num_levels: int,
                 max_delay_ms: int = DEFAULT_MAX_DELAY_MS) -> None:
        check_user_topic(self.topic)
        if not isinstance(self.body, (bytes, bytearray)):
            raise InvalidMessageError(f"message body must be bytes, got {type(self.body).__name__}")
        if len(self.body) > max_bytes:
            raise InvalidMessageError(
                f"message body of {len(self.body)} bytes exceeds the maximum of {max_bytes} bytes")
        # what the store would refuse is refused here: the message never joins (and fails)
        # a request shared with other callers' messages
        for why in (key_problem(self.key), text_problem(self.tags, MAX_TAGS_BYTES, "tags")):
            if why:
                raise InvalidMessageError(why)
        if self.headers:
            encode_headers(self.headers)  # (raises saying what is wrong)
        if self.properties:
            if not isinstance(self.properties, dict):
                raise InvalidMessageError("properties must be a dict of str to str")
            clash = sorted(set(self.properties) & SYSTEM_PROPERTIES)
            if clash:
                raise ReservedNameError(f"properties {clash} are reserved system properties")
            check_user_properties(self.properties)
            why = properties_problem(self.properties, num_levels, SYSTEM_PROPERTIES)
            if why:
                raise InvalidMessageError(why)
        if isinstance(self.delay_level, bool) or not isinstance(self.delay_level, int) \
                or not 0 <= self.delay_level <= num_levels:
            raise InvalidMessageError(f"delay_level must be 0..{num_levels}, got {self.delay_level!r}")
        check_schedule(self.delay_level, self.deliver_at_ms, self.deliver_after_ms,
                       max_delay_ms)


def check_schedule(delay_level, deliver_at_ms, deliver_after_ms, max_delay_ms: int) -> None:
    """Refuse a message's delay: more than one kind, a bad value, past ``max_delay_ms``
    (refused here as well as by the shard: the sender learns at once)."""
    if deliver_at_ms is None and deliver_after_ms is None:
        return
    if bool(delay_level) + (deliver_at_ms is not None) + (deliver_after_ms is not None) > 1:
        raise InvalidMessageError("give one of delay_level, deliver_at_ms and "
                                  "deliver_after_ms")
    for name, value in (("deliver_at_ms", deliver_at_ms),
                        ("deliver_after_ms", deliver_after_ms)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise InvalidMessageError(f"{name} must be a non-negative int of milliseconds, "
                                      f"got {value!r}")
    if deliver_after_ms is not None and deliver_after_ms > max_delay_ms:
        raise InvalidMessageError(f"deliver_after_ms {deliver_after_ms} is more than "
                                  f"max_delay_ms ({max_delay_ms})")
    if deliver_at_ms is not None and deliver_at_ms > time.time() * 1000 + max_delay_ms:
        raise InvalidMessageError(f"deliver_at_ms {deliver_at_ms} is more than "
                                  f"max_delay_ms ({max_delay_ms}) ahead")


_ATTRS = ("topic", "body", "key", "tags", "properties", "delay_level", "deliver_at_ms",
          "deliver_after_ms", "headers")
_GETTERS = {name: attrgetter(name) for name in _ATTRS}
_NONE = type(None)


class Columns:
    """The fields of many messages as lists (extracted once, C-level passes)."""

    __slots__ = _ATTRS + ("n",)

    def __init__(self, messages: list["Message"]):
        self.n = len(messages)
        for name in _ATTRS:
            setattr(self, name, list(map(_GETTERS[name], messages)))

    def has(self, name: str, empty=None) -> bool:
        col = getattr(self, name)
        return col.count(empty) != self.n


def validate_messages(messages: list["Message"], max_bytes: int, num_levels: int,
                      cols: Columns | None = None,
                      max_delay_ms: int = DEFAULT_MAX_DELAY_MS) -> Columns:
    """``Message.validate`` for many messages in a few passes; returns their columns."""
    cols = cols or Columns(messages)
    for topic in set(cols.topic):
        check_user_topic(topic)
    suspicious = (set(map(type, cols.body)) != {bytes}
                  or (cols.n and max(map(len, cols.body)) > max_bytes)
                  or (cols.has("key") and not _plain_texts(cols.key, MAX_KEY_BYTES))
                  or (cols.has("tags") and not _plain_texts(cols.tags, MAX_TAGS_BYTES))
                  or cols.properties.count(None) + cols.properties.count({}) != cols.n
                  or cols.has("delay_level", 0) or cols.has("headers"))
    if suspicious:
        for m in messages:
            m.validate(max_bytes, num_levels, max_delay_ms)
        cols.body = [b if type(b) is bytes else bytes(b) for b in cols.body]
    elif cols.has("deliver_at_ms") or cols.has("deliver_after_ms"):
        try:
            whens = set(zip(cols.deliver_at_ms, cols.deliver_after_ms))  # (no delay level)
        except TypeError:  # an unhashable value: each message says what is wrong
            whens = list(zip(cols.deliver_at_ms, cols.deliver_after_ms))
        for when in whens:
            check_schedule(0, *when, max_delay_ms)
    return cols


def _plain_texts(values: list, limit: int) -> bool:
    """Whether every value is None or short ASCII text (then no closer look is needed)."""
    return all(v is None or (type(v) is str and len(v) <= limit and v.isascii())
               for v in values)


class SendStatus(enum.Enum):
    SEND_OK = "SEND_OK"
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"
    FLUSH_SLAVE_TIMEOUT = "FLUSH_SLAVE_TIMEOUT"
    SLAVE_NOT_AVAILABLE = "SLAVE_NOT_AVAILABLE"


class SendResult(tuple):
    """RocketMQ's send result: status, msg_id, queue_id, queue_offset (and topic).

    A light tuple: producers make one per message, and the message id is
    formatted only when read.
    """

    __slots__ = ()

    def __new__(cls, status: SendStatus, msg_id: str, queue_id: int, queue_offset: int,
                topic: str = ""):
        return tuple.__new__(cls, (status, msg_id, queue_id, queue_offset, topic, -1, -1))

    @classmethod
    def located(cls, status: SendStatus, shard: int, phys: int, queue_id: int,
                queue_offset: int, topic: str) -> "SendResult":
        return tuple.__new__(cls, (status, None, queue_id, queue_offset, topic, shard, phys))

    status = property(itemgetter(0))
    queue_id = property(itemgetter(2))
    queue_offset = property(itemgetter(3))
    topic = property(itemgetter(4))
    #: where the shard stored it (None/-1 when not known: a duplicate's lost offsets)
    shard = property(itemgetter(5))
    phys_offset = property(itemgetter(6))

    @property
    def msg_id(self) -> str:
        return self[1] if self[1] is not None else make_msg_id(self[5], self[6])

    def __repr__(self) -> str:
        return (f"SendResult(status={self.status.value}, msg_id={self.msg_id!r}, "
                f"queue_id={self.queue_id}, queue_offset={self.queue_offset}, topic={self.topic!r})")

    def __reduce__(self):
        return (tuple.__new__, (SendResult, tuple(self)))


class MessageExt:
    """A consumed message.

    ``msg_id`` is the id the producer got back (a retry copy keeps the
    original's); ``stored_id`` names this stored copy; ``topic`` is the
    original topic also for retry copies (``source_topic`` is where it was
    read from).  Properties are decoded on first access.
    """

    __slots__ = ("topic", "queue_id", "queue_offset", "body", "key", "tags", "_props",
                 "reconsume_count", "born_ms", "store_ms", "shard", "phys", "source_topic",
                 "source_queue", "source_offset", "headers")

    def __init__(self, topic, queue_id, queue_offset, body, key, tags, props, reconsume_count,
                 born_ms, store_ms, shard, phys, source_topic, source_queue, source_offset,
                 headers=None):
        self.topic = topic
        self.queue_id = queue_id
        self.queue_offset = queue_offset
        self.body = body
        self.key = key
        self.tags = tags
        self._props = props
        self.reconsume_count = reconsume_count
        self.born_ms = born_ms
        self.store_ms = store_ms
        self.shard = shard
        self.phys = phys
        self.source_topic = source_topic
        self.source_queue = source_queue
        self.source_offset = source_offset
        self.headers = headers  # [(name, bytes or None)], or None

    @property
    def properties(self) -> dict[str, str]:
        props = self._props
        if not isinstance(props, dict):
            props = decode_properties(props) if props else {}
            if self.source_topic.startswith(RETRY_PREFIX):
                props.pop(Prop.RETRY_TOPIC, None)
                props.pop(Prop.CONSUME_GROUP, None)
            self._props = props
        return props

    @property
    def stored_id(self) -> str:
        return make_msg_id(self.shard, self.phys)

    @property
    def transaction_id(self) -> str | None:
        return self.properties.get(Prop.TRANSACTION_ID) if self._props else None

    @property
    def msg_id(self) -> str:
        """The id the producer was given (retry copies and committed transactional
        messages carry it as a property)."""
        if self._props:
            origin = self.properties.get(Prop.PRODUCER_MSG_ID)
            if origin:
                return origin
        return make_msg_id(self.shard, self.phys)

    def __repr__(self) -> str:
        return (f"MessageExt(msg_id={self.msg_id!r}, topic={self.topic!r}, "
                f"queue_id={self.queue_id}, queue_offset={self.queue_offset}, key={self.key!r}, "
                f"tags={self.tags!r}, reconsume_count={self.reconsume_count}, "
                f"body={self.body[:32]!r})")

    def __reduce__(self):
        return (MessageExt, tuple(getattr(self, s) for s in self.__slots__))

    @classmethod
    def from_stored(cls, shard: int, m: StoredMessage) -> "MessageExt":
        return messages_ext(shard, [m])[0]


def messages_ext(shard: int, msgs) -> list[MessageExt]:
    """Consumer-side messages from stored ones (a ``MessageBatch`` or a list)."""
    if isinstance(msgs, MessageBatch):
        n = len(msgs)
        if not n:
            return []
        h = msgs.headers
        topics = msgs.topics
        qids = h["queue_id"].tolist()
        qoffs = h["queue_offset"].tolist()
        out = list(map(MessageExt, topics, qids, qoffs, msgs.bodies, msgs.keys or [None] * n,
                       msgs.tags or [None] * n, msgs.properties or [b""] * n,
                       h["reconsume"].tolist(), h["born_ms"].tolist(), h["store_ms"].tolist(),
                       [shard] * n, msgs.phys_offsets, topics, qids, qoffs,
                       msgs.record_headers or [None] * n))
    else:
        out = [MessageExt(m.topic, m.queue_id, m.queue_offset, m.body, m.key, m.tags,
                          m.properties, m.reconsume_count, m.born_ms, m.store_ms, shard,
                          m.phys_offset, m.topic, m.queue_id, m.queue_offset, m.headers)
               for m in msgs]
    topics = set(msgs.topics) if isinstance(msgs, MessageBatch) else {m.topic for m in msgs}
    if not any(t.startswith(RETRY_PREFIX) for t in topics):
        return out
    for m in out:
        if m.source_topic.startswith(RETRY_PREFIX):
            raw = m._props
            props = raw if isinstance(raw, dict) else decode_properties(raw) if raw else {}
            m.topic = props.get(Prop.RETRY_TOPIC, m.topic)
            m.queue_id = m.queue_offset = -1
    return out


def key_queue(key: str | bytes, num_queues: int) -> int:
    """Same key -> same queue (stable across processes; a text key and its UTF-8 bytes go
    to the same queue)."""
    return zlib.crc32(key.encode() if isinstance(key, str) else key) % num_queues


def assign_queues(cols: Columns, routes: dict[str, list[int]], next_rr, chunk: int):
    """Queue id and shard (two int arrays) of every message of ``cols``.

    A key picks its queue by hash (same key, same queue, order kept).  Messages of one
    topic without keys are spread round-robin -- one queue per ``chunk`` messages of the
    batch (Kafka's sticky partitioning: whole batches, fewer and larger requests);
    otherwise one queue per keyless message.  ``next_rr(topic, count)`` reserves
    ``count`` round-robin slots of a topic and returns the first.
    """
    n = cols.n
    if len(set(cols.topic)) == 1 and not cols.has("key"):
        topic = cols.topic[0]
        route = np.asarray(routes[topic])
        first = next_rr(topic, -(-n // chunk))
        qids = (first + np.arange(n) // chunk) % len(route)
        return qids, route[qids]
    qids = np.empty(n, np.int64)
    shards = np.empty(n, np.int64)
    for i, (topic, key) in enumerate(zip(cols.topic, cols.key)):
        route = routes[topic]
        q = key_queue(key, len(route)) if key else next_rr(topic, 1) % len(route)
        qids[i] = q
        shards[i] = route[q]
    return qids, shards


def record_properties(props: dict[str, str] | None, delay_level: int, deliver_at_ms: int | None,
                      system_props: dict[str, str] | None = None,
                      deliver_after_ms: int | None = None) -> dict[str, str] | None:
    """The stored properties of a message: its own, its delay, RayMQ's (None when empty)."""
    p = dict(props) if props else {}
    if delay_level:
        p[Prop.DELAY] = str(delay_level)
    elif deliver_at_ms is not None:
        p[Prop.DELIVER_AT] = str(deliver_at_ms)
    elif deliver_after_ms is not None:
        p[Prop.DELIVER_AFTER] = str(deliver_after_ms)
    if system_props:
        p.update(system_props)
    return p or None


def _properties_column(props: list, levels: list, ats: list, afters: list) -> list:
    """``record_properties`` of each message; messages with no properties of their own and
    the same delay share one dict (encoded, checked and diverted once by the shard)."""
    n = len(props)
    if n and props.count(None) == n and levels.count(levels[0]) == n \
            and ats.count(ats[0]) == n and afters.count(afters[0]) == n:  # (C-speed checks)
        return [record_properties(None, levels[0], ats[0], None, afters[0])] * n
    out, shared = [], {}
    for p, level, at, after in zip(props, levels, ats, afters):
        if p:
            out.append(record_properties(p, level, at, None, after))
            continue
        key = (level, at, after)
        q = shared.get(key, False)
        if q is False:
            q = shared[key] = record_properties(None, level, at, None, after)
        out.append(q)
    return out


def columns_to_batch(cols: Columns, idx: list[int], queue_ids: list[int],
                     born_ms: int) -> RecordBatch:
    """The request batch of the messages at ``idx`` (validated columns)."""
    if len(idx) == cols.n:
        pick = list
    elif len(idx) == 1:
        i0 = idx[0]
        pick = lambda col: [col[i0]]  # noqa: E731
    else:
        getter = itemgetter(*idx)
        pick = lambda col: list(getter(col))  # noqa: E731
    props_col = None
    if cols.properties.count(None) + cols.properties.count({}) != cols.n \
            or cols.has("delay_level", 0) or cols.has("deliver_at_ms") \
            or cols.has("deliver_after_ms"):
        props_col = _properties_column(pick(cols.properties), pick(cols.delay_level),
                                       pick(cols.deliver_at_ms), pick(cols.deliver_after_ms))
    return RecordBatch(shared_value(pick(cols.topic)), shared_value(queue_ids), pick(cols.body),
                       keys=pick(cols.key) if cols.has("key") else None,
                       tags=pick(cols.tags) if cols.has("tags") else None,
                       properties=props_col, born_ms=born_ms, flags=int(SysFlag.NONE),
                       headers=pick(cols.headers) if cols.has("headers") else None)


def to_batch(messages: list[Message], queue_ids: list[int], born_ms: int) -> RecordBatch:
    """The columns of one producer request (all messages already validated)."""
    cols = Columns(messages)
    cols.body = [b if type(b) is bytes else bytes(b) for b in cols.body]
    return columns_to_batch(cols, list(range(cols.n)), queue_ids, born_ms)
