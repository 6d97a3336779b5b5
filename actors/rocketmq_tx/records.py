"""The records of half messages: op records (their codec), commits' real messages, check copies.

Pure functions over stored messages and records: no Ray, no I/O.
"""
from __future__ import annotations

from raymq.actors.rocketmq_tx.logic import HalfState
from raymq.actors.front.diversion import diverts
from raymq.actors.protocol import OP_TOPIC, Prop, make_msg_id
from raymq.storage.errors import CorruptLogError
from raymq.storage.records import Record, RecordBatch, StoredMessage, SysFlag

#: Transaction properties a committed message no longer carries.
TX_PROPS = (Prop.TRAN_MSG, Prop.REAL_TOPIC, Prop.REAL_QID, Prop.REAL_FLAGS, Prop.CHECK_TIMES,
            Prop.ORIGIN_HALF, Prop.TXN_TIMEOUT_MS, Prop.CHECK_BASE_MS)


def first_copy_offset(m: StoredMessage) -> int:
    """The origin of a half-queue entry: the physical offset of its half's first copy."""
    return int(m.properties.get(Prop.ORIGIN_HALF, m.phys_offset))


def real_from_half(shard: int, half: StoredMessage) -> Record:
    """The real message a commit writes: real topic/queue, the half's origin id as its id."""
    p = dict(half.properties)
    topic, qid = p[Prop.REAL_TOPIC], int(p[Prop.REAL_QID])
    for k in TX_PROPS:
        p.pop(k, None)
    p[Prop.PRODUCER_MSG_ID] = make_msg_id(shard, first_copy_offset(half))
    return Record(topic, qid, half.body, half.key, half.tags, p,
                  int(SysFlag.TRANSACTION_COMMIT), half.born_ms, headers=half.headers)


def op_record(origin: int, state: HalfState, half_props: dict) -> Record:
    """The op record of one half, with its group and transaction id."""
    record = ops_record([(origin, state)])
    record.properties[Prop.PRODUCER_GROUP] = half_props.get(Prop.PRODUCER_GROUP, "")
    record.properties[Prop.TRANSACTION_ID] = half_props.get(Prop.TRANSACTION_ID, "")
    return record


def ops_record(entries: list[tuple[int, HalfState]]) -> Record:
    """One op record for several resolved halves (RocketMQ 5 batches its op messages too):
    their origins and the stable ids of their new states, in order, comma-separated."""
    props = {Prop.ORIGIN_HALF: ",".join([str(o) for o, _ in entries]),
             Prop.OP_STATE: ",".join([str(st.value) for _, st in entries])}
    return Record(OP_TOPIC, 0, b"", None, "d", props, int(SysFlag.OP))


def op_entries(props: dict) -> list[tuple[int, HalfState]]:
    """The (origin, state) pairs of an op record: one (``op_record``) or several.

    States are read as stable ids, or as names (records of older versions).
    """
    origins, states = props[Prop.ORIGIN_HALF].split(","), props[Prop.OP_STATE].split(",")
    if len(origins) != len(states):
        raise CorruptLogError(f"op record with {len(origins)} origins and {len(states)} states")
    return [(int(o), HalfState.from_stored(st)) for o, st in zip(origins, states)]


def op_progress_origin(props: dict, resolved: dict, blocked, *, aged: bool = False) -> int:
    """What an op record counts as for the op progress (``op_progress``): its highest
    origin; ``blocked`` while any of its halves is EXPIRED (operators may still resolve
    it, and a restart must find it) -- unless the record has ``aged`` out (it is older
    than the retention an expired half is kept for)."""
    entries = op_entries(props)
    if not aged and any(resolved.get(o) is HalfState.EXPIRED for o, _ in entries):
        return blocked
    return max(o for o, _ in entries)


def check_copy(m: StoredMessage, origin: int, checks: int, topic: str, base_ms: int) -> Record:
    """A re-put copy of a half (or its check-expired copy): same origin, its check count and
    the time its back-off runs from."""
    p = dict(m.properties)
    p[Prop.ORIGIN_HALF] = str(origin)
    p[Prop.CHECK_TIMES] = str(checks)
    p[Prop.CHECK_BASE_MS] = str(base_ms)
    return Record(topic, 0, m.body, m.key, m.tags, p, int(SysFlag.TRANSACTION_PREPARED),
                  m.born_ms, headers=m.headers)


def listener_view(m: StoredMessage, shard: int, origin: int) -> StoredMessage:
    """The half as the application's check sees it: its real topic and queue, and the id
    its producer was given (that of the first copy, not of this re-put one)."""
    p = dict(m.properties)
    p[Prop.PRODUCER_MSG_ID] = make_msg_id(shard, origin)
    topic, qid = p.get(Prop.REAL_TOPIC, m.topic), int(p.get(Prop.REAL_QID, 0))
    return StoredMessage(topic, qid, -1, m.phys_offset, m.size, m.flags, m.born_ms, m.store_ms,
                         m.prepared_offset, m.tag_code, m.reconsume_count, m.key, m.tags, p,
                         m.body, m.headers)


def resolution_batch(records: list, ahead, divert):
    """One put of transaction ends: the producer batch ``ahead`` (if any), then the real
    messages (through ``divert``: delayed now if they asked for a delay) and their op
    records."""
    if not records:
        return ahead
    if diverts(r.properties for r in records):
        tail = divert(RecordBatch.from_records(records))
        return tail if ahead is None else RecordBatch.concat([ahead, tail])
    # nothing to divert: the records go straight after the batch
    return RecordBatch.from_records(records) if ahead is None else ahead.with_records(records)
