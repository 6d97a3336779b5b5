"""What a shard accepts from a client: the gate is the shard, not the SDK (issue 12 B).

A producer request's records are checked one by one: user topics only, the system
properties the SDK itself sets (with values the shard can parse), keys, tags and
properties and headers the store can encode.  A bad record is refused alone; the others
go on.
"""
from __future__ import annotations

from raymq.actors.protocol import RETRY_PREFIX, Prop, check_group, is_system_topic
from raymq.storage.errors import RayMQError
from raymq.storage.records import (MAX_KEY_BYTES, MAX_TAGS_BYTES, MAX_USER_PROPERTIES_BYTES,
                                   PROP_NAME_VALUE_SEP, PROP_SEP, RecordBatch,
                                   check_user_properties, encode_headers)

#: System properties a client may set (the SDK sets these, and only these).
CLIENT_PROPERTIES = frozenset({Prop.DELAY, Prop.DELIVER_AT, Prop.DELIVER_AFTER, Prop.TRAN_MSG,
                               Prop.PRODUCER_GROUP, Prop.TRANSACTION_ID, Prop.TXN_TIMEOUT_MS})
_TX_ONLY = (Prop.PRODUCER_GROUP, Prop.TRANSACTION_ID, Prop.TXN_TIMEOUT_MS)
#: Longest transaction id a shard stores (the SDK's are about 40 characters).
MAX_TRANSACTION_ID_CHARS = 256
#: Longest per-message transaction timeout (a week).
MAX_TXN_TIMEOUT_MS = 7 * 24 * 3600 * 1000
#: The default longest schedule (``ClusterConfig.max_delay_ms``): 40 days.
DEFAULT_MAX_DELAY_MS = 40 * 24 * 3600 * 1000
#: How far a deliver-at time may pass the maximum as the shard's clock sees it (the
#: client checked it against its own clock).
CLOCK_SLACK_MS = 60_000


def refusals(batch: RecordBatch, num_levels: int, system: frozenset[str], *,
             max_delay_ms: int = DEFAULT_MAX_DELAY_MS, now_ms: int | None = None
             ) -> dict[int, str]:
    """Why each refused record of a client's batch is refused (index -> one line).

    ``system``: every system property name (``SYSTEM_PROPERTIES``); ``now_ms``: the
    shard's time, for deliver-at times past ``max_delay_ms``.
    """
    out: dict[int, str] = {}
    flags = batch.flags
    if not isinstance(flags, int) or flags:  # (a shared 0: the usual batch)
        why = "a record's flags are the broker's to set (send them as 0)"
        out.update((i, why) for i, f in enumerate(batch.column("flags")) if f)
    topics = batch.topics
    for t in (set(topics) if isinstance(topics, list) else (topics,)):
        if isinstance(t, str) and is_system_topic(t):
            why = f"topic {t!r} is reserved for RayMQ's own use"
            out.update((i, why) for i, x in enumerate(batch.column("topics")) if x == t)
    for name, limit in (("keys", MAX_KEY_BYTES), ("tags", MAX_TAGS_BYTES)):
        col = getattr(batch, name)
        if col is not None:
            for i, v in enumerate(col):
                why = key_problem(v) if name == "keys" else text_problem(v, limit, name)
                if why and i not in out:
                    out[i] = why
    if batch.headers is not None:
        for i, h in enumerate(batch.headers):
            if h and i not in out:
                try:
                    encode_headers(h)
                except RayMQError as err:
                    out[i] = str(err)
    if batch.properties is not None:
        seen: dict[int, str | None] = {}  # a dict shared by many records: checked once
        for i, p in enumerate(batch.properties):
            if p and i not in out:
                if id(p) in seen:
                    why = seen[id(p)]
                else:
                    why = seen[id(p)] = properties_problem(
                        p, num_levels, system, max_delay_ms=max_delay_ms, now_ms=now_ms)
                if why:
                    out[i] = why
    return out


def key_problem(value) -> str | None:
    """Why a key cannot be stored (None: it can): text as ``text_problem`` says, or bytes
    (a binary key) of at most ``MAX_KEY_BYTES``."""
    if isinstance(value, (bytes, bytearray)):
        return f"key of {len(value)} bytes is longer than {MAX_KEY_BYTES} bytes" \
            if len(value) > MAX_KEY_BYTES else None
    return text_problem(value, MAX_KEY_BYTES, "key")


def text_problem(value, limit: int, what: str) -> str | None:
    """Why a key or tags value cannot be stored (None: it can)."""
    if value is None:
        return None
    if not isinstance(value, str):
        return f"{what} must be a str, got {type(value).__name__}"
    if value.isascii() and len(value) <= limit:
        return None
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        return f"{what} {value[:40]!r} is not valid text (a lone surrogate)"
    return f"{what} {value[:40]!r}... is longer than {limit} bytes" if size > limit else None


