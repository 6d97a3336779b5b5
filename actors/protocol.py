"""What broker and client share: reserved topic names, system property keys,
name checks, the message-id format and the values a shard answers with.

Pure logic, no Ray.  The client (``raymq``) re-exports what users need.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from raymq.storage import steps
from raymq.storage.errors import InvalidMessageError, ReservedNameError

# --- reserved names --------------------------------------------------------------
SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"
HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
CHECK_EXPIRED_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"
RETRY_PREFIX = "%RETRY%"
DLQ_PREFIX = "%DLQ%"
SYSTEM_TOPIC_PREFIXES = ("RMQ_SYS_", RETRY_PREFIX, DLQ_PREFIX)
#: Timer messages (any deliver-at time) wait here, due time as tag; deliveries and
#: cancellations are recorded in the other two (``raymq.actors.timing.timers``).
TIMER_TOPIC = "RMQ_SYS_TIMER"
TIMER_DONE_TOPIC = "RMQ_SYS_TIMER_DONE"
TIMER_CANCEL_TOPIC = "RMQ_SYS_TIMER_CANCEL"
#: Consumer groups' commits of offsets, one record a commit (Kafka's __consumer_offsets):
#: replicated, refused and acknowledged as a send is; the offset table is rebuilt from it.
OFFSETS_TOPIC = "RMQ_SYS_OFFSETS"
SYSTEM_TOPICS = frozenset({SCHEDULE_TOPIC, HALF_TOPIC, OP_TOPIC, CHECK_EXPIRED_TOPIC, OFFSETS_TOPIC,
                           TIMER_TOPIC, TIMER_DONE_TOPIC, TIMER_CANCEL_TOPIC})


class Prop:
    """System property names (RocketMQ's where there is one)."""

    DELAY = "DELAY"
    DELIVER_AT = "DELIVER_AT_MS"        # absolute due time (epoch ms)
    DELIVER_AFTER = "DELIVER_AFTER_MS"  # due this long after it is stored (or committed)
    REAL_TOPIC = "REAL_TOPIC"
    REAL_QID = "REAL_QID"
    REAL_FLAGS = "REAL_FLAGS"
    PRODUCER_MSG_ID = "ORIGIN_MESSAGE_ID"  # the id the producer was given (retry and commit copies)
    RETRY_TOPIC = "RETRY_TOPIC"
    CONSUME_GROUP = "CONSUME_GROUP"
    DLQ_REASON = "DLQ_REASON"
    TRAN_MSG = "TRAN_MSG"
    PRODUCER_GROUP = "PGROUP"
    TRANSACTION_ID = "__transactionId__"
    CHECK_TIMES = "TRANSACTION_CHECK_TIMES"
    TXN_TIMEOUT_MS = "TRANSACTION_TIMEOUT_MS"
    ORIGIN_HALF = "ORIGIN_HALF_OFFSET"  # a half copy: the physical offset of its first copy
    CHECK_BASE_MS = "CHECK_BASE_MS"
    OP_STATE = "OP_STATE"


#: A consumer's isolation (Kafka's ``isolation.level``); the first is the default.
ISOLATIONS = ("read_committed", "read_uncommitted")

SYSTEM_PROPERTIES = frozenset(v for k, v in vars(Prop).items() if not k.startswith("_"))

TOPIC_NAME_RE = re.compile(r"[A-Za-z0-9_\-.|]{1,127}")  # a full match (no trailing newline)


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
    if not TOPIC_NAME_RE.fullmatch(topic) or topic in (".", ".."):
        raise InvalidMessageError(
            f"invalid topic name {topic!r}: use 1-127 letters, digits, '_', '-', '.' or '|'")
    if len(_USER_TOPICS_OK) < 10_000:
        _USER_TOPICS_OK.add(topic)
    return topic


def check_retention(retention_ms: Any, retention_bytes: Any) -> dict:
    """A topic's own retention settings (None: not set) as stored: ``retention_ms`` an int
    >= 1, ``retention_bytes`` an int >= 1 or -1 (no limit)."""
    out = {}
    if retention_ms is not None:
        if isinstance(retention_ms, bool) or not isinstance(retention_ms, int) or retention_ms < 1:
            raise InvalidMessageError(f"retention_ms must be an integer >= 1, got {retention_ms!r}")
        out["retention_ms"] = retention_ms
    if retention_bytes is not None:
        if isinstance(retention_bytes, bool) or not isinstance(retention_bytes, int) or \
                not (retention_bytes >= 1 or retention_bytes == -1):
            raise InvalidMessageError(f"retention_bytes must be an integer >= 1 or -1 (no "
                                      f"limit), got {retention_bytes!r}")
        out["retention_bytes"] = retention_bytes
    return out


def check_group(group: Any, what: str = "group") -> str:
    if not isinstance(group, str) or not TOPIC_NAME_RE.fullmatch(group):
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


# --- values the shard answers with -------------------------------------------------
class EndOutcome(str, enum.Enum):
    """What became of one transaction end (a ``str`` enum: it prints as its name)."""

    COMMITTED = "COMMITTED"      # the half's real message is written
    ROLLED_BACK = "ROLLED_BACK"  # the half is dropped
    UNKNOW = "UNKNOW"            # RocketMQ's spelling: nothing done, the check-back asks later
    NOOP = "NOOP"                # already so (a duplicate or late end): nothing done
    REFUSED = "REFUSED"          # the end does not match its half (group, id, not a half)
    FAILED = "FAILED"            # the shard could not plan it (an error it logged)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class EndRequest:
    """One transaction end: the halves (origins) of a producer group's transaction."""

    group: str
    transaction_id: str
    origins: tuple[int, ...]
    state: str  # COMMIT_MESSAGE | ROLLBACK_MESSAGE | UNKNOW (or COMMIT / ROLLBACK)

    @classmethod
    def of(cls, value: "EndRequest | tuple | list") -> "EndRequest":
        """An end as the wire may carry it: this class, or (group, txid, origins, state)."""
        if isinstance(value, cls):
            return value
        group, txid, origins, state = value
        return cls(group, txid, tuple(origins), state)

    def __reduce__(self):  # as a plain tuple on the wire
        return (EndRequest, (self.group, self.transaction_id, self.origins, self.state))


@dataclass(frozen=True, slots=True)
class EndResult:
    """The outcome of one end, with why when it was refused or failed."""

    outcome: EndOutcome
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.outcome.value}: {self.detail}" if self.detail else self.outcome.value

    def __reduce__(self):  # as a plain tuple on the wire (the channel pickles every reply)
        return (_end_result, (self.outcome.value, self.detail))


