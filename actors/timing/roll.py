"""Rolling scheduled messages forward: what is still waiting outlives its segment.

A timer due in 40 days, or a delay-level message not yet due, would otherwise keep the
segment it was written in -- and with it every later segment -- until it is delivered.
RocketMQ 5's timer store "rolls" such messages: it writes them again at the head of
the log.  Here, when retention wants the segments below a log offset and a scheduled
message is what holds them, the janitor asks for a roll:

- ``roll_timers``: every timer not yet delivered below the offset is copied to the head
  of the timer log (its due time and the id its producer was given kept); each put of
  copies carries the timer log's *roll mark* (``Cancellations.rolled``): entries below
  it are never delivered, their copies are.  Both or neither: a crash leaves the
  originals in force, or the copies and the mark.
- ``roll_delays``: a delay level's messages below the offset become timer messages due
  when they were, in one put with the level's progress moved past them.

``find_rolled`` finds a rolled copy by the id its producer knows (a cancellation after
the roll).  Copies of messages for a topic deleted meanwhile are not made.
"""
from __future__ import annotations

import logging

import numpy as np

from raymq.actors.front.reads import stored_message
from raymq.actors.protocol import SCHEDULE_TOPIC, TIMER_TOPIC, Prop, make_msg_id
from raymq.actors.timing.delay import (DELIVERY_MAX_BYTES, DelayScheduler,
                                       for_live_topics)
from raymq.actors.timing.timers import TimerScheduler
from raymq.storage import RecordBatch
from raymq.storage.errors import RequestTimeoutError
from raymq.storage.records import Record, StoredMessage
from raymq.storage.store import PutStatus
from raymq.storage.timerwheel import WHEEL_ENTRY

log = logging.getLogger("raymq.shard")


def rolled_copy(shard: int, m: StoredMessage, due: int) -> Record:
    """A scheduled message (timer or delay level) re-written at the head of the log as a
    timer message due at ``due``, with the id its producer was given."""
    p = dict(m.properties)
    p.setdefault(Prop.PRODUCER_MSG_ID, make_msg_id(shard, m.phys_offset))
    return Record(TIMER_TOPIC, 0, m.body, m.key, m.tags, p, m.flags, m.born_ms,
                  m.reconsume_count, m.prepared_offset, int(due), m.headers)


# --------------------------------------------------------------------- timers
def roll_timers(t: TimerScheduler, below_phys: int) -> int:
    """Roll every timer of ``t`` not yet delivered whose record lies below log offset
    ``below_phys`` (see the module doc); how many were rolled."""
    with t._lock:
        t._index_new(t.clock.now_ms())
        x = min(t._indexed, t.store.retention.first_at(TIMER_TOPIC, 0, below_phys))
        if x <= t.cancels.rolled_below:
            _drop_rolled(t)
            return 0
        pending = _pending_below(t, x)
        lo = 0
        while True:
            take, records = 0, []
            if lo < len(pending):
                entries = t._cq_entries(pending["index"][lo:])
                total = np.cumsum(entries["size"])
                take = max(1, int(np.searchsorted(total, DELIVERY_MAX_BYTES, "right")))
                msgs = t.store.messages_at(entries[:take]).messages()
                dues = dict(zip(pending["index"][lo:lo + take].tolist(),
                                pending["due"][lo:lo + take].tolist()))
                records = [rolled_copy(t.shard, m, dues[m.queue_offset])
                           for m in for_live_topics(t.store, msgs)]
            below = int(pending["index"][lo + take]) if lo + take < len(pending) else x
            _put_rolled(t, records, below)
            lo += take
            if lo >= len(pending):
                break
        _drop_rolled(t)
    if len(pending):
        log.info("shard-%d: %d timer messages rolled to the head of the log", t.shard,
                 len(pending))
    return len(pending)