def properties_problem(p, num_levels: int, system: frozenset[str], *,
                       max_delay_ms: int = DEFAULT_MAX_DELAY_MS, now_ms: int | None = None
                       ) -> str | None:
    """Why a record's properties cannot be stored from a client (None: they can)."""
    if not isinstance(p, dict):
        return f"properties must be a dict of str, got {type(p).__name__}"
    for k, v in p.items():
        if not isinstance(k, str) or not isinstance(v, str):
            return f"property names and values must be str, got {k!r}={v!r}"
        if not k or PROP_NAME_VALUE_SEP in k or PROP_SEP in k or PROP_NAME_VALUE_SEP in v \
                or PROP_SEP in v:
            return (f"property {k!r} is empty or contains a reserved separator character "
                    "(\\x01 or \\x02)")
        if not (k.isascii() and v.isascii()):
            try:
                k.encode(), v.encode()
            except UnicodeEncodeError:
                return f"property {k!r} is not valid text (a lone surrogate)"
    try:  # (with what a client adds: delay, transaction)
        check_user_properties(p, MAX_USER_PROPERTIES_BYTES + 1024)
    except RayMQError as err:
        return str(err)
    return _system_problem(p, num_levels, system, max_delay_ms, now_ms)


def _system_problem(p: dict, num_levels: int, system: frozenset[str], max_delay_ms: int,
                    now_ms: int | None) -> str | None:
    given = system.intersection(p)
    if not given:
        return None
    wrong = sorted(given - CLIENT_PROPERTIES)
    if wrong:
        return f"system properties {wrong} are set by the broker only"
    why = schedule_problem(p, max_delay_ms, now_ms)
    if why:
        return why
    if Prop.DELAY in p and not _int_in(p[Prop.DELAY], 1, num_levels):
        return f"delay level {p[Prop.DELAY]!r} is not 1..{num_levels}"
    if Prop.TRAN_MSG not in p:
        if given.intersection(_TX_ONLY):
            return f"properties {sorted(given.intersection(_TX_ONLY))} belong to a transaction"
        return None
    return _transaction_problem(p)


def schedule_problem(p: dict, max_delay_ms: int, now_ms: int | None) -> str | None:
    """Why a record's deliver-at / deliver-after time cannot be stored (None: it can)."""
    given = [k for k in (Prop.DELAY, Prop.DELIVER_AT, Prop.DELIVER_AFTER) if k in p]
    if len(given) > 1:
        return "give one of delay_level, deliver_at_ms and deliver_after_ms"
    if Prop.DELIVER_AFTER in p:
        if not _int_in(p[Prop.DELIVER_AFTER], 0, max_delay_ms):
            return (f"deliver_after_ms {p[Prop.DELIVER_AFTER]!r} is not 0..{max_delay_ms} "
                    f"(max_delay_ms)")
    if Prop.DELIVER_AT in p:
        if not _int_in(p[Prop.DELIVER_AT], 0, 2 ** 62):
            return f"deliver_at_ms {p[Prop.DELIVER_AT]!r} is not epoch milliseconds"
        if now_ms is not None and int(p[Prop.DELIVER_AT]) > now_ms + max_delay_ms + CLOCK_SLACK_MS:
            return (f"deliver_at_ms {p[Prop.DELIVER_AT]} is more than max_delay_ms "
                    f"({max_delay_ms}) ahead")
    return None


def _transaction_problem(p: dict) -> str | None:
    if p[Prop.TRAN_MSG] != "true":
        return f"{Prop.TRAN_MSG} must be 'true', got {p[Prop.TRAN_MSG]!r}"
    try:
        check_group(p.get(Prop.PRODUCER_GROUP), "producer group")
    except RayMQError as err:
        return str(err)
    txid = p.get(Prop.TRANSACTION_ID)
    if not txid or len(txid) > MAX_TRANSACTION_ID_CHARS:
        return f"a transaction id must be 1-{MAX_TRANSACTION_ID_CHARS} characters"
    if Prop.TXN_TIMEOUT_MS in p and not _int_in(p[Prop.TXN_TIMEOUT_MS], 1, MAX_TXN_TIMEOUT_MS):
        return f"{Prop.TXN_TIMEOUT_MS} must be 1..{MAX_TXN_TIMEOUT_MS} ms, " \
               f"got {p[Prop.TXN_TIMEOUT_MS]!r}"
    return None


def _int_in(text: str, lo: int, hi: int) -> bool:
    return text.isascii() and text.isdigit() and lo <= int(text) <= hi


def readable_topic(topic) -> bool:
    """Whether a client may pull a topic: user topics and consumer groups' retry topics."""
    return isinstance(topic, str) and (not is_system_topic(topic)
                                        or topic.startswith(RETRY_PREFIX))


def select(batch: RecordBatch, keep: list[int]) -> RecordBatch:
    """The records of ``batch`` at ``keep``, in order."""
    def pick(col):
        return [col[i] for i in keep] if isinstance(col, list) else col
    return RecordBatch(pick(batch.topics), pick(batch.queue_ids), pick(batch.bodies),
                       **{s: pick(getattr(batch, s)) for s in RecordBatch.__slots__[3:]})
