"""Records that do not go to their own queue yet: delayed ones to the schedule topic,
transactional ones (halves) to the half topic, their real topic and queue kept in properties.

Pure: a function of the batch, the delay levels and the time.
"""
from __future__ import annotations

from typing import Iterable

from raymq.actors.front.admission import refusals
from raymq.actors.protocol import HALF_TOPIC, SCHEDULE_TOPIC, TIMER_TOPIC, Prop
from raymq.storage import RecordBatch
from raymq.storage.errors import InvalidMessageError
from raymq.storage.records import SysFlag

#: Properties that make ``divert_to_system_topics`` move a record (any of them).
_DIVERTING = frozenset((Prop.DELAY, Prop.DELIVER_AT, Prop.DELIVER_AFTER, Prop.TRAN_MSG))


def diverts(properties: Iterable[dict | None]) -> bool:
    """Whether ``divert_to_system_topics`` moves any of these records (given their
    properties)."""
    return any(p and not _DIVERTING.isdisjoint(p) for p in properties)


def divert_to_system_topics(batch: RecordBatch, levels_ms: tuple[int, ...],
                            now_ms: int) -> RecordBatch:
    """The batch with its delayed records moved to the schedule topic (queue = level - 1,
    due time as tag code), its timer records (deliver-at / deliver-after) to the timer
    topic (due time as tag code; a time not ahead of ``now_ms`` stays in its real queue:
    due now) and its transactional ones to the half topic.

    A transactional message keeps its delay as a property: the delay is applied when
    it is committed (a deliver-after counts from then), never while it is a half
    (RocketMQ 4.x loops between the half and schedule topics here -- seed 000).  The
    caller's batch stays as it was (an in-process caller may send it again).
    """
    props = batch.properties
    if not diverts(props):
        return batch
    first = props[0]
    if first and Prop.TRAN_MSG not in first and Prop.DELAY not in first \
            and all(p is first for p in props):
        return _divert_shared_timer(batch, first, now_ms)
    topics, qids = list(batch.column("topics")), list(batch.column("queue_ids"))
    flags, tag_codes = list(batch.column("flags")), list(batch.column("tag_codes"))
    new_props = list(props)
    timed: dict[tuple, tuple] = {}  # a shared dict to the same queue: diverted once
    for i, p in enumerate(props):
        if not p:
            continue
        if p.get(Prop.TRAN_MSG) == "true":
            _check_half(p, levels_ms)
            new_props[i] = _with_real(p, topics[i], qids[i])
            topics[i], qids[i], flags[i] = HALF_TOPIC, 0, int(SysFlag.TRANSACTION_PREPARED)
            continue
        if Prop.DELIVER_AT in p or Prop.DELIVER_AFTER in p:
            key = (id(p), topics[i], qids[i], flags[i])
            if key not in timed:
                due, q = _timer_props(p, now_ms)
                timed[key] = (due, q if due <= now_ms
                              else _with_real(q, topics[i], qids[i], flags[i]))
            due, new_props[i] = timed[key]
            if due > now_ms:  # (else due now: straight to its queue)
                topics[i], qids[i], flags[i] = TIMER_TOPIC, 0, int(SysFlag.SCHEDULED)
                tag_codes[i] = due
            continue
        if Prop.DELAY not in p:
            continue
        level = _level(p, levels_ms)
        new_props[i] = _with_real(p, topics[i], qids[i], flags[i])
        topics[i], qids[i], flags[i] = SCHEDULE_TOPIC, level - 1, int(SysFlag.SCHEDULED)
        tag_codes[i] = now_ms + levels_ms[level - 1]
    return RecordBatch(topics, qids, batch.bodies, keys=batch.keys, tags=batch.tags,
                       properties=new_props, flags=flags, born_ms=batch.born_ms,
                       reconsume=batch.reconsume, prepared_offsets=batch.prepared_offsets,
                       tag_codes=tag_codes, headers=batch.headers)


