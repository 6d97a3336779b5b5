"""Timer messages of one shard: any deliver-at time, durable, never early, delivered in
milliseconds, with memory that does not grow with the number scheduled.

A timer message waits in the timer topic (its one queue is the timer log; due time as
tag).  ``TimerScheduler`` indexes new timer-log entries into the on-disk wheel
(``raymq.storage.timerwheel``: one file per minute of due time), loads only the bucket
being delivered, and moves each message to its real queue when due -- in due order,
then in order of scheduling.  Each delivery is one put: the messages, and a record in
the timer-done topic listing their timer-log indexes, under the timer's own producer
id with the next sequence.  A restart reads the done records written since the last
finished bucket and delivers the rest: nothing twice, nothing lost.

Cancelling (``cancel``) writes a record in the timer-cancel topic before it answers;
the delivery skips the message, also after a restart.  Delay-level messages are
cancelled the same way (``DelayScheduler.cancel``; RocketMQ cannot recall those).
"""
from __future__ import annotations

import json
import logging
import os
import threading
from typing import Callable

import numpy as np

from raymq.actors.timing.delay import for_live_topics, restore_real
from raymq.actors.protocol import (SCHEDULE_TOPIC, TIMER_CANCEL_TOPIC, TIMER_DONE_TOPIC,
                                   TIMER_TOPIC, Prop, make_msg_id)
from raymq.storage import MessageStore, RecordBatch
from raymq.storage.clock import Clock
from raymq.storage.consumequeue import CQ_ENTRY
from raymq.storage.errors import AlreadyDeliveredError, NotScheduledError, RequestTimeoutError
from raymq.storage.fileutil import read_tree
from raymq.storage.producers import INTERNAL_PRODUCER_BASE
from raymq.storage.records import Record, StoredMessage
from raymq.storage.store import PutStatus
from raymq.storage.timerwheel import TimerWheel

log = logging.getLogger("raymq.shard")

#: The producer id of timer deliveries (its sequence counts delivery puts).
TIMER_PID = INTERNAL_PRODUCER_BASE + (1 << 60)
#: Most bytes of messages one delivery put carries.
DELIVERY_MAX_BYTES = 32 << 20
#: Timer-log entries indexed into the wheel per step.
INDEX_CHUNK = 65_536
#: Least wait between two rounds that delivered something (what a burst adds to lateness).
ROUND_GAP_MS = 4
#: The wheel's directory in a shard's directory (a replica's part, shipped whole).
WHEEL_DIR = "timer"
#: Time buckets of ``status`` (name, ms from now).
STATUS_BUCKETS = (("next_minute", 60_000), ("next_hour", 3_600_000),
                  ("next_day", 86_400_000))


class Cancellations:
    """Cancelled scheduled messages not yet passed by their delivery, and how far the timer
    log was rolled (``rolled_below``: its entries below it were re-written at the head),
    kept durably as records of the timer-cancel topic (memory grows with cancellations
    only).  ``compact`` writes them all as one snapshot record, so the topic is needed
    only from its last snapshot on (``retention_pin``): what a cancellation waits on
    outlives the segment its record was written in."""

    def __init__(self, store: MessageStore):
        self.store = store
        self.timer: dict[int, int] = {}          # timer-log index -> due ms
        self.levels: set[tuple[int, int]] = set()  # (level, schedule-queue index)
        self.rolled_below = 0                    # timer-log entries below it were rolled
        self.base = 0                            # queue offset of the last snapshot record
        self.lock = threading.Lock()             # a record and a snapshot, one at a time
        self._load()

    def record(self, entry: dict) -> None:
        """Write one cancellation durably, then keep it."""
        with self.lock:
            self._put(entry, "the cancellation")
            self._keep(entry)

    def rolled(self, below: int) -> Record:
        """The record saying timer-log entries below ``below`` were rolled (written in the
        put of their copies: both or neither)."""
        return Record(TIMER_CANCEL_TOPIC, 0, json.dumps({"kind": "rolled",
                                                         "below": int(below)}).encode())

    def compact(self) -> None:
        """Write every cancellation kept, and the roll mark, as one snapshot record: the
        records before it are no longer needed."""
        with self.lock:
            self.timer = {i: d for i, d in self.timer.items() if i >= self.rolled_below}
            entry = {"kind": "snapshot", "rolled_below": self.rolled_below,
                     "timer": sorted(self.timer.items()), "levels": sorted(self.levels)}
            self.base = self._put(entry, "the cancellations' snapshot").queue_offsets[0]

    def _put(self, entry: dict, what: str):
        """(locked) Write one record of the timer-cancel topic, durably (its put result)."""
        res = self.store.put(RecordBatch(TIMER_CANCEL_TOPIC, 0, [json.dumps(entry).encode()]))
        if res.status is not PutStatus.PUT_OK:  # (as the coordinator's log write)
            raise RequestTimeoutError(f"{what} did not reach the disk within "
                                      f"flush_timeout_ms; retry")
        return res

    def retention_pin(self) -> tuple[str, int, int]:
        return (TIMER_CANCEL_TOPIC, 0, self.base)

    def _keep(self, entry: dict) -> None:
        kind = entry["kind"]
        if kind == "timer":
            self.timer[entry["index"]] = entry["due"]
        elif kind == "level":
            self.levels.add((entry["level"], entry["index"]))
        elif kind == "rolled":
            self.rolled_below = max(self.rolled_below, entry["below"])
        else:  # a snapshot: everything before it is in it
            self.timer = {int(i): int(d) for i, d in entry["timer"]}
            self.levels = {(int(lv), int(i)) for lv, i in entry["levels"]}
            self.rolled_below = max(self.rolled_below, entry["rolled_below"])

    def _load(self) -> None:
        for m in self.store.scan_queue(TIMER_CANCEL_TOPIC, 0):
            entry = json.loads(m.body)
            self._keep(entry)
            if entry["kind"] == "snapshot":
                self.base = m.queue_offset


