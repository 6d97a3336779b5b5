"""What broker and client share: reserved topic names, system property keys,
name checks and the message-id format.

Pure logic, no Ray.  The client (``raymq``) re-exports what users need.
"""
from __future__ import annotations

import re
from typing import Any

from raymq.storage.errors import InvalidMessageError, ReservedNameError

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
    TXN_TIMEOUT_MS = "TRANSACTION_TIMEOUT_MS"
    ORIGIN_HALF = "ORIGIN_HALF_OFFSET"
    CHECK_BASE_MS = "CHECK_BASE_MS"
    OP_STATE = "OP_STATE"


SYSTEM_PROPERTIES = frozenset(v for k, v in vars(Prop).items() if not k.startswith("_"))

TOPIC_NAME_RE = re.compile(r"^[A-Za-z0-9_\-.|]{1,127}$")


def is_system_topic(topic: str) -> bool:
    return topic in SYSTEM_TOPICS or topic.startswith(SYSTEM_TOPIC_PREFIXES)


def retry_topic(group: str) -> str:
    return RETRY_PREFIX + group


def dlq_topic(group: str) -> str:
    return DLQ_PREFIX + group


#: User topic names already checked (every send checks its topic: a set lookup then).
_USER_TOPICS_OK: set[str] = set()


def check_user_topic(topic: Any) -> str:
    """A topic an application may create or produce to."""
    if type(topic) is str and topic in _USER_TOPICS_OK:
        return topic
    if not isinstance(topic, str) or not topic:
        raise InvalidMessageError(f"topic must be a non-empty string, got {topic!r}")
    if is_system_topic(topic):
        raise ReservedNameError(f"topic {topic!r} is reserved for RayMQ's own use")
    if not TOPIC_NAME_RE.match(topic) or topic in (".", ".."):
        raise InvalidMessageError(
            f"invalid topic name {topic!r}: use 1-127 letters, digits, '_', '-', '.' or '|'")
    if len(_USER_TOPICS_OK) < 10_000:
        _USER_TOPICS_OK.add(topic)
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