@dataclass(slots=True)
class SendReply:
    """A shard's answer to a producer request.

    ``phys`` and ``queue_offsets`` hold one entry per message of the request
    (empty for a duplicate whose offsets the shard no longer remembers; a
    delayed message's queue offset is -1 until it is delivered); ``ends``
    the outcomes of the transaction ends riding on it, in order; ``refused``
    the messages the shard refused alone (the others are stored).
    """

    status: str  # a SendStatus value: SEND_OK or FLUSH_DISK_TIMEOUT
    phys: list[int]
    queue_offsets: list[int]
    duplicate: bool = False
    ends: list[EndResult] | None = None
    #: messages refused alone (their index in the request -> why); phys -1 for them
    refused: dict[int, str] | None = None
    #: where the request's time went in the shard (``raymq.storage.steps``; None: off)
    steps: list | None = None

    def __reduce__(self):  # as a plain tuple on the wire (the channel pickles every reply)
        return (SendReply, (self.status, self.phys, self.queue_offsets, self.duplicate,
                            self.ends, self.refused, self.steps))


def with_steps(reply: SendReply) -> SendReply:
    """The reply, carrying the shard-side steps of its request (``steps`` on)."""
    steps.mark("shard.reply")
    reply.steps = steps.take()
    return reply


_OUTCOMES = {o.value: o for o in EndOutcome}


def _end_result(outcome: str, detail: str) -> EndResult:
    return EndResult(_OUTCOMES[outcome], detail)


@dataclass(frozen=True, slots=True)
class CheckRequest:
    """A check-back a round asks of a live producer of ``group``."""

    shard: int
    group: str
    origin: int   # the physical offset of the half's first copy (names the half)
    checks: int   # the check count this check makes
    transaction_id: str | None
    message: Any  # the half as the listener sees it (a StoredMessage)