class TimerScheduler:
    """Delivers one shard's timer messages; owns its background thread."""

    def __init__(self, shard: int, store: MessageStore, directory: str, bucket_ms: int,
                 tick_ms: int, clock: Clock, metrics, on_delivered: Callable[[], None],
                 cancellations: Cancellations):
        self.shard = shard
        self.store = store
        self.clock = clock
        self.metrics = metrics
        self.tick_ms = tick_ms
        self.cancels = cancellations
        self._on_delivered = on_delivered  # wakes long-polling pulls
        self.wheel = TimerWheel(directory, bucket_ms)
        self._lock = threading.Lock()  # one round (or cancel) at a time
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_round_ms = 0  # when the thread's next round is (0: now)
        ck = self.wheel.read_checkpoint()
        self._indexed = int(ck.get("indexed", 0))
        self._current: int | None = ck.get("current")
        self._done = self._read_done(int(ck.get("done_offset", 0)))
        self._loaded: np.ndarray | None = None
        self._pos = 0
        if self._current is not None:  # what a crash after the checkpoint left behind
            for key in self.wheel.keys():
                if key < self._current:
                    self.wheel.drop(key)
            self._forget_passed_cancels()
        self.max_lateness_ms = 0
        self.delivered = 0

    def _forget_passed_cancels(self) -> None:
        """Cancellations of messages a finished bucket passed (skipped back then) are
        forgotten on start.  One due in a finished bucket but indexed late (a due time
        already past when indexed, as after the wall clock stepped back) sits in the
        current bucket or is not indexed yet: kept."""
        stale = [i for i, due in self.cancels.timer.items()
                 if self.wheel.key_of(due) < self._current and i < self._indexed]
        if stale:
            waiting = set(self.wheel.load(self._current)["index"].tolist())
            for index in stale:
                if index not in waiting:
                    del self.cancels.timer[index]

    # ----------------------------------------------------------- delivery
    def deliver_due(self) -> int:
        """Index new timer messages and deliver the due ones; the wait (ms) to the next."""
        with self._lock:
            now = self.clock.now_ms()
            self._index_new(now)
            bucket_ms = self.wheel.bucket_ms
            while True:
                if self._loaded is None:
                    self._load()
                loaded = self._loaded
                n_due = int(np.searchsorted(loaded["due"], now, "right"))
                if self._pos < n_due:
                    self._deliver(loaded[self._pos:n_due], now)
                    self._pos = n_due
                if self._pos < len(loaded):
                    return int(max(1, min(self.tick_ms, loaded["due"][self._pos] - now)))
                end_ms = (self._current + 1) * bucket_ms
                if now < end_ms:
                    nxt = end_ms - now
                    return int(max(1, min(self.tick_ms, nxt)))
                self._finish_bucket(now)

    def _index_new(self, now: int) -> None:
        """Put timer-log entries not yet in the wheel into their buckets (a due time in a
        finished bucket goes to the current one: due now)."""
        if self._current is None:  # the first round: from the bucket of now, or earlier
            self._current = min([int(self.wheel.key_of(now))] + self.wheel.keys()[:1])
        end = self.store.max_queue_offset(TIMER_TOPIC, 0)
        # (entries below the roll mark were re-written at the head: their copies count)
        self._indexed = max(self._indexed, self.cancels.rolled_below)
        while self._indexed < end:
            entries = self.store.read_cq(TIMER_TOPIC, 0, self._indexed, INDEX_CHUNK)
            if not len(entries):
                break
            dues = entries["tag"].astype(np.int64)
            indexes = np.arange(self._indexed, self._indexed + len(entries), dtype=np.int64)
            keys = np.maximum(self.wheel.key_of(dues), self._current)
            self.wheel.add(keys, indexes, dues)
            mine = keys == self._current
            if mine.any() and self._loaded is not None:
                self._merge_current(indexes[mine], dues[mine])
            self._indexed += len(entries)

    def _merge_current(self, indexes: np.ndarray, dues: np.ndarray) -> None:
        """New entries of the bucket being delivered: into the loaded part not yet
        delivered (their due times are ahead of every delivered one)."""
        rest = self._loaded[self._pos:]
        add = np.empty(len(indexes), rest.dtype)
        add["index"], add["due"] = indexes, dues
        both = np.concatenate([rest, add])
        both = both[np.lexsort((both["index"], both["due"]))]
        self._loaded, self._pos = both, 0

    def _load(self) -> None:
        pairs = self.wheel.load(self._current)
        pairs = pairs[pairs["index"] >= self.cancels.rolled_below]
        if self._done and len(pairs):
            pairs = pairs[~np.isin(pairs["index"], np.fromiter(self._done, np.int64))]
        self._loaded, self._pos = pairs, 0

    def _deliver(self, due: np.ndarray, now: int) -> None:
        """Deliver ``due`` entries (cancelled ones are only marked done), in puts of at
        most ``DELIVERY_MAX_BYTES``."""
        indexes = due["index"]
        skip = np.isin(indexes, np.fromiter(self.cancels.timer, np.int64)) \
            if self.cancels.timer else np.zeros(len(indexes), bool)
        lo = 0
        while lo < len(indexes):
            entries = self._cq_entries(indexes[lo:])
            total = np.cumsum(np.where(skip[lo:], 0, entries["size"]))
            take = max(1, int(np.searchsorted(total, DELIVERY_MAX_BYTES, "right")))
            part, part_skip = indexes[lo:lo + take], skip[lo:lo + take]
            live = entries[:take][~part_skip]
            msgs = for_live_topics(self.store, self.store.messages_at(live).messages()) \
                if len(live) else []
            batch = restore_real(self.shard, msgs).with_records(
                [Record(TIMER_DONE_TOPIC, 0, part.astype("<i8").tobytes())]) if msgs \
                else RecordBatch(TIMER_DONE_TOPIC, 0, [part.astype("<i8").tobytes()])
            seq = self.store.last_sequence(TIMER_PID) + 1
            self.store.put(batch, producer_id=TIMER_PID, sequence=seq)
            self._done.update(part.tolist())
            for i in part[part_skip].tolist():
                self.cancels.timer.pop(i, None)
            if msgs:
                dues = due["due"][lo:lo + take][~part_skip]
                late = now - dues
                self.max_lateness_ms = max(self.max_lateness_ms, int(late.max()))
                self.metrics.observe("timer_lateness_ms", float(late.max()))
                self.delivered += len(msgs)
                self._on_delivered()
            lo += take

    def _cq_entries(self, indexes: np.ndarray) -> np.ndarray:
        """Timer-log entries at ``indexes`` (read in runs of nearby indexes), in order."""
        lo, hi = int(indexes.min()), int(indexes.max()) + 1
        if hi - lo <= 4 * len(indexes) + 1024:
            span = self.store.read_cq(TIMER_TOPIC, 0, lo, hi - lo)
            return span[indexes - lo]
        out = np.empty(len(indexes), CQ_ENTRY)
        for k, i in enumerate(indexes.tolist()):  # scattered: one entry each
            out[k] = self.store.read_cq(TIMER_TOPIC, 0, i, 1)[0]
        return out

    def _finish_bucket(self, now: int) -> None:
        """The current bucket is delivered and its time is over: checkpoint, drop its
        file, go on with the next bucket that has messages (or the one of now)."""
        done_key = self._current
        target = int(self.wheel.key_of(now))
        nxt = self.wheel.next_key(done_key)
        self._current = target if nxt is None else min(nxt, target)
        self.wheel.write_checkpoint({
            "indexed": self._indexed, "current": self._current,
            "done_offset": self.store.max_queue_offset(TIMER_DONE_TOPIC, 0)})
        self.wheel.drop(done_key)
        self._done.clear()
        self._loaded, self._pos = None, 0

    def _read_done(self, offset: int) -> set[int]:
        done: set[int] = set()
        for m in self.store.scan_queue(TIMER_DONE_TOPIC, 0, offset):
            done.update(np.frombuffer(m.body, "<i8").tolist())
        return done

    # ---------------------------------------------------------- replication
    def replica_part(self, every_ms: int) -> Part:
        """The wheel as a leader ships it to its followers (``raymq.actors.replication.parts``):
        read under the round lock, so its checkpoint and the buckets it vouches for agree
        (entries after the checkpoint are indexed again by a new leader, as after a
        restart); at most every ``every_ms`` (``replica_timer_ship_ms``: it changes with
        every bucket)."""
        checkpoint = os.path.join(self.wheel.directory, "checkpoint.json")

        def version():
            try:
                return os.stat(checkpoint).st_mtime_ns
            except FileNotFoundError:
                return None

        def read():
            with self._lock:
                return read_tree(self.wheel.directory, WHEEL_DIR)
        return {"name": "timer", "version": version, "read": read, "directory": WHEEL_DIR,
                "every_ms": every_ms}

    # ---------------------------------------------------------- operators
    def cancel(self, m: StoredMessage) -> str:
        """Cancel the timer message ``m`` (its copy in the timer topic): 'cancelled', or
        'already cancelled'; ``AlreadyDeliveredError`` once it was delivered."""
        index, due = m.queue_offset, m.tag_code
        with self._lock:
            if index in self.cancels.timer:
                return "already cancelled"
            if self._was_delivered(index, due):
                raise AlreadyDeliveredError(f"message {make_msg_id(self.shard, m.phys_offset)} "
                                            f"was already delivered (due at {due})")
            self.cancels.record({"kind": "timer", "index": index, "due": due})
        return "cancelled"

    def _was_delivered(self, index: int, due: int) -> bool:
        """Whether timer-log entry ``index`` (due at ``due``) was delivered (under the lock).

        Finished buckets were delivered whole; the current one holds what it delivered
        in ``_done``.  An entry indexed into the current bucket although due in an
        earlier one (indexed late) is in the loaded part until delivered.
        """
        if index in self._done:
            return True
        if index >= self._indexed or self._current is None:
            return False  # not in the wheel yet
        if self.wheel.key_of(due) >= self._current:
            return False
        if self._loaded is None:
            self._load()
        return not bool(np.isin(index, self._loaded["index"][self._pos:]))

    def retention_pins(self) -> list[tuple[str, int, int]]:
        """What retention must keep of the timer topics: every timer not delivered yet
        (the lowest index a bucket holds, and what is not indexed into the wheel yet),
        and the done records past the checkpoint's."""
        with self._lock:
            loaded = self._loaded
            if loaded is None:  # (the bucket being delivered: what it has not delivered)
                oldest = self.wheel.oldest_index()
            else:
                rest = loaded["index"][self._pos:]
                oldest = min([x for x in (self.wheel.oldest_index(besides=self._current),
                                          int(rest.min()) if len(rest) else None)
                              if x is not None], default=None)
            indexed = self._indexed
            done = int(self.wheel.read_checkpoint().get("done_offset", 0))
        first = indexed if oldest is None else min(oldest, indexed)
        return [(TIMER_TOPIC, 0, first), (TIMER_DONE_TOPIC, 0, done)]

    def status(self) -> dict:
        """Scheduled counts by when they are due, and the delivery lag now."""
        now = self.clock.now_ms()
        with self._lock:
            self._index_new(now)
            if self._loaded is None:
                self._load()
            counts = dict(self.wheel.counts)
            done_in_current = len(self._done)
            loaded = self._loaded
            pos = self._pos
            pending = max(0, self.store.max_queue_offset(TIMER_TOPIC, 0) - self._indexed)
        out = {name: 0 for name, _ms in STATUS_BUCKETS}
        out["later"] = 0
        if self._current in counts:
            counts[self._current] = max(0, counts[self._current] - done_in_current)
        for key, n in counts.items():
            start = key * self.wheel.bucket_ms
            for name, ms in STATUS_BUCKETS:
                if start < now + ms:
                    out[name] += n
                    break
            else:
                out["later"] += n
        out["next_minute"] += pending
        out["scheduled"] = sum(counts.values()) + pending
        lag = 0
        if loaded is not None and pos < len(loaded) and loaded["due"][pos] <= now:
            lag = int(now - loaded["due"][pos])
        out["lag_ms"] = lag
        out["max_lateness_ms"] = self.max_lateness_ms
        out["cancelled"] = len(self.cancels.timer) + len(self.cancels.levels)
        return out

    def list_due(self, due_before_ms: int, limit: int = 100) -> list[dict]:
        """Timer messages due before ``due_before_ms`` not yet delivered, soonest first
        (those stored but not yet indexed too: indexed first, as ``status`` does)."""
        out: list[dict] = []
        with self._lock:
            self._index_new(self.clock.now_ms())
            keys = [k for k in self.wheel.keys() if k * self.wheel.bucket_ms < due_before_ms]
            for key in keys:
                pairs = self.wheel.load(key)
                pairs = pairs[pairs["due"] < due_before_ms]
                for index, due in zip(pairs["index"].tolist(), pairs["due"].tolist()):
                    if index in self._done or index in self.cancels.timer:
                        continue
                    entry = self.store.read_cq(TIMER_TOPIC, 0, index, 1)
                    m = self.store.get_message(int(entry["phys"][0]), int(entry["size"][0]))
                    out.append({"msg_id": m.properties.get(
                                    Prop.PRODUCER_MSG_ID, make_msg_id(self.shard, m.phys_offset)),
                                "topic": m.properties.get(Prop.REAL_TOPIC),
                                "queue_id": int(m.properties.get(Prop.REAL_QID, -1)),
                                "due_ms": due, "key": m.key, "tags": m.tags,
                                "shard": self.shard})
                    if len(out) >= limit:
                        return out
        return out

    # ------------------------------------------------------- background thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"raymq-timer-{self.shard}",
                                        daemon=True)
        self._thread.start()

    def scheduled(self, first_due_ms: int) -> None:
        """Timer messages were stored, the first due at ``first_due_ms``: a round now if
        that is before the thread's next one (else they are indexed on its next tick:
        fewer, larger index steps while sends stream in)."""
        if first_due_ms < self._next_round_ms:
            self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # (a wake from here on ends the wait below at once)
            delivered = self.delivered
            try:
                wait_ms = self.deliver_due()
            except Exception:  # keep delivering; the next round retries
                log.exception("shard-%d: timer delivery failed", self.shard)
                wait_ms = 1000
            if self.delivered != delivered:
                # a burst: let more come due per round (each round costs a put and an
                # fsync; rounds back to back would starve the shard's other work)
                wait_ms = max(wait_ms, ROUND_GAP_MS)
            self._next_round_ms = self.clock.now_ms() + wait_ms
            self._wake.wait(wait_ms / 1000.0)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()  # (ends the wait; the loop sees the stop)
        if self._thread is not None:
            self._thread.join()


def cancel_scheduled(m: StoredMessage, timers: TimerScheduler, delays) -> str:
    """Cancel the stored message ``m`` of a shard (``BrokerShard.cancel_scheduled``): a
    timer message, or a delay-level one (``DelayScheduler``)."""
    msg_id = make_msg_id(timers.shard, m.phys_offset)
    if m.topic == TIMER_TOPIC:
        return timers.cancel(m)
    if m.topic == SCHEDULE_TOPIC:
        return delays.cancel(m.queue_id + 1, m.queue_offset, msg_id)
    if Prop.DELIVER_AT in m.properties:  # due when it was sent: stored in its queue
        raise AlreadyDeliveredError(f"message {msg_id} was already delivered (due when it "
                                    f"was sent)")
    raise NotScheduledError(f"message {msg_id} is not a delayed or timer message")


