"""BrokerShard: one shard's broker logic over its MessageStore.

A plain class (no Ray import): the Ray actor is made from it at the edge
(``cluster.deploy``), and tests can run it in-process.  All public methods are
thread-safe; the actor serves them from a thread pool.

Idempotence of methods (what a retried Ray call may do):
- ``send`` with a producer id and sequence: idempotent (the store dedupes).
- ``commit_offsets``: idempotent (sets, never adds).
- ``send_back``: not idempotent; a retried call may produce a second retry copy
  (at-least-once redelivery, never loss).
- reads (``pull``, ``get_message``, ...): no effect.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Iterable

import numpy as np

from cluster.config import ClusterConfig
from cluster.message import (SCHEDULE_TOPIC, Prop, dlq_topic, make_msg_id, retry_topic)
from storage import MessageStore, RecordBatch
from storage.clock import Clock, SystemClock
from storage.errors import InvalidMessageError, OffsetOutOfRangeError, UnknownTopicError
from storage.records import MessageBatch, StoredMessage, SysFlag, tags_hash

log = logging.getLogger("raymq.shard")

#: Producer ids of the shard's own writers (clients draw theirs below 2**62).
SCHEDULER_PID_BASE = 1 << 62


class NullMetrics:
    def inc(self, name: str, value: float = 1.0, **tags) -> None:
        pass

    def set(self, name: str, value: float, **tags) -> None:
        pass

    def observe(self, name: str, value: float, **tags) -> None:
        pass


def offset_key(group: str, topic: str, queue_id: int) -> str:
    return f"{group}@{topic}@{queue_id}"


class BrokerShard:
    def __init__(self, index: int, config: dict | ClusterConfig, *,
                 fetch_routes: Callable[[int], list] | None = None,
                 clock: Clock | None = None, metrics=None, background: bool = True):
        self.index = index
        self.config = config if isinstance(config, ClusterConfig) else ClusterConfig.from_dict(config)
        self.clock = clock or SystemClock()
        self.metrics = metrics or NullMetrics()
        self.directory = os.path.join(self.config.resolved_data_dir(), f"shard-{index}")
        self.store = MessageStore(self.directory, self.config.store_config(), self.clock,
                                  background=background)
        self._fetch_routes = fetch_routes
        self._routes: set[tuple[str, int]] = set()
        self._routes_lock = threading.Lock()
        self._new_data = threading.Condition()
        self._data_version = 0
        self._levels_ms = self.config.delay_levels_ms
        self._stop = threading.Event()
        self._scheduler: threading.Thread | None = None
        self.max_lateness_ms = 0
        if background:
            self._scheduler = threading.Thread(target=self._schedule_loop,
                                               name=f"raymq-schedule-{index}", daemon=True)
            self._scheduler.start()

    # ------------------------------------------------------------- routes
    def set_routes(self, routes: Iterable[tuple[str, int]]) -> None:
        with self._routes_lock:
            self._routes = {(t, int(q)) for t, q in routes}

    def _check_routes(self, keys: set[tuple[str, int]]) -> None:
        with self._routes_lock:
            missing = keys - self._routes
        if missing and self._fetch_routes is not None:
            self.set_routes(self._fetch_routes(self.index))
            with self._routes_lock:
                missing = keys - self._routes
        if missing:
            topic, qid = sorted(missing)[0]
            raise UnknownTopicError(f"queue {topic}/{qid} is not served by shard-{self.index} "
                                    "(unknown topic, or a stale route: refresh and retry)")

    # --------------------------------------------------------------- send
    def send(self, batch: RecordBatch, producer_id: int = 0, sequence: int = 0) -> dict:
        """Store a producer request.  Idempotent with a producer id and sequence."""
        n = len(batch)
        if not n:
            return {"status": "SEND_OK", "phys": [], "queue_offsets": [], "duplicate": False}
        keys = set(zip(batch.column("topics"), batch.column("queue_ids"))) \
            if isinstance(batch.topics, list) or isinstance(batch.queue_ids, list) \
            else {(batch.topics, batch.queue_ids)}
        self._check_routes(keys)
        if batch.properties is not None:
            batch = self._redirect_delayed(batch)
        res = self.store.put(batch, producer_id=producer_id, sequence=sequence)
        self._wake_pullers()
        self.metrics.inc("messages_in", n)
        self.metrics.inc("bytes_in", float(res.size_array.sum()))
        status = "SEND_OK" if res.status.name == "PUT_OK" else "FLUSH_DISK_TIMEOUT"
        return {"status": status, "phys": res.phys_array.tolist(),
                "queue_offsets": res.queue_offset_array.tolist(), "duplicate": res.duplicate}

    def _redirect_delayed(self, batch: RecordBatch) -> RecordBatch:
        """Messages with a delay level go to the schedule topic, the real place in properties."""
        props = batch.properties
        if not any(p and (Prop.DELAY in p or Prop.DELIVER_AT in p) for p in props):
            return batch
        now = self.clock.now_ms()
        topics, qids = batch.column("topics"), batch.column("queue_ids")
        flags, tag_codes = batch.column("flags"), batch.column("tag_codes")
        new_props = list(props)
        for i, p in enumerate(props):
            if not p:
                continue
            if Prop.DELIVER_AT in p:
                raise InvalidMessageError("deliver_at_ms is not supported yet; use delay_level "
                                          "(arbitrary deliver-at times come with the timer issue)")
            if Prop.DELAY not in p:
                continue
            level = int(p[Prop.DELAY])
            if not 1 <= level <= len(self._levels_ms):
                raise InvalidMessageError(f"delay level {level} is not 1..{len(self._levels_ms)}")
            q = dict(p)
            q[Prop.REAL_TOPIC] = topics[i]
            q[Prop.REAL_QID] = str(qids[i])
            q[Prop.REAL_FLAGS] = str(flags[i])
            new_props[i] = q
            topics[i] = SCHEDULE_TOPIC
            qids[i] = level - 1
            flags[i] = int(SysFlag.SCHEDULED)
            tag_codes[i] = now + self._levels_ms[level - 1]
        return RecordBatch(topics, qids, batch.bodies, keys=batch.keys, tags=batch.tags,
                           properties=new_props, flags=flags, born_ms=batch.born_ms,
                           reconsume=batch.reconsume, prepared_offsets=batch.prepared_offsets,
                           tag_codes=tag_codes)

    def _wake_pullers(self) -> None:
        with self._new_data:
            self._data_version += 1
            self._new_data.notify_all()

    # --------------------------------------------------------------- pull
    def pull(self, requests: list[tuple[str, int, int, int]], wait_ms: int = 0,
             tags: dict[str, list[str]] | None = None) -> list[tuple]:
        """Read several queues: [(topic, qid, offset, max)] -> [(topic, qid, batch, next, max)].

        Waits up to ``wait_ms`` for new data when every queue is empty (long
        polling).  ``tags`` filters by topic: only messages whose tag is listed.
        An offset past the end is answered with the end as next offset.
        """
        deadline = self.clock.monotonic_ms() + wait_ms
        while True:
            with self._new_data:
                version = self._data_version
            out, total = self._pull_once(requests, tags)
            remaining = deadline - self.clock.monotonic_ms()
            if total or remaining <= 0:
                return out
            with self._new_data:
                if self._data_version == version:
                    self._new_data.wait(remaining / 1000.0)

    def _pull_once(self, requests, tags):
        out, total = [], 0
        for topic, qid, offset, max_n in requests:
            if offset < 0:
                raise OffsetOutOfRangeError(f"negative offset {offset} for {topic}/{qid}")
            end = self.store.max_queue_offset(topic, qid)
            if offset >= end:
                out.append((topic, qid, MessageBatch.empty(), min(offset, end), end))
                continue
            entries = self.store.read_cq(topic, qid, offset, max_n)
            next_offset = offset + len(entries)
            wanted = tags.get(topic) if tags else None
            if wanted:
                codes = np.array([tags_hash(t) for t in wanted], np.int64)
                entries = entries[np.isin(entries["tag"], codes)]
            batch = self.store.messages_at(entries)
            if wanted and len(batch):
                keep = [i for i, t in enumerate(batch.tags or [None] * len(batch)) if t in wanted]
                if len(keep) != len(batch):
                    batch = _select(batch, keep)
            total += len(batch)
            out.append((topic, qid, batch, next_offset, end))
        if total:
            self.metrics.inc("messages_out", total)
        return out, total

    # ------------------------------------------------------------ offsets
    def commit_offsets(self, group: str, offsets: dict[tuple[str, int], int]) -> None:
        """Set committed offsets of a group (next offset to consume).  Idempotent."""
        values = {}
        for (topic, qid), off in offsets.items():
            end = self.store.max_queue_offset(topic, qid)
            if not isinstance(off, int) or off < 0 or off > end:
                raise OffsetOutOfRangeError(
                    f"cannot commit offset {off!r} for {topic}/{qid} of group {group!r}: "
                    f"the queue holds offsets 0..{end}")
            values[offset_key(group, topic, qid)] = off
        if values:
            self.store.offsets.update(values)

    def get_offsets(self, group: str, queues: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Committed offsets (-1: none yet)."""
        return {(t, q): self.store.offsets.get(offset_key(group, t, q)) for t, q in queues}

    def queue_info(self) -> dict:
        if self._fetch_routes is not None:
            self.set_routes(self._fetch_routes(self.index))
        with self._routes_lock:
            routes = sorted(self._routes)
        depth = {f"{t}/{q}": self.store.max_queue_offset(t, q) for t, q in routes}
        groups: dict[str, dict[str, int]] = {}
        for key, off in self.store.offsets.snapshot().items():
            parts = key.split("@")
            if len(parts) == 3:
                group, topic, qid = parts
                end = self.store.max_queue_offset(topic, int(qid))
                groups.setdefault(group, {})[f"{topic}/{qid}"] = end - off
        for group, lags in groups.items():
            self.metrics.set("consumer_lag", float(sum(lags.values())), group=group)
        return {"shard": self.index, "queues": depth, "lag": groups,
                "schedule_pending": {lvl + 1: self.store.max_queue_offset(SCHEDULE_TOPIC, lvl)
                                     - self._schedule_progress(lvl + 1)
                                     for lvl in range(len(self._levels_ms))
                                     if self.store.max_queue_offset(SCHEDULE_TOPIC, lvl)},
                "max_delay_lateness_ms": self.max_lateness_ms,
                "log_bytes": self.store.max_phys_offset}

    # -------------------------------------------------- retry / dead letters
    def send_back(self, group: str, phys_offset: int, *, reason: str = "",
                  dead_letter: bool = False) -> dict:
        """A consumer failed on a message: redeliver it later, or dead-letter it.

        The copy goes to the group's retry topic (queue = this shard) through
        the delay levels (``retry_first_level`` + reconsume count); once the
        reconsume count reaches ``max_reconsume`` it goes to the group's
        dead-letter topic instead.
        """
        m = self.store.get_message(phys_offset)
        props = dict(m.properties)
        origin = props.get(Prop.ORIGIN_MSG_ID) or make_msg_id(self.index, phys_offset)
        count = m.reconsume_count + 1
        props[Prop.ORIGIN_MSG_ID] = origin
        props[Prop.RETRY_TOPIC] = props.get(Prop.RETRY_TOPIC, m.topic)
        props[Prop.CONSUME_GROUP] = group
        for p in (Prop.DELAY, Prop.REAL_TOPIC, Prop.REAL_QID, Prop.REAL_FLAGS):
            props.pop(p, None)
        if count > self.config.max_reconsume or dead_letter:
            topic = dlq_topic(group)
            props[Prop.DLQ_REASON] = reason[:500] or "max reconsume count reached"
            self.metrics.inc("dead_letters", 1, group=group)
        else:
            topic = retry_topic(group)
            level = min(self.config.retry_first_level + count - 1, len(self._levels_ms))
            props[Prop.DELAY] = str(level)
            self.metrics.inc("retries", 1, group=group)
        batch = RecordBatch(topic, self.index, [m.body], keys=[m.key], tags=[m.tags],
                            properties=[props], born_ms=m.born_ms, reconsume=count)
        res = self.send(batch)
        return {"topic": topic, "reconsume_count": count, "phys": res["phys"][0]}

    def dlq_list(self, group: str, offset: int = 0, max_messages: int = 100) -> list[StoredMessage]:
        return self.store.read_queue(dlq_topic(group), self.index, offset, max_messages)

    def dlq_resend(self, group: str, phys_offsets: list[int] | None = None) -> list[str]:
        """Send dead letters back to the group's retry topic, reconsume count reset.

        Without ``phys_offsets``: every dead letter not resent before (progress
        is durable).  Returns the ids of the resent dead letters.
        """
        topic = dlq_topic(group)
        progress_key = f"dlq-resend@{group}@{self.index}"
        if phys_offsets is None:
            start = max(0, self.store.offsets.get(progress_key, 0))
            msgs = self.store.read_queue(topic, self.index, start,
                                         self.store.max_queue_offset(topic, self.index) - start)
        else:
            msgs = [self.store.get_message(p) for p in phys_offsets]
            bad = [m for m in msgs if m.topic != topic]
            if bad:
                raise InvalidMessageError(f"{make_msg_id(self.index, bad[0].phys_offset)} is not "
                                          f"a dead letter of group {group!r}")
        if not msgs:
            return []
        props = []
        for m in msgs:
            p = dict(m.properties)
            p.pop(Prop.DLQ_REASON, None)
            props.append(p)
        self.send(RecordBatch(retry_topic(group), self.index, [m.body for m in msgs],
                              keys=[m.key for m in msgs], tags=[m.tags for m in msgs],
                              properties=props, born_ms=[m.born_ms for m in msgs]))
        if phys_offsets is None:
            self.store.offsets.update({progress_key: msgs[-1].queue_offset + 1})
        return [make_msg_id(self.index, m.phys_offset) for m in msgs]

    # -------------------------------------------------------------- query
    def get_message(self, phys_offset: int) -> StoredMessage:
        return self.store.get_message(phys_offset)

    def find_by_key(self, topic: str, key: str, max_scan: int = 200_000) -> list[StoredMessage]:
        """Messages of ``topic`` on this shard with ``key``, scanning the newest ``max_scan``."""
        found = []
        for t, qid in self.store.queues():
            if t != topic:
                continue
            end = self.store.max_queue_offset(t, qid)
            start = max(0, end - max_scan)
            for off in range(start, end, 1000):
                batch = self.store.read_batch(t, qid, off, 1000)
                if batch.keys:
                    found += [batch[i] for i, k in enumerate(batch.keys) if k == key]
        return found

    # --------------------------------------------------------- delay levels
    def _schedule_progress(self, level: int) -> int:
        return self.store.last_sequence(SCHEDULER_PID_BASE + level)

    def deliver_due(self) -> int:
        """Move every due scheduled message to its real queue; return the wait (ms) to the next.

        Progress of a level is the producer sequence of its deliveries, so a
        delivery repeated after a crash is recognised and not stored twice.
        """
        now = self.clock.now_ms()
        next_wait = self.config.schedule_tick_ms
        for lvl in range(len(self._levels_ms)):
            level = lvl + 1
            end = self.store.max_queue_offset(SCHEDULE_TOPIC, lvl)
            start = self._schedule_progress(level)
            while start < end:
                entries = self.store.read_cq(SCHEDULE_TOPIC, lvl, start, 1000)
                is_due = entries["tag"] <= now  # FIFO per level: stop at the first not due
                due = len(is_due) if is_due.all() else int(np.argmin(is_due))
                if due == 0:
                    next_wait = min(next_wait, int(entries["tag"][0] - now))
                    break
                msgs = self.store.messages_at(entries[:due]).messages()
                self.store.put(_restore_real(msgs), producer_id=SCHEDULER_PID_BASE + level,
                               sequence=start + due)
                late = int(now - entries["tag"][:due].min())
                self.max_lateness_ms = max(self.max_lateness_ms, late)
                self.metrics.observe("delay_lateness_ms", float(late))
                self._wake_pullers()
                start += due
                if due < len(entries):
                    next_wait = min(next_wait, int(entries["tag"][due] - now))
                    break
        return max(1, next_wait)

    def _schedule_loop(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self.deliver_due()
            except Exception:  # keep delivering; the next round retries
                log.exception("shard-%d: delay delivery failed", self.index)
                wait = 1000
            self._stop.wait(min(wait, self.config.schedule_tick_ms) / 1000.0)

    # ---------------------------------------------------------------- admin
    def ping(self) -> dict:
        return {"shard": self.index, "directory": self.directory, "pid": os.getpid()}

    def close(self) -> None:
        self._stop.set()
        if self._scheduler is not None:
            self._scheduler.join()
        self.store.close()


def _restore_real(msgs: list[StoredMessage]) -> RecordBatch:
    props = []
    for m in msgs:
        p = dict(m.properties)
        for k in (Prop.DELAY, Prop.REAL_TOPIC, Prop.REAL_QID, Prop.REAL_FLAGS):
            p.pop(k, None)
        props.append(p or None)
    return RecordBatch([m.properties[Prop.REAL_TOPIC] for m in msgs],
                       [int(m.properties[Prop.REAL_QID]) for m in msgs],
                       [m.body for m in msgs], keys=[m.key for m in msgs],
                       tags=[m.tags for m in msgs],
                       properties=props if any(props) else None,
                       flags=[int(m.properties.get(Prop.REAL_FLAGS, 0)) for m in msgs],
                       born_ms=[m.born_ms for m in msgs],
                       reconsume=[m.reconsume_count for m in msgs],
                       prepared_offsets=[m.prepared_offset for m in msgs])


def _select(batch: MessageBatch, keep: list[int]) -> MessageBatch:
    pick = lambda col: None if col is None else [col[i] for i in keep]  # noqa: E731
    return MessageBatch(batch.headers[keep], pick(batch.phys_offsets), pick(batch.topics),
                        pick(batch.keys), pick(batch.tags), pick(batch.properties),
                        pick(batch.bodies))