def _divert_shared_timer(batch: RecordBatch, p: dict, now_ms: int) -> RecordBatch:
    """``divert_to_system_topics`` of a batch whose records share one timer properties
    dict (what the SDK sends for messages with the same delay): column operations."""
    due, q = _timer_props(p, now_ms)
    n = len(batch)
    if due <= now_ms:  # due now: straight to its queue
        return RecordBatch(batch.topics, batch.queue_ids, batch.bodies, keys=batch.keys,
                           tags=batch.tags, properties=[q] * n, flags=batch.flags,
                           born_ms=batch.born_ms, reconsume=batch.reconsume,
                           prepared_offsets=batch.prepared_offsets, tag_codes=batch.tag_codes, headers=batch.headers)
    topics, qids, flags = batch.column("topics"), batch.column("queue_ids"), \
        batch.column("flags")
    real: dict[tuple, dict] = {}
    new_props = []
    for t, qid, f in zip(topics, qids, flags):
        r = real.get((t, qid, f))
        if r is None:
            r = real[(t, qid, f)] = _with_real(q, t, qid, f)
        new_props.append(r)
    return RecordBatch(TIMER_TOPIC, 0, batch.bodies, keys=batch.keys, tags=batch.tags,
                       properties=new_props, flags=int(SysFlag.SCHEDULED),
                       born_ms=batch.born_ms, reconsume=batch.reconsume,
                       prepared_offsets=batch.prepared_offsets, tag_codes=[due] * n, headers=batch.headers)


def _timer_props(p: dict, now_ms: int) -> tuple[int, dict]:
    """A timer record's due time, and its properties with that time as ``DELIVER_AT_MS``
    (what the delivered copy says it was due) and no ``DELIVER_AFTER_MS``."""
    due = due_time(p, now_ms)
    q = dict(p)
    q.pop(Prop.DELIVER_AFTER, None)
    q[Prop.DELIVER_AT] = str(due)
    return due, q


def due_time(p: dict, now_ms: int) -> int:
    """When a timer record is due: its deliver-at time, or its deliver-after from now."""
    if Prop.DELIVER_AT in p:
        return int(p[Prop.DELIVER_AT])
    return now_ms + int(p[Prop.DELIVER_AFTER])


def _check_half(p: dict, levels_ms: tuple[int, ...]) -> None:
    if Prop.DELAY in p:
        _level(p, levels_ms, show_raw=True)
    if not p.get(Prop.PRODUCER_GROUP) or not p.get(Prop.TRANSACTION_ID):
        raise InvalidMessageError("a transactional message needs its producer group "
                                  "and transaction id")


def _level(p: dict, levels_ms: tuple[int, ...], *, show_raw: bool = False) -> int:
    level = int(p[Prop.DELAY])
    if not 1 <= level <= len(levels_ms):
        shown = p[Prop.DELAY] if show_raw else level  # (as the messages always read)
        raise InvalidMessageError(f"delay level {shown} is not 1..{len(levels_ms)}")
    return level


def _with_real(p: dict, topic: str, qid: int, flags: int | None = None) -> dict:
    q = dict(p)
    q[Prop.REAL_TOPIC] = topic
    q[Prop.REAL_QID] = str(qid)
    if flags is not None:
        q[Prop.REAL_FLAGS] = str(flags)
    return q


def check_transactional(batch: RecordBatch | None, n_levels: int, system_props) -> None:
    """A Kafka-style transactional write's messages: some, none refused, none delayed."""
    if batch is None or not len(batch):
        raise InvalidMessageError("a transactional write needs messages")
    refused = refusals(batch, n_levels, system_props)
    if refused:
        raise InvalidMessageError(f"message {min(refused)}: {refused[min(refused)]}")
    if batch.properties is not None and diverts(batch.properties):
        raise InvalidMessageError("a delayed message cannot be part of a Kafka-style "
                                  "transaction")
