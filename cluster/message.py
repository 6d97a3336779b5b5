"""Messages as applications see them, and the names RayMQ reserves.

Pure logic: no Ray.  ``to_batch`` turns the messages of one producer request
into the columnar ``RecordBatch`` that crosses the Ray call.
"""
from __future__ import annotations

import enum
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable

from storage.errors import InvalidMessageError, ReservedNameError
from storage.records import RecordBatch, StoredMessage, SysFlag

# --- reserved names --------------------------------------------------------------
SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"
HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
CHECK_EXPIRED_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"
RETRY_PREFIX = "%RETRY%"
DLQ_PREFIX = "%DLQ%"
SYSTEM_TOPIC_PREFIXES = ("RMQ_SYS_", RETRY_PREFIX, DLQ_PREFIX)
SYSTEM_TOPICS = frozenset({SCHEDULE_TOPIC, HALF_TOPIC, OP_TOPIC, CHECK_EXPIRED_TOPIC})


class Prop:
    """System property names (RocketMQ's where there is one)."""

    DELAY = "DELAY"
    DELIVER_AT = "DELIVER_AT_MS"
    REAL_TOPIC = "REAL_TOPIC"
    REAL_QID = "REAL_QID"
    REAL_FLAGS = "REAL_FLAGS"
    ORIGIN_MSG_ID = "ORIGIN_MESSAGE_ID"
    RETRY_TOPIC = "RETRY_TOPIC"
    CONSUME_GROUP = "CONSUME_GROUP"
    DLQ_REASON = "DLQ_REASON"
    TRAN_MSG = "TRAN_MSG"
    PRODUCER_GROUP = "PGROUP"
    TRANSACTION_ID = "__transactionId__"
    CHECK_TIMES = "TRANSACTION_CHECK_TIMES"
    CHECK_IMMUNITY_MS = "CHECK_IMMUNITY_TIME_IN_SECONDS"


SYSTEM_PROPERTIES = frozenset(v for k, v in vars(Prop).items() if not k.startswith("_"))

TOPIC_NAME_RE = re.compile(r"^[A-Za-z0-9_\-.|]{1,127}$")


def is_system_topic(topic: str) -> bool:
    return topic in SYSTEM_TOPICS or topic.startswith(SYSTEM_TOPIC_PREFIXES)


def retry_topic(group: str) -> str:
    return RETRY_PREFIX + group


def dlq_topic(group: str) -> str:
    return DLQ_PREFIX + group


def check_user_topic(topic: Any) -> str:
    """A topic an application may create or produce to."""
    if not isinstance(topic, str) or not topic:
        raise InvalidMessageError(f"topic must be a non-empty string, got {topic!r}")
    if is_system_topic(topic):
        raise ReservedNameError(f"topic {topic!r} is reserved for RayMQ's own use")
    if not TOPIC_NAME_RE.match(topic) or topic in (".", ".."):
        raise InvalidMessageError(
            f"invalid topic name {topic!r}: use 1-127 letters, digits, '_', '-', '.' or '|'")
    return topic


def check_group(group: Any, what: str = "group") -> str:
    if not isinstance(group, str) or not TOPIC_NAME_RE.match(group):
        raise InvalidMessageError(f"invalid {what} name {group!r}: use 1-127 letters, digits, "
                                  "'_', '-', '.' or '|'")
    return group


# --- message ids --------------------------------------------------------------------
def make_msg_id(shard: int, phys_offset: int) -> str:
    """Where a message lives, like RocketMQ's offset message id: shard + physical offset."""
    return f"{shard:04X}{phys_offset:016X}"


def parse_msg_id(msg_id: str) -> tuple[int, int]:
    if not isinstance(msg_id, str) or not re.fullmatch(r"[0-9A-Fa-f]{20}", msg_id):
        raise InvalidMessageError(f"not a RayMQ message id: {msg_id!r} (20 hex digits)")
    return int(msg_id[:4], 16), int(msg_id[4:], 16)


# --- application messages ----------------------------------------------------------
@dataclass
class Message:
    """A message to send.  ``delay_level`` (1-based) or ``deliver_at_ms`` delay it."""

    topic: str
    body: bytes
    key: str | None = None
    tags: str | None = None
    properties: dict[str, str] | None = None
    delay_level: int = 0
    deliver_at_ms: int | None = None

    def validate(self, max_bytes: int, num_levels: int) -> None:
        check_user_topic(self.topic)
        if not isinstance(self.body, (bytes, bytearray)):
            raise InvalidMessageError(f"message body must be bytes, got {type(self.body).__name__}")
        if len(self.body) > max_bytes:
            raise InvalidMessageError(
                f"message body of {len(self.body)} bytes exceeds the maximum of {max_bytes} bytes")
        if self.key is not None and not isinstance(self.key, str):
            raise InvalidMessageError("key must be a str")
        if self.tags is not None and not isinstance(self.tags, str):
            raise InvalidMessageError("tags must be a str")
        if self.properties:
            clash = sorted(set(self.properties) & SYSTEM_PROPERTIES)
            if clash:
                raise ReservedNameError(f"properties {clash} are reserved system properties")
        if isinstance(self.delay_level, bool) or not isinstance(self.delay_level, int) \
                or not 0 <= self.delay_level <= num_levels:
            raise InvalidMessageError(f"delay_level must be 0..{num_levels}, got {self.delay_level!r}")
        if self.deliver_at_ms is not None:
            if self.delay_level:
                raise InvalidMessageError("give delay_level or deliver_at_ms, not both")
            if isinstance(self.deliver_at_ms, bool) or not isinstance(self.deliver_at_ms, int) \
                    or self.deliver_at_ms < 0:
                raise InvalidMessageError("deliver_at_ms must be epoch milliseconds (int)")