def _pending_below(t: TimerScheduler, x: int) -> np.ndarray:
    """The wheel's entries not yet delivered nor cancelled below timer-log index ``x``
    (and at or above the roll mark), in index order."""
    low = t.cancels.rolled_below
    t.wheel.oldest_index()  # (each bucket's lowest index known: most are skipped)
    parts = []
    for key in t.wheel.keys():
        if key < t._current or t.wheel.lowest(key) >= x:
            continue
        if key == t._current:
            if t._loaded is None:
                t._load()
            pairs = t._loaded[t._pos:]
        else:
            pairs = t.wheel.load(key)
        parts.append(pairs[(pairs["index"] < x) & (pairs["index"] >= low)])
    pairs = np.concatenate(parts) if parts else np.empty(0, WHEEL_ENTRY)
    if t.cancels.timer and len(pairs):
        pairs = pairs[~np.isin(pairs["index"], np.fromiter(t.cancels.timer, np.int64))]
    return pairs[np.argsort(pairs["index"], kind="stable")]


def _put_rolled(t: TimerScheduler, records: list[Record], below: int) -> None:
    with t.cancels.lock:  # (no snapshot of the cancellations is written meanwhile)
        batch = RecordBatch.from_records(records + [t.cancels.rolled(below)])
        if t.store.put(batch).status is not PutStatus.PUT_OK:
            raise RequestTimeoutError("rolled timer messages did not reach the disk")
        t.cancels.rolled_below = max(t.cancels.rolled_below, below)


def _drop_rolled(t: TimerScheduler) -> None:
    """Rolled entries out of the wheel (they are skipped anyway: this gives back the
    memory and the disk, and keeps the wheel's counts true)."""
    low = t.cancels.rolled_below
    for key in t.wheel.keys():
        if t.wheel.lowest(key) < low:
            t.wheel.keep_from(key, low)
    if t._loaded is not None:
        rest = t._loaded[t._pos:]
        t._loaded = np.concatenate([t._loaded[:t._pos], rest[rest["index"] >= low]])


def find_rolled(t: TimerScheduler, msg_id: str) -> StoredMessage | None:
    """The rolled copy of the scheduled message its producer knows as ``msg_id`` (its
    first record aged out); None when there is none.  The timer log is read from the
    roll mark on (what is still scheduled): an operator's action, not a hot path."""
    start = max(t.cancels.rolled_below, t.store.retention.log_start(TIMER_TOPIC, 0))
    for m in t.store.scan_queue(TIMER_TOPIC, 0, start):
        if m.properties.get(Prop.PRODUCER_MSG_ID) == msg_id:
            return m
    return None


def scheduled_message(t: TimerScheduler, phys: int) -> StoredMessage:
    """The scheduled message a client names by its send result's physical offset: the
    record there, or its rolled copy once that aged out (``stored_message``'s errors
    otherwise: "expired", "no such message")."""
    if isinstance(phys, int) and not isinstance(phys, bool) and \
            0 <= phys < t.store.min_phys_offset:
        rolled = find_rolled(t, make_msg_id(t.shard, phys))
        if rolled is not None:
            return rolled
    return stored_message(t.store, t.shard, phys)


# --------------------------------------------------------------------- delays
def roll_delays(d: DelayScheduler, below_phys: int) -> int:
    """Carry every delayed message of ``d`` not yet delivered whose record lies below
    log offset ``below_phys`` forward as a timer message (see the module doc);
    cancelled ones are only passed.  How many were rolled."""
    rolled = 0
    with d._lock:  # not while a level delivers
        for lvl in range(len(d.levels_ms)):
            level, start = lvl + 1, d.progress(lvl + 1)
            x = d.store.retention.first_at(SCHEDULE_TOPIC, lvl, below_phys)
            while start < x:
                entries = d.store.read_cq(SCHEDULE_TOPIC, lvl, start, min(1000, x - start))
                now = d.clock.now_ms()  # (after the read: see DelayScheduler._deliver_level)
                total = np.cumsum(entries["size"])
                take = max(1, int(np.searchsorted(total, DELIVERY_MAX_BYTES, "right")))
                dues = np.minimum(entries["tag"][:take], now + d.levels_ms[lvl]).tolist()
                res, msgs = d.pass_on(level, start, entries, take, lambda ms, s=start, du=dues:
                                      RecordBatch.from_records([rolled_copy(
                                          d.shard, m, du[m.queue_offset - s]) for m in ms]))
                if res.status is not PutStatus.PUT_OK:
                    raise RequestTimeoutError("rolled delayed messages did not reach the disk")
                start += take
                rolled += len(msgs)
    if rolled:
        log.info("shard-%d: %d delayed messages rolled to the head of the log as timer "
                 "messages", d.shard, rolled)
    return rolled
