"""The delay scheduler of one shard: delay levels (seed 001); any deliver-at time is
``raymq.actors.timing.timers``.

Delayed messages wait in the schedule topic, one queue per level, in due
order; ``deliver_due`` moves the due ones to their real queues.  A level's
progress is the producer sequence of its deliveries, so a delivery repeated
after a crash is recognised and not stored twice.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import numpy as np

from raymq.actors.protocol import SCHEDULE_TOPIC, TIMER_DONE_TOPIC, Prop, make_msg_id
from raymq.storage import MessageStore, RecordBatch
from raymq.storage.clock import Clock
from raymq.storage.errors import AlreadyDeliveredError
from raymq.storage.producers import INTERNAL_PRODUCER_BASE
from raymq.storage.records import StoredMessage, none_if_empty

log = logging.getLogger("raymq.shard")

#: Producer ids of the delay levels' deliveries: this plus the level (1-based).
SCHEDULER_PID_BASE = INTERNAL_PRODUCER_BASE
#: Most bytes of messages one delivery put carries (a backlog of big messages).
DELIVERY_MAX_BYTES = 32 << 20


class DelayScheduler:
    """Delivers due delayed messages of one shard; owns the background delivery thread."""

    def __init__(self, shard: int, store: MessageStore, levels_ms: tuple[int, ...],
                 tick_ms: int, clock: Clock, metrics, on_delivered: Callable[[], None],
                 cancellations=None):
        self.shard = shard
        self.store = store
        self.levels_ms = levels_ms
        self.tick_ms = tick_ms
        self.clock = clock
        self.metrics = metrics
        self._on_delivered = on_delivered  # wakes long-polling pulls
        self._lock = threading.Lock()  # one delivery of due messages at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.max_lateness_ms = 0
        self.cancels = cancellations  # ``timers.Cancellations`` (None: nothing cancels)
        if cancellations is not None:  # passed by their level's delivery: forgotten
            cancellations.levels = {(lvl, i) for lvl, i in cancellations.levels
                                    if i >= self.progress(lvl)}

    def progress(self, level: int) -> int:
        """How many messages of a level (1-based) were delivered."""
        return self.store.last_sequence(SCHEDULER_PID_BASE + level)

    def pending(self) -> dict[int, int]:
        """Messages waiting per level (levels with none left out)."""
        return {lvl + 1: end - self.progress(lvl + 1) for lvl in range(len(self.levels_ms))
                if (end := self.store.max_queue_offset(SCHEDULE_TOPIC, lvl))}

    def deliver_due(self) -> int:
        """Move every due scheduled message to its real queue; return the wait (ms) to the next.

        One call at a time (two would overlap).  A message due later than its
        level's delay from now was stamped before the clock stepped back: it is
        due now (RocketMQ's correctDeliverTimestamp), or its whole level would
        wait out the step.
        """
        with self._lock:
            next_wait = self.tick_ms
            for lvl in range(len(self.levels_ms)):
                next_wait = min(next_wait, self._deliver_level(lvl))
            return max(1, next_wait)

    def _deliver_level(self, lvl: int) -> int:
        """Deliver a level's due messages (FIFO: up to the first not due); the wait to its
        next one (``tick_ms`` when none is waiting).  The clock is read after the entries:
        one stored since, stamped later than a "now" read before, would look due later
        than its level's delay from then (a clock stepped back) and go at once."""
        level = lvl + 1
        end = self.store.max_queue_offset(SCHEDULE_TOPIC, lvl)
        start = self.progress(level)
        while start < end:
            entries = self.store.read_cq(SCHEDULE_TOPIC, lvl, start, 1000)
            now = self.clock.now_ms()
            tags = entries["tag"]
            is_due = (tags <= now) | (tags > now + self.levels_ms[lvl])
            due = len(is_due) if is_due.all() else int(np.argmin(is_due))
            if due == 0:
                return int(tags[0] - now)
            take = due
            if take > 1:  # a put of at most DELIVERY_MAX_BYTES (at least one message)
                total = np.cumsum(entries["size"][:due])
                take = max(1, int(np.searchsorted(total, DELIVERY_MAX_BYTES, "right")))
            self.pass_on(level, start, entries, take, lambda ms: restore_real(self.shard, ms))
            late = int(now - tags[:take].min())
            self.max_lateness_ms = max(self.max_lateness_ms, late)
            self.metrics.observe("delay_lateness_ms", float(late))
            self._on_delivered()
            start += take
            if take < due:
                continue  # more of them due
            if due < len(entries):
                return int(tags[due] - now)
        return self.tick_ms

    def pass_on(self, level: int, start: int, entries: np.ndarray, take: int,
                batch_of: Callable[[list[StoredMessage]], RecordBatch]):
        """Move ``level``'s progress past its first ``take`` ``entries`` (from ``start``) in
        one put: what ``batch_of`` makes of those still wanted (neither cancelled nor for
        a topic deleted since), or a record of the skip when none is; the cancellations
        passed are forgotten.  (The put's result, the messages put.)"""
        msgs = self.store.messages_at(entries[:take]).messages()
        gone = self._cancelled(level, start, take)
        if gone:
            msgs = [m for j, m in enumerate(msgs) if start + j not in gone]
        msgs = for_live_topics(self.store, msgs)
        # (all of them passed: a record of the skip keeps the level's progress)
        batch = batch_of(msgs) if msgs else RecordBatch(TIMER_DONE_TOPIC, 0, [b""])
        res = self.store.put(batch, producer_id=SCHEDULER_PID_BASE + level,
                             sequence=start + take)
        for i in gone:
            self.cancels.levels.discard((level, i))
        return res, msgs

    def _cancelled(self, level: int, start: int, take: int) -> set[int]:
        if self.cancels is None or not self.cancels.levels:
            return set()
        return {i for lvl, i in self.cancels.levels if lvl == level and start <= i < start + take}

    def cancel(self, level: int, index: int, msg_id: str) -> str:
        """Cancel the delayed message at ``index`` of ``level``'s schedule queue:
        'cancelled' or 'already cancelled'; ``AlreadyDeliveredError`` once delivered."""
        with self._lock:  # not while its level delivers
            if (level, index) in self.cancels.levels:
                return "already cancelled"
            if index < self.progress(level):
                raise AlreadyDeliveredError(f"message {msg_id} was already delivered")
            self.cancels.record({"kind": "level", "level": level, "index": index})
        return "cancelled"

    # ------------------------------------------------------- background thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"raymq-schedule-{self.shard}",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                wait_ms = self.deliver_due()
            except Exception:  # keep delivering; the next round retries
                log.exception("shard-%d: delay delivery failed", self.shard)
                wait_ms = 1000
            self.metrics.flush()  # counters summed in the process reach Ray within a tick
            self._stop.wait(min(wait_ms, self.tick_ms) / 1000.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def for_live_topics(store: MessageStore, msgs: list[StoredMessage]) -> list[StoredMessage]:
    """``msgs`` but those scheduled for a topic deleted after they were (never delivered:
    a topic created again with the name is another one), and retries or dead letters of
    a message of such a topic (its ``RETRY_TOPIC``)."""
    if not store.retention.tombstones:
        return msgs
    return [m for m in msgs if of_live_topic(store, m)]


def of_live_topic(store: MessageStore, m: StoredMessage) -> bool:
    """Whether ``m`` was not written for a topic deleted since (``for_live_topics``)."""
    tomb = store.retention.tombstones
    return tomb.get(m.properties.get(Prop.REAL_TOPIC), -1) < m.phys_offset and \
        tomb.get(m.properties.get(Prop.RETRY_TOPIC), -1) < m.phys_offset


def restore_real(shard: int, msgs: list[StoredMessage]) -> RecordBatch:
    """The due delayed (or timer) messages as consumers get them: real topic and queue back,
    and the id the producer was given (its scheduled copy's, unless it carries an older
    one); a timer message keeps ``DELIVER_AT_MS``, when it was due."""
    props = []
    for m in msgs:
        p = dict(m.properties)
        for k in (Prop.DELAY, Prop.REAL_TOPIC, Prop.REAL_QID, Prop.REAL_FLAGS):
            p.pop(k, None)
        p.setdefault(Prop.PRODUCER_MSG_ID, make_msg_id(shard, m.phys_offset))
        props.append(p)
    return RecordBatch([m.properties[Prop.REAL_TOPIC] for m in msgs],
                       [int(m.properties[Prop.REAL_QID]) for m in msgs],
                       [m.body for m in msgs], keys=[m.key for m in msgs],
                       tags=[m.tags for m in msgs],
                       properties=props,
                       flags=[int(m.properties.get(Prop.REAL_FLAGS, 0)) for m in msgs],
                       born_ms=[m.born_ms for m in msgs],
                       reconsume=[m.reconsume_count for m in msgs],
                       prepared_offsets=[m.prepared_offset for m in msgs],
                       headers=none_if_empty([m.headers for m in msgs]))