class SendStatus(enum.Enum):
    SEND_OK = "SEND_OK"
    FLUSH_DISK_TIMEOUT = "FLUSH_DISK_TIMEOUT"
    FLUSH_SLAVE_TIMEOUT = "FLUSH_SLAVE_TIMEOUT"
    SLAVE_NOT_AVAILABLE = "SLAVE_NOT_AVAILABLE"


@dataclass(frozen=True)
class SendResult:
    status: SendStatus
    msg_id: str
    queue_id: int
    queue_offset: int
    topic: str = ""


@dataclass
class MessageExt:
    """A consumed message."""

    msg_id: str
    topic: str
    queue_id: int
    queue_offset: int
    body: bytes
    key: str | None
    tags: str | None
    properties: dict[str, str]
    reconsume_count: int
    born_ms: int
    store_ms: int
    shard: int = 0
    # where it was pulled from (a retry-topic copy has the original topic in ``topic``)
    source_topic: str = ""
    source_queue: int = 0
    source_offset: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_stored(cls, shard: int, m: StoredMessage) -> "MessageExt":
        props = m.properties
        topic = props.get(Prop.RETRY_TOPIC, m.topic) if m.topic.startswith(RETRY_PREFIX) else m.topic
        return cls(msg_id=props.get(Prop.ORIGIN_MSG_ID) or make_msg_id(shard, m.phys_offset),
                   topic=topic, queue_id=m.queue_id, queue_offset=m.queue_offset, body=m.body,
                   key=m.key, tags=m.tags, properties=props,
                   reconsume_count=m.reconsume_count, born_ms=m.born_ms, store_ms=m.store_ms,
                   shard=shard, source_topic=m.topic, source_queue=m.queue_id,
                   source_offset=m.queue_offset)

    @property
    def stored_id(self) -> str:
        """Id of this stored copy (a retry copy has its own)."""
        return self.extra.get("stored_id", self.msg_id)


def key_queue(key: str, num_queues: int) -> int:
    """Same key -> same queue (stable across processes)."""
    return zlib.crc32(key.encode()) % num_queues


def to_batch(messages: list[Message], queue_ids: list[int], born_ms: int) -> RecordBatch:
    """The columns of one producer request (all messages already validated)."""
    topics = [m.topic for m in messages]
    props_col = None
    if any(m.properties or m.delay_level or m.deliver_at_ms is not None for m in messages):
        props_col = []
        for m in messages:
            p = dict(m.properties) if m.properties else {}
            if m.delay_level:
                p[Prop.DELAY] = str(m.delay_level)
            elif m.deliver_at_ms is not None:
                p[Prop.DELIVER_AT] = str(m.deliver_at_ms)
            props_col.append(p or None)
    keys = [m.key for m in messages]
    tags = [m.tags for m in messages]
    return RecordBatch(_shared(topics), _shared(queue_ids), [bytes(m.body) for m in messages],
                       keys=None if keys.count(None) == len(keys) else keys,
                       tags=None if tags.count(None) == len(tags) else tags,
                       properties=props_col, born_ms=born_ms,
                       flags=int(SysFlag.NONE))


def _shared(values: list):
    first = values[0]
    return first if values.count(first) == len(values) else values


def merge_batches(batches: Iterable[RecordBatch]) -> RecordBatch:
    """One request from several batches (columns concatenated)."""
    batches = list(batches)
    if len(batches) == 1:
        return batches[0]
    cols = {}
    for name in RecordBatch.__slots__:
        values = [getattr(b, name) for b in batches]
        if name in ("keys", "tags", "properties", "tag_codes"):
            if all(v is None for v in values):
                cols[name] = None
                continue
        merged = []
        for b, v in zip(batches, values):
            merged.extend(v if isinstance(v, list) else [v] * len(b))
        cols[name] = merged if name in ("bodies",) else _shared(merged)
        if name in ("keys", "tags", "properties", "tag_codes") and not isinstance(cols[name], list):
            cols[name] = merged
    return RecordBatch(cols["topics"], cols["queue_ids"], cols["bodies"], keys=cols["keys"],
                       tags=cols["tags"], properties=cols["properties"], flags=cols["flags"],
                       born_ms=cols["born_ms"], reconsume=cols["reconsume"],
                       prepared_offsets=cols["prepared_offsets"], tag_codes=cols["tag_codes"])
