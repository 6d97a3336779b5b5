"""BrokerShard: one shard's broker logic over its MessageStore.

A plain class (no Ray import): the Ray actor is made from it at the edge
(``raymq.deploy``), and tests can run it in-process.  All public methods are
thread-safe; the actor serves them from a thread pool.

Idempotence of methods (what a retried Ray call may do):
- ``send`` with a producer id and sequence: idempotent (the store dedupes).
- ``commit_offsets``: idempotent (sets, never adds).
- ``send_back``: not idempotent; a retried call may produce a second retry copy
  (at-least-once redelivery, never loss).
- ``dlq_resend``: without ids, idempotent (its copies carry their progress as an
  internal producer sequence); with ids, each call resends them.
- ``end_transactions`` / ``resolve_half``: idempotent (a resolved half stays resolved).
- ``check_round``: safe to repeat (stale copies are skipped).
- ``uncount_checks``: idempotent (only a copy still carrying that count is changed).
- reads (``pull``, ``get_message``, ...): no effect.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import Callable, Iterable, NamedTuple

import numpy as np

from raymq.actors.config import ClusterConfig
from raymq.actors.half_logic import (Action, CheckPolicy, HalfState, HalfView, IllegalTransition,
                                 next_state, op_progress, plan_round)
from raymq.actors.protocol import (CHECK_EXPIRED_TOPIC, HALF_TOPIC, OP_TOPIC, SCHEDULE_TOPIC, Prop,
                             dlq_topic, make_msg_id, retry_topic)
from raymq.storage import MessageStore, RecordBatch
from raymq.storage.store import PutStatus
from raymq.storage.clock import Clock, SystemClock
from raymq.storage.errors import (CorruptLogError, InvalidMessageError, OffsetOutOfRangeError,
                            StorageError, UnknownTopicError)
from raymq.storage.producers import INTERNAL_PRODUCER_BASE
from raymq.storage.records import (MAX_USER_PROPERTIES_BYTES, MessageBatch, Record, StoredMessage,
                             SysFlag, check_user_properties, tags_hash)

log = logging.getLogger("raymq.shard")

#: Producer ids of the shard's own writers (clients draw theirs below 2**62).
SCHEDULER_PID_BASE = INTERNAL_PRODUCER_BASE
#: Dead-letter resends: this plus a 56-bit hash of the group (``_dlq_resend_pid``).
DLQ_RESEND_PID_BASE = INTERNAL_PRODUCER_BASE + (1 << 61)


class NullMetrics:
    def inc(self, name: str, value: float = 1.0, **tags) -> None:
        pass

    def set(self, name: str, value: float, **tags) -> None:
        pass

    def observe(self, name: str, value: float, **tags) -> None:
        pass

    def flush(self) -> None:
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
        self._tx_lock = threading.RLock()
        self._dlq_lock = threading.Lock()  # one resend of all dead letters at a time
        self._schedule_lock = threading.Lock()  # one delivery of due messages at a time
        self._pending_halves: dict[int, int] = {}    # unresolved origin -> its latest copy
        self._latest_copy: dict[int, int] = {}       # origin -> queue offset of its latest copy
        self._half_size: dict[int, int] = {}         # pending origin -> its record size
        self._half_cache: dict[int, _Half] = {}      # pending origin -> the half as sent
        self._resolved: dict[int, HalfState] = {}   # origin -> COMMITTED/ROLLED_BACK/EXPIRED
        self._waiting_groups: set[str] = set()
        self._fault: str | None = None
        self._cut_back_offsets()
        self._load_transactions()
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
    def send(self, batch: RecordBatch | None, producer_id: int = 0, sequence: int = 0,
             ends: list | None = None) -> dict:
        """Store a producer request.  Idempotent with a producer id and sequence.

        ``ends`` are transaction ends riding on the request (``end_transactions``;
        idempotent too): applied after the batch is written, their outcomes
        returned under ``"ends"``.  The reply waits for one fsync covering both.
        """
        if isinstance(producer_id, int) and producer_id >= INTERNAL_PRODUCER_BASE:
            # the shard's own writers keep their progress as such producers' sequences
            raise InvalidMessageError(f"producer id {producer_id} is reserved for the broker "
                                      f"(client ids are below 2**62)")
        if batch is not None and batch.properties is not None:
            for p in batch.properties:  # (with what a client adds: delay, transaction)
                check_user_properties(p, MAX_USER_PROPERTIES_BYTES + 1024)
        return self._store_request(batch, producer_id, sequence, ends)

    def _store_request(self, batch: RecordBatch | None, producer_id: int, sequence: int,
                       ends: list | None) -> dict:
        if not ends:
            return self._send(batch, producer_id, sequence, wait=True)[0]
        n = len(batch) if batch is not None else 0
        if not n or self._fault is not None:
            out, written = self._send(batch, producer_id, sequence, wait=False)
            out["ends"] = self.end_transactions(ends)  # its fsync covers the batch too
            if written is not None:
                durable = self.store.wait_durable(written) is PutStatus.PUT_OK
                if not durable:
                    out["status"] = "FLUSH_DISK_TIMEOUT"
            return out
        # one put: the batch, then the real messages and op records of the ends
        batch = self._prepare(batch)
        t0 = self.clock.monotonic_ms()
        with self._tx_lock:
            outcomes, writes, done = self._plan_ends(ends)
            res = self._write_resolutions(writes, done, wait=False, ahead=batch,
                                          producer_id=producer_id, sequence=sequence)
            self._note_new_halves(batch, res)
        out = self._sent(batch, res, self.store.wait_durable(res))
        self.metrics.observe("put_latency_ms", self.clock.monotonic_ms() - t0)
        out["ends"] = outcomes
        return out

    def _send(self, batch: RecordBatch | None, producer_id: int, sequence: int, *,
              wait: bool):
        """Store the batch: (the reply, the put's result or None)."""
        n = len(batch) if batch is not None else 0
        if not n:
            return {"status": "SEND_OK", "phys": [], "queue_offsets": [], "duplicate": False}, None
        batch = self._prepare(batch)
        t0 = self.clock.monotonic_ms()
        res = self.store.put(batch, producer_id=producer_id, sequence=sequence, wait=wait)
        self.metrics.observe("put_latency_ms", self.clock.monotonic_ms() - t0)
        self._note_new_halves(batch, res)
        return self._sent(batch, res, res.status), res

    def _prepare(self, batch: RecordBatch) -> RecordBatch:
        """Check the routes of a producer batch; redirect delayed and transactional records."""
        keys = set(zip(batch.column("topics"), batch.column("queue_ids"))) \
            if isinstance(batch.topics, list) or isinstance(batch.queue_ids, list) \
            else {(batch.topics, batch.queue_ids)}
        self._check_routes(keys)
        if batch.properties is not None:
            batch = self._redirect_delayed(batch)
        return batch

    def _sent(self, batch: RecordBatch, res, status: PutStatus) -> dict:
        """The reply to a send: the batch's own records (a put may carry more after them)."""
        n = len(batch)
        self._wake_pullers()
        self.metrics.inc("messages_in", n)
        self.metrics.inc("bytes_in", float(res.size_array[:n].sum()))
        queue_offsets = res.queue_offset_array[:n].tolist()
        if batch.properties is not None:  # only then can a record have been delayed
            topics = batch.column("topics")
            if SCHEDULE_TOPIC in topics:  # its queue offset comes when it is delivered
                queue_offsets = [-1 if t == SCHEDULE_TOPIC else o
                                 for t, o in zip(topics, queue_offsets)]
        if self._fault == "flush_disk_timeout":
            status = PutStatus.FLUSH_DISK_TIMEOUT
        return {"status": "SEND_OK" if status is PutStatus.PUT_OK else "FLUSH_DISK_TIMEOUT",
                "phys": res.phys_array[:n].tolist(),
                "queue_offsets": queue_offsets,
                "duplicate": res.duplicate}

    def _redirect_delayed(self, batch: RecordBatch) -> RecordBatch:
        """Delayed messages go to the schedule topic and transactional ones to the half
        topic, their real topic and queue kept in properties.

        A transactional message keeps its delay level as a property: the delay
        is applied when it is committed, never while it is a half (RocketMQ
        4.x loops between the half and schedule topics here -- seed 000).
        """
        props = batch.properties
        if not _redirects(props):
            return batch
        now = self.clock.now_ms()
        # copies: the caller's batch stays as it was (an in-process caller may send it again)
        topics, qids = list(batch.column("topics")), list(batch.column("queue_ids"))
        flags, tag_codes = list(batch.column("flags")), list(batch.column("tag_codes"))
        new_props = list(props)
        for i, p in enumerate(props):
            if not p:
                continue
            if p.get(Prop.TRAN_MSG) == "true":
                if Prop.DELIVER_AT in p:
                    raise InvalidMessageError("deliver_at_ms is not supported yet; use delay_level")
                if Prop.DELAY in p and not 1 <= int(p[Prop.DELAY]) <= len(self._levels_ms):
                    raise InvalidMessageError(f"delay level {p[Prop.DELAY]} is not "
                                              f"1..{len(self._levels_ms)}")
                if not p.get(Prop.PRODUCER_GROUP) or not p.get(Prop.TRANSACTION_ID):
                    raise InvalidMessageError("a transactional message needs its producer group "
                                              "and transaction id")
                q = dict(p)
                q[Prop.REAL_TOPIC] = topics[i]
                q[Prop.REAL_QID] = str(qids[i])
                new_props[i] = q
                topics[i] = HALF_TOPIC
                qids[i] = 0
                flags[i] = int(SysFlag.TRANSACTION_PREPARED)
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
        codes_of = {t: np.array([tags_hash(x) for x in wanted], np.int64)
                    for t, wanted in (tags or {}).items() if wanted}
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
                entries = entries[np.isin(entries["tag"], codes_of[topic])]
            batch = self.store.messages_at(entries)
            if wanted and len(batch):
                keep = [i for i, t in enumerate(batch.tags or [None] * len(batch)) if t in wanted]
                if len(keep) != len(batch):
                    batch = _select(batch, keep)
            total += len(batch)
            out.append((topic, qid, batch, next_offset, end))
        if total:
            self.metrics.inc("messages_out", total)
            self.metrics.inc("bytes_out", float(sum(sum(map(len, batch.bodies))
                                                    for _t, _q, batch, _n, _e in out)))
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
            self.store.save_offsets(values)

    def get_offsets(self, group: str, queues: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Committed offsets (-1: none yet)."""
        return {(t, q): self.store.offsets.get(offset_key(group, t, q)) for t, q in queues}

    def queue_info(self) -> dict:
        if self._fetch_routes is not None:
            self.set_routes(self._fetch_routes(self.index))
        with self._routes_lock:
            routes = sorted(self._routes)
        depth = {f"{t}/{q}": self.store.max_queue_offset(t, q) for t, q in routes}
        for key, d in depth.items():
            self.metrics.set("queue_depth", float(d), queue=key)
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
                "schedule_pending": {lvl + 1: end - self._schedule_progress(lvl + 1)
                                     for lvl in range(len(self._levels_ms))
                                     if (end := self.store.max_queue_offset(SCHEDULE_TOPIC, lvl))},
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
            props[Prop.DLQ_REASON] = reason.encode()[:500].decode(errors="ignore") \
                or "max reconsume count reached"
            self.metrics.inc("dead_letters", 1, group=group)
        else:
            topic = retry_topic(group)
            level = min(self.config.retry_first_level + count - 1, len(self._levels_ms))
            props[Prop.DELAY] = str(level)
            self.metrics.inc("retries", 1, group=group)
        batch = RecordBatch(topic, self.index, [m.body], keys=[m.key], tags=[m.tags],
                            properties=[props], born_ms=m.born_ms, reconsume=count)
        res = self._store_request(batch, 0, 0, None)
        return {"topic": topic, "reconsume_count": count, "phys": res["phys"][0]}

    def dlq_list(self, group: str, offset: int = 0, max_messages: int = 100) -> list[StoredMessage]:
        return self.store.read_queue(dlq_topic(group), self.index, offset, max_messages)

    def dlq_resend(self, group: str, phys_offsets: list[int] | None = None) -> list[str]:
        """Send dead letters back to the group's retry topic, reconsume count reset.

        Without ``phys_offsets``: every dead letter not resent before, exactly
        once.  The copies are written as an idempotent producer of the shard's
        own (one per group) whose sequence is the dead-letter queue offset they
        reach, so the progress is stored with the copies themselves: a resend
        cut short after its copies and before its progress (a crash) is
        neither lost nor, when run again, written twice.  Returns the ids of
        the resent dead letters.  With ``phys_offsets`` (an operator's pick)
        each call resends them again.
        """
        if phys_offsets is not None:
            return self._dlq_resend(group, phys_offsets)
        with self._dlq_lock:  # two at once would read the same progress and overlap
            return self._dlq_resend(group, None)

    def _dlq_resend(self, group: str, phys_offsets: list[int] | None) -> list[str]:
        topic = dlq_topic(group)
        progress_key = f"dlq-resend@{group}@{self.index}"
        pid, sequence = 0, 0
        if phys_offsets is None:
            pid = _dlq_resend_pid(group)
            end = self.store.max_queue_offset(topic, self.index)
            done = max(self.store.offsets.get(progress_key, 0), self.store.last_sequence(pid))
            start = min(max(0, done), end)
            msgs = self.store.read_queue(topic, self.index, start, end - start)
            sequence = msgs[-1].queue_offset + 1 if msgs else 0
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
        sent = self._store_request(
            RecordBatch(retry_topic(group), self.index, [m.body for m in msgs],
                        keys=[m.key for m in msgs], tags=[m.tags for m in msgs],
                        properties=props, born_ms=[m.born_ms for m in msgs]),
            pid, sequence, None)
        if sent["status"] != "SEND_OK":
            raise StorageError(f"dead letters of {group!r} resent but not durable "
                               f"({sent['status']}); resend them again")
        if phys_offsets is None:
            self.store.save_offsets({progress_key: msgs[-1].queue_offset + 1})
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
        delivery repeated after a crash is recognised and not stored twice (and
        one call at a time: two would overlap).  A message due later than its
        level's delay from now was stamped before the clock stepped back: it is
        due now (RocketMQ's correctDeliverTimestamp), or its whole level would
        wait out the step.
        """
        with self._schedule_lock:
            return self._deliver_due()

    #: Most bytes of messages one delivery put carries (a backlog of big messages).
    DELIVERY_MAX_BYTES = 32 << 20

    def _deliver_due(self) -> int:
        now = self.clock.now_ms()
        next_wait = self.config.schedule_tick_ms
        for lvl in range(len(self._levels_ms)):
            level = lvl + 1
            end = self.store.max_queue_offset(SCHEDULE_TOPIC, lvl)
            start = self._schedule_progress(level)
            while start < end:
                entries = self.store.read_cq(SCHEDULE_TOPIC, lvl, start, 1000)
                tags = entries["tag"]
                # FIFO per level: stop at the first not due
                is_due = (tags <= now) | (tags > now + self._levels_ms[lvl])
                due = len(is_due) if is_due.all() else int(np.argmin(is_due))
                if due == 0:
                    next_wait = min(next_wait, int(tags[0] - now))
                    break
                take = due
                if take > 1:  # a put of at most DELIVERY_MAX_BYTES (at least one message)
                    total = np.cumsum(entries["size"][:due])
                    take = max(1, int(np.searchsorted(total, self.DELIVERY_MAX_BYTES, "right")))
                msgs = self.store.messages_at(entries[:take]).messages()
                self.store.put(_restore_real(self.index, msgs),
                               producer_id=SCHEDULER_PID_BASE + level,
                               sequence=start + take)
                late = int(now - tags[:take].min())
                self.max_lateness_ms = max(self.max_lateness_ms, late)
                self.metrics.observe("delay_lateness_ms", float(late))
                self._wake_pullers()
                start += take
                if take < due:
                    continue  # more of them due
                if due < len(entries):
                    next_wait = min(next_wait, int(tags[due] - now))
                    break
        return max(1, next_wait)

    def _schedule_loop(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self.deliver_due()
            except Exception:  # keep delivering; the next round retries
                log.exception("shard-%d: delay delivery failed", self.index)
                wait = 1000
            self.metrics.flush()  # counters summed in the process reach Ray within a tick
            self._stop.wait(min(wait, self.config.schedule_tick_ms) / 1000.0)

    # ---------------------------------------------------- transactional messages
    _HALF_PROGRESS = "txn-half-progress"
    _OP_PROGRESS = "txn-op-progress"

    def _load_transactions(self) -> None:
        """Rebuild the resolution index: ops from the op progress, halves from the half progress."""
        op_start = max(0, self.store.offsets.get(self._OP_PROGRESS, 0))
        end = self.store.max_queue_offset(OP_TOPIC, 0)
        for off in range(op_start, end, 1000):
            for m in self.store.read_queue(OP_TOPIC, 0, off, 1000):
                for origin, state in _op_entries(m.properties):
                    self._resolved[origin] = state
        half_start = max(0, self.store.offsets.get(self._HALF_PROGRESS, 0))
        end = self.store.max_queue_offset(HALF_TOPIC, 0)
        for off in range(half_start, end, 1000):
            for m in self.store.read_queue(HALF_TOPIC, 0, off, 1000):
                origin = int(m.properties.get(Prop.ORIGIN_HALF, m.phys_offset))
                self._latest_copy[origin] = m.queue_offset
                if origin not in self._resolved:
                    self._pending_halves[origin] = m.queue_offset

    def _cut_back_offsets(self) -> None:
        """Offsets past the end of their queue would skip the records written next: cut
        back to the end.  (Possible with data written before offsets waited for what they
        pass, then lost to a power loss.)  Consumer offsets and dead-letter progress of a
        queue this shard does not have are left alone; its own transaction progress is
        always checked."""
        own = {self._HALF_PROGRESS: (HALF_TOPIC, 0), self._OP_PROGRESS: (OP_TOPIC, 0)}
        known = set(self.store.queues())
        cut = {}
        for key, value in self.store.offsets.snapshot().items():
            queue = own.get(key)
            if queue is None:
                parts = key.split("@")  # group@topic@queue, or dlq-resend@group@shard
                if len(parts) != 3 or not parts[2].isdigit():
                    continue
                topic = dlq_topic(parts[1]) if parts[0] == "dlq-resend" else parts[1]
                queue = (topic, int(parts[2]))
                if queue not in known:
                    continue
            end = self.store.max_queue_offset(*queue)
            if value > end:
                cut[key] = end
        if cut:
            log.warning("shard-%d: offsets past the end of their queues cut back: %s",
                        self.index, cut)
            self.store.offsets.update(cut)

    def _note_new_halves(self, batch: RecordBatch, res) -> None:
        """Track the halves just stored; keep what their end needs, so it reads nothing.

        A duplicate (a resend) stored nothing: its halves were tracked when the
        first copy was, and may be resolved and forgotten since -- tracking them
        again would make a rolled-back half pending, and committable, again.
        """
        if res.duplicate or batch.properties is None or not (batch.topics == HALF_TOPIC or (
                isinstance(batch.topics, list) and HALF_TOPIC in batch.topics)):
            return
        topics = batch.column("topics")
        props, bodies = batch.column("properties"), batch.bodies
        keys, tags, born = batch.column("keys"), batch.column("tags"), batch.column("born_ms")
        with self._tx_lock:
            room = HALF_CACHE_MAX - len(self._half_cache)
            for i, (t, phys, qoff, size) in enumerate(zip(topics, res.phys_offsets,
                                                          res.queue_offsets, res.sizes)):
                if t == HALF_TOPIC and phys not in self._resolved:
                    self._pending_halves.setdefault(phys, qoff)
                    self._latest_copy.setdefault(phys, qoff)
                    self._half_size[phys] = size
                    if room > 0 and phys not in self._half_cache:
                        self._half_cache[phys] = _Half(HALF_TOPIC, props[i], phys, bodies[i],
                                                       keys[i], tags[i], born[i])
                        room -= 1

    def _half_state(self, origin: int) -> HalfState | None:
        if origin in self._resolved:
            return self._resolved[origin]
        if origin in self._pending_halves:
            return HalfState.PREPARED
        return None  # resolved long ago (passed by the checker), or not a half

    def end_transactions(self, requests: list[tuple[str, str, list[int], str]]) -> list[str]:
        """Commit or roll back halves: [(producer group, transaction id, origins, state)].

        Idempotent: a duplicate or late end for a resolved half does nothing.
        UNKNOW does nothing.  A group or transaction id that does not match
        the half is refused (that request's outcome says why; the others go on).
        All the resolutions of the call are written in one put (one fsync).
        """
        with self._tx_lock:
            outcomes, writes, done = self._plan_ends(requests)
            written = self._write_resolutions(writes, done, wait=False)
        if done:
            self._wake_pullers()
        if written is not None:  # the fsync is shared with other puts, outside the lock
            self.store.wait_durable(written)
        return outcomes

    def _plan_ends(self, requests: list[tuple[str, str, list[int], str]]):
        """Check ends and build their records: (outcomes, records, resolved). Under _tx_lock."""
        outcomes: list[str] = []
        halves = self._read_halves([o for _g, _t, origins, _s in requests for o in origins])
        writes: list[Record] = []
        op_entries: list[tuple[int, HalfState]] = []
        done: dict[int, HalfState] = {}
        for group, txid, origins, state in requests:
            try:
                outcome, real, ops, resolved = self._plan_end(group, txid, list(origins),
                                                              state, operator=False,
                                                              also_done=done, halves=halves)
            except (InvalidMessageError, IllegalTransition) as err:
                outcomes.append(f"REFUSED: {err}")
                continue
            except Exception as err:  # one bad request must not lose the others' ends
                log.warning("shard-%d: end of %s failed: %s", self.index, txid, err)
                outcomes.append(f"FAILED: {type(err).__name__}: {err}")
                continue
            outcomes.append(outcome)
            writes += real
            op_entries += ops
            done.update(resolved)
        if op_entries:  # one op record for all the ends of the call
            writes.append(_ops_record(op_entries))
        return outcomes, writes, done

    def end_transaction(self, group: str, txid: str, origins: list[int], state: str) -> str:
        """One end; refusals raise (the checker and operators use this)."""
        return self._end(group, txid, list(origins), state, operator=False)

    def resolve_half(self, origin: int, state: str) -> str:
        """An operator commits or rolls back a pending or expired half."""
        return self._end("", "", [origin], state, operator=True)

    def _end(self, group: str, txid: str, origins: list[int], state: str, *, operator: bool) -> str:
        with self._tx_lock:
            outcome, real, ops, done = self._plan_end(group, txid, origins, state,
                                                      operator=operator)
            self._write_resolutions(real + ([_ops_record(ops)] if ops else []), done)
        if done:
            self._wake_pullers()
        return outcome

    _WANTED = {"COMMIT_MESSAGE": HalfState.COMMITTED, "COMMIT": HalfState.COMMITTED,
               "ROLLBACK_MESSAGE": HalfState.ROLLED_BACK, "ROLLBACK": HalfState.ROLLED_BACK,
               "UNKNOW": None, "UNKNOWN": None}

    def _read_halves(self, origins: list[int]) -> dict[int, StoredMessage]:
        """The halves of many ends: kept from their send, else in one read where their sizes
        are known."""
        found = {o: self._half_cache[o] for o in origins if o in self._half_cache}
        known = sorted({o for o in origins if o in self._half_size and o not in found})
        if not known:
            return found
        entries = np.empty(len(known), dtype=[("phys", "<i8"), ("size", "<i4"), ("tag", "<i8")])
        entries["phys"] = known
        entries["size"] = [self._half_size[o] for o in known]
        entries["tag"] = 0
        try:
            found.update((m.phys_offset, m) for m in self.store.messages_at(entries).messages())
        except Exception as err:  # fall back to reading them one by one
            log.warning("shard-%d: batched half read failed: %s", self.index, err)
        return found

    def _plan_end(self, group: str, txid: str, origins: list[int], state: str, *,
                  operator: bool, also_done: dict | None = None,
                  halves: dict[int, StoredMessage] | None = None):
        """Check an end: (outcome, real records, op entries (origin, state), resolved)."""
        if state not in self._WANTED:
            raise InvalidMessageError(f"unknown transaction state {state!r}")
        target = self._WANTED[state]
        if target is None:
            return "UNKNOW", [], [], {}
        real, ops, done = [], [], {}
        for origin in origins:
            half = (halves or {}).get(origin) or self.store.get_message(origin)
            props = half.properties
            if half.topic != HALF_TOPIC or props.get(Prop.TRAN_MSG) != "true":
                raise InvalidMessageError(f"{make_msg_id(self.index, origin)} is not a half "
                                          "message")
            if not operator and (props.get(Prop.PRODUCER_GROUP) != group
                                 or props.get(Prop.TRANSACTION_ID) != txid):
                raise InvalidMessageError(
                    f"end of transaction {txid!r} from group {group!r} does not match half "
                    f"{make_msg_id(self.index, origin)} (group "
                    f"{props.get(Prop.PRODUCER_GROUP)!r}, transaction "
                    f"{props.get(Prop.TRANSACTION_ID)!r})")
            current = (also_done or {}).get(origin) or self._half_state(origin)
            if current is None:
                continue
            new = next_state(current, target)
            if new is None:
                continue
            if new == HalfState.COMMITTED:
                real.append(_real_from_half(self.index, half))
            ops.append((origin, new))
            done[origin] = new
        return (target.name if done else "NOOP"), real, ops, done

    def _write_resolutions(self, records: list[Record], done: dict[int, HalfState], *,
                           wait: bool = True, ahead: RecordBatch | None = None,
                           producer_id: int = 0, sequence: int = 0):
        """Write real messages and op records in one put, then mark the halves resolved.

        ``ahead`` is a producer batch written first in the same put (idempotent
        with its producer id and sequence: a resend writes and resolves nothing).
        With ``wait=False`` the put is not yet flushed: the caller waits with
        ``store.wait_durable`` on the result before it answers.
        """
        if not records and ahead is None:
            return None
        real = [r for r in records if r.topic != OP_TOPIC]
        if self._fault == "crash_between_real_and_op" and real:
            self.store.put(self._redirect_delayed(RecordBatch.from_records(real)))
            os._exit(17)  # test fault: the op write never happens
        # one put (all or nothing, also across frames): the batch ahead, real messages
        # (delayed now if they asked for a delay) and their op records
        if not records:
            batch = ahead
        elif _redirects(r.properties for r in records):
            tail = self._redirect_delayed(RecordBatch.from_records(records))
            batch = tail if ahead is None else RecordBatch.concat([ahead, tail])
        else:  # nothing to redirect: the records go straight after the batch
            batch = RecordBatch.from_records(records) if ahead is None \
                else ahead.with_records(records)
        written = self.store.put(batch, producer_id=producer_id, sequence=sequence, wait=wait)
        if not written.duplicate:  # a resend: its resolutions went with the first copy
            self._mark_resolved(done)
        return written

    def _mark_resolved(self, done: dict[int, HalfState]) -> None:
        for origin, new in done.items():
            self._settle(origin, new)
        self.metrics.inc("transactions_ended", len(done))

    def _settle(self, origin: int, state: HalfState) -> None:
        """A half is resolved (or expired): no longer pending, nothing of it kept."""
        self._resolved[origin] = state
        self._pending_halves.pop(origin, None)
        self._half_size.pop(origin, None)
        self._half_cache.pop(origin, None)

    def set_fault(self, fault: str | None) -> None:
        """Test hooks: 'crash_between_real_and_op' exits between the two writes of a
        commit; 'flush_disk_timeout' answers sends FLUSH_DISK_TIMEOUT (stored, not
        known durable), as a disk too slow for ``flush_timeout_ms`` does."""
        self._fault = fault

    #: Most half-queue entries one round reads per shard (resolved ones cost little).
    ROUND_SCAN_MAX = 200_000

    def check_round(self, live_groups: list[str], *, window: int = 2000,
                    max_checks_per_group: int = 1000, now_ms: int | None = None,
                    checks_used: dict[str, int] | None = None) -> list[dict]:
        """One check-back round over this shard's halves; returns the checks to ask.

        Re-puts what it checks (check count + 1) or defers, moves halves past
        the maximum number of checks to the check-expired topic, and advances
        the durable half and op progress.  Safe to repeat after a crash: a
        repeated re-put only makes a second copy of a half with the same
        origin, which resolves with it.

        The round reads the half queue ``window`` entries at a time (sends go
        on between windows) up to the first half not yet due, or to the end the
        queue had when the round began (the copies it re-puts wait for the next
        round), at most ``ROUND_SCAN_MAX`` entries.  ``max_checks_per_group``
        bounds a group's checks in the round; ``checks_used`` are those the
        round already sent it from other shards.
        """
        now = self.clock.now_ms() if now_ms is None else now_ms
        policy = CheckPolicy(max_checks=self.config.txn_max_checks,
                             check_backoff_max_ms=self.config.txn_check_backoff_max_ms,
                             max_checks_per_group=max_checks_per_group,
                             base_timeout_ms=self.config.txn_timeout_ms)
        used = dict(checks_used or {})
        end = self.store.max_queue_offset(HALF_TOPIC, 0)
        out: list[dict] = []
        waiting: set[str] = set()
        waits = 0
        scanned = 0
        while True:
            checks, more, plan = self._check_window(live_groups, policy, now, window, end, used)
            out += checks
            waiting |= plan.waiting_groups
            waits += sum(1 for _v, a in plan.actions if a is Action.WAIT)
            used = plan.checks_per_group
            scanned += window
            if not more or scanned >= self.ROUND_SCAN_MAX:
                break
        with self._tx_lock:  # groups stay "waiting" until a producer of theirs is live again
            self._waiting_groups = (self._waiting_groups - set(live_groups)) | waiting
            # once a round, with where the windows got to
            self._advance_op_progress(max(0, self.store.offsets.get(self._HALF_PROGRESS, 0)))
        self.metrics.set("halves_waiting_for_producer", float(waits))
        self.metrics.inc("transaction_checks", len(out))
        return out

    def _check_window(self, live_groups: list[str], policy: CheckPolicy, now: int, window: int,
                      end: int, used: dict[str, int]):
        """One window of a round: (checks, whether the round goes on, the plan)."""
        with self._tx_lock:
            start = max(0, self.store.offsets.get(self._HALF_PROGRESS, 0))
            halves = self.store.read_queue(HALF_TOPIC, 0, start, max(0, min(window, end - start)))
            views = []
            for m in halves:
                if m.phys_offset in self._resolved:  # a first copy, resolved: skip undecoded
                    views.append(HalfView(m.queue_offset, m.phys_offset, "", 0, 0, 0))
                    continue
                p = m.properties
                views.append(HalfView(m.queue_offset, int(p.get(Prop.ORIGIN_HALF, m.phys_offset)),
                                      p.get(Prop.PRODUCER_GROUP, ""),
                                      int(p.get(Prop.CHECK_BASE_MS, m.store_ms)),
                                      int(p.get(Prop.CHECK_TIMES, 0)),
                                      int(p.get(Prop.TXN_TIMEOUT_MS, self.config.txn_timeout_ms))))
            plan = plan_round(views, self._resolved, set(live_groups), now, policy, used)
            by_offset = {m.queue_offset: m for m in halves}
            writes, checks, progress = [], [], start
            stopped = False
            for view, action in plan.actions:
                if action is Action.STOP:
                    stopped = True
                    break
                progress = view.queue_offset + 1
                if action is Action.SKIP:
                    continue
                if self._latest_copy.get(view.origin, view.queue_offset) != view.queue_offset:
                    continue  # a stale copy (a round repeated after a crash): the newer one counts
                m = by_offset[view.queue_offset]
                if action is Action.EXPIRE:
                    writes.append(("expire", view, _copy(m, view.origin, view.checks,
                                                         CHECK_EXPIRED_TOPIC, view.store_ms)))
                    writes.append(("op", view, _op_record(view.origin, HalfState.EXPIRED,
                                                          m.properties)))
                    continue
                count = view.checks + (1 if action is Action.CHECK else 0)
                # the back-off runs from the last check; a deferred copy keeps its clock
                base = now if action is Action.CHECK else view.store_ms
                writes.append(("half", view, _copy(m, view.origin, count, HALF_TOPIC, base)))
                if action is Action.CHECK:
                    checks.append((view, m, count))
            if writes:
                res = self.store.put(RecordBatch.from_records([w[2] for w in writes]))
                for (kind, view, _rec), qoff in zip(writes, res.queue_offsets):
                    if kind == "half":
                        self._pending_halves[view.origin] = qoff
                        self._latest_copy[view.origin] = qoff
                    elif kind == "op":
                        self._settle(view.origin, HalfState.EXPIRED)
            # the progress may pass halves resolved by puts not flushed yet (ends are
            # resolved when written, before their fsync): save_offsets makes them durable
            if progress != start:
                self.store.save_offsets({self._HALF_PROGRESS: progress})
        more = not stopped and bool(halves) and progress < end
        return ([{"shard": self.index, "group": v.group, "origin": v.origin, "checks": count,
                  "txid": m.properties.get(Prop.TRANSACTION_ID),
                  "message": _listener_view(m, self.index, v.origin)}
                 for v, m, count in checks], more, plan)

    def uncount_checks(self, checks: list[tuple[int, int]]) -> int:
        """Take back checks that never reached a producer: ``[(origin, count)]``.

        The checker calls this when the group's registry could not take the
        checks a round planned: such a check does not count (a half is never
        expired for checks nobody was asked).  Each half's latest copy is put
        again with its check count back to ``count - 1``, keeping the time of
        the failed check as the base of its back-off.  Idempotent: a half
        resolved, checked again or already taken back meanwhile is left alone.
        Returns how many were taken back.
        """
        with self._tx_lock:
            writes = []
            for origin, count in checks:
                qoff = self._latest_copy.get(origin)
                if qoff is None or origin not in self._pending_halves:
                    continue
                copies = self.store.read_queue(HALF_TOPIC, 0, qoff, 1)
                if not copies:
                    continue
                m = copies[0]
                p = m.properties
                if int(p.get(Prop.CHECK_TIMES, 0)) != count or count <= 0:
                    continue
                writes.append((origin, _copy(m, origin, count - 1, HALF_TOPIC,
                                             int(p.get(Prop.CHECK_BASE_MS, m.store_ms)))))
            if writes:
                res = self.store.put(RecordBatch.from_records([w for _o, w in writes]))
                for (origin, _w), qoff in zip(writes, res.queue_offsets):
                    self._pending_halves[origin] = qoff
                    self._latest_copy[origin] = qoff
        self.metrics.inc("transaction_checks_taken_back", len(writes))
        return len(writes)

    def _advance_op_progress(self, half_progress: int) -> None:
        """Pass the ops (and forget the resolutions) whose halves can no longer come up.

        A resolution is needed as long as any copy of its half lies at or past
        the half progress; the smallest origin among those bounds what may go.
        """
        for origin in [o for o, q in self._latest_copy.items() if q < half_progress]:
            del self._latest_copy[origin]
        min_live = min(self._latest_copy) if self._latest_copy else None
        start = max(0, self.store.offsets.get(self._OP_PROGRESS, 0))
        # an op whose half is still EXPIRED is kept (operators and late ends may still
        # resolve it, and a restart must find it): it counts as not matched yet
        blocked = min_live if min_live is not None else float("inf")
        passed = start
        for _ in range(40):  # up to 200,000 ops a call, 5,000 at a time
            ops = self.store.read_queue(OP_TOPIC, 0, passed, 5000)
            # (with no half pending an EXPIRED op still stops it: ``blocked``, not None)
            n = op_progress([_op_origin(m.properties, self._resolved, blocked) for m in ops],
                            blocked)
            passed += n
            if n < 5000:
                break
        if passed != start:
            self.store.save_offsets({self._OP_PROGRESS: passed})
        # forget what can no longer come up (expired halves stay: operators resolve them)
        for origin in [o for o, st in self._resolved.items() if st is not HalfState.EXPIRED
                       and o not in self._latest_copy
                       and (min_live is None or o < min_live)]:
            del self._resolved[origin]

    def half_list(self, *, expired: bool = False, limit: int = 1000) -> list[dict]:
        """Pending halves (or expired ones): id, group, transaction, age, checks, topic."""
        now = self.clock.now_ms()
        out = []
        with self._tx_lock:
            if not expired:
                items = sorted(self._pending_halves.items())[:limit]
                msgs = [(origin, self.store.read_queue(HALF_TOPIC, 0, qoff, 1)) for origin, qoff in items]
            else:
                origins = {o for o, st in self._resolved.items() if st is HalfState.EXPIRED}
                msgs = []
                end = self.store.max_queue_offset(CHECK_EXPIRED_TOPIC, 0)
                for off in range(0, end, 1000):
                    for m in self.store.read_queue(CHECK_EXPIRED_TOPIC, 0, off, 1000):
                        origin = int(m.properties.get(Prop.ORIGIN_HALF, -1))
                        if origin in origins:
                            msgs.append((origin, [m]))
            for origin, found in msgs:
                if not found:
                    continue
                m = found[0]
                p = m.properties
                first = self.store.get_message(origin)
                out.append({"id": make_msg_id(self.index, origin), "shard": self.index,
                            "origin": origin, "group": p.get(Prop.PRODUCER_GROUP),
                            "transaction_id": p.get(Prop.TRANSACTION_ID),
                            "topic": p.get(Prop.REAL_TOPIC), "checks": int(p.get(Prop.CHECK_TIMES, 0)),
                            "age_ms": now - first.store_ms,
                            "state": "EXPIRED" if expired else "PREPARED",
                            "waiting_for_producer": p.get(Prop.PRODUCER_GROUP) in self._waiting_groups})
        return out

    def transaction_status(self) -> dict:
        with self._tx_lock:
            return {"pending_halves": len(self._pending_halves),
                    "expired_halves": sum(1 for s in self._resolved.values()
                                          if s is HalfState.EXPIRED),
                    "groups_without_live_producer": sorted(self._waiting_groups)}

    # ---------------------------------------------------------------- admin
    def ping(self) -> dict:
        return {"shard": self.index, "directory": self.directory, "pid": os.getpid()}

    def close(self) -> None:
        self._stop.set()
        if self._scheduler is not None:
            self._scheduler.join()
        self.store.close()


def _restore_real(shard: int, msgs: list[StoredMessage]) -> RecordBatch:
    """The due delayed messages as consumers get them: real topic and queue back, and the id
    the producer was given (its scheduled copy's, unless it carries an older one)."""
    props = []
    for m in msgs:
        p = dict(m.properties)
        for k in (Prop.DELAY, Prop.REAL_TOPIC, Prop.REAL_QID, Prop.REAL_FLAGS):
            p.pop(k, None)
        p.setdefault(Prop.ORIGIN_MSG_ID, make_msg_id(shard, m.phys_offset))
        props.append(p)
    return RecordBatch([m.properties[Prop.REAL_TOPIC] for m in msgs],
                       [int(m.properties[Prop.REAL_QID]) for m in msgs],
                       [m.body for m in msgs], keys=[m.key for m in msgs],
                       tags=[m.tags for m in msgs],
                       properties=props,
                       flags=[int(m.properties.get(Prop.REAL_FLAGS, 0)) for m in msgs],
                       born_ms=[m.born_ms for m in msgs],
                       reconsume=[m.reconsume_count for m in msgs],
                       prepared_offsets=[m.prepared_offset for m in msgs])


#: Pending halves whose content is kept in memory for their end (the rest are read back).
HALF_CACHE_MAX = 100_000


class _Half(NamedTuple):
    """What an end needs of a half, as it was sent (the fields of ``StoredMessage`` used)."""

    topic: str
    properties: dict
    phys_offset: int
    body: bytes
    key: str | None
    tags: str | None
    born_ms: int


#: Properties that make ``_redirect_delayed`` move a record (any of them).
_REDIRECTING = frozenset((Prop.DELAY, Prop.DELIVER_AT, Prop.TRAN_MSG))


def _redirects(properties: Iterable[dict | None]) -> bool:
    """Whether ``_redirect_delayed`` moves any of these records (given their properties)."""
    return any(p and not _REDIRECTING.isdisjoint(p) for p in properties)

_TX_PROPS = (Prop.TRAN_MSG, Prop.REAL_TOPIC, Prop.REAL_QID, Prop.REAL_FLAGS, Prop.CHECK_TIMES,
             Prop.ORIGIN_HALF, Prop.TXN_TIMEOUT_MS, Prop.CHECK_BASE_MS)


def _dlq_resend_pid(group: str) -> int:
    """The producer id of a group's dead-letter resends (stable across restarts)."""
    digest = hashlib.blake2b(group.encode(), digest_size=7, person=b"raymq-dlq").digest()
    return DLQ_RESEND_PID_BASE + int.from_bytes(digest, "big")


def _real_from_half(shard: int, half: StoredMessage) -> Record:
    """The real message a commit writes: real topic/queue, the half's origin id as its id."""
    p = dict(half.properties)
    topic, qid = p[Prop.REAL_TOPIC], int(p[Prop.REAL_QID])
    for k in _TX_PROPS:
        p.pop(k, None)
    p[Prop.ORIGIN_MSG_ID] = make_msg_id(shard, half.phys_offset)
    return Record(topic, qid, half.body, half.key, half.tags, p,
                  int(SysFlag.TRANSACTION_COMMIT), half.born_ms)


def _op_record(origin: int, state: HalfState, half_props: dict) -> Record:
    """The op record of one half, with its group and transaction id."""
    record = _ops_record([(origin, state)])
    record.properties[Prop.PRODUCER_GROUP] = half_props.get(Prop.PRODUCER_GROUP, "")
    record.properties[Prop.TRANSACTION_ID] = half_props.get(Prop.TRANSACTION_ID, "")
    return record


def _ops_record(entries: list[tuple[int, HalfState]]) -> Record:
    """One op record for several resolved halves (RocketMQ 5 batches its op messages too):
    their origins and new states, in order, comma-separated."""
    props = {Prop.ORIGIN_HALF: ",".join([str(o) for o, _ in entries]),
             Prop.OP_STATE: ",".join([st.name for _, st in entries])}
    return Record(OP_TOPIC, 0, b"", None, "d", props, int(SysFlag.OP))


def _op_entries(props: dict) -> list[tuple[int, HalfState]]:
    """The (origin, state) pairs of an op record: one (``_op_record``) or several."""
    origins, states = props[Prop.ORIGIN_HALF].split(","), props[Prop.OP_STATE].split(",")
    if len(origins) != len(states):
        raise CorruptLogError(f"op record with {len(origins)} origins and {len(states)} states")
    return [(int(o), HalfState[st]) for o, st in zip(origins, states)]


def _op_origin(props: dict, resolved: dict, blocked) -> int:
    """What an op record counts as for the op progress (``op_progress``): its highest
    origin; ``blocked`` while any of its halves is EXPIRED (operators may still resolve
    it, and a restart must find it)."""
    entries = _op_entries(props)
    if any(resolved.get(o) is HalfState.EXPIRED for o, _ in entries):
        return blocked
    return max(o for o, _ in entries)


def _copy(m: StoredMessage, origin: int, checks: int, topic: str, base_ms: int) -> Record:
    p = dict(m.properties)
    p[Prop.ORIGIN_HALF] = str(origin)
    p[Prop.CHECK_TIMES] = str(checks)
    p[Prop.CHECK_BASE_MS] = str(base_ms)
    return Record(topic, 0, m.body, m.key, m.tags, p, int(SysFlag.TRANSACTION_PREPARED),
                  m.born_ms)


def _listener_view(m: StoredMessage, shard: int, origin: int) -> StoredMessage:
    """The half as the application's check sees it: its real topic and queue, and the id
    its producer was given (that of the first copy, not of this re-put one)."""
    p = dict(m.properties)
    p[Prop.ORIGIN_MSG_ID] = make_msg_id(shard, origin)
    topic, qid = p.get(Prop.REAL_TOPIC, m.topic), int(p.get(Prop.REAL_QID, 0))
    return StoredMessage(topic, qid, -1, m.phys_offset, m.size, m.flags, m.born_ms, m.store_ms,
                         m.prepared_offset, m.tag_code, m.reconsume_count, m.key, m.tags, p,
                         m.body)


def _select(batch: MessageBatch, keep: list[int]) -> MessageBatch:
    pick = lambda col: None if col is None else [col[i] for i in keep]  # noqa: E731
    return MessageBatch(batch.headers[keep], pick(batch.phys_offsets), pick(batch.topics),
                        pick(batch.keys), pick(batch.tags), pick(batch.properties),
                        pick(batch.bodies))
