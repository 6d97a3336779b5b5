"""BrokerShard: one shard's broker, a facade over its store and one component per concept.

It owns the store and the transaction lock and delegates: routes (``routes``),
where records go (``diversion``), halves and ends (``halves``), check rounds
(``checkback``), delays (``delay``), retries and dead letters (``dead_letters``),
reads (``reads``) and group offsets (``group_offsets``).  Transaction ends are
prepared by ``halves`` (records to write), written by the shard in one put,
then applied; check rounds and deliveries write through the shard's store.
Test faults are an object handed in (``faults``), asked at fixed points.  Its files are
in ``directory`` (default ``<data_dir>/shard-<index>``; a replica's: its own).

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

import logging
import os
import threading
from typing import Callable, Iterable

from raymq.actors.front.admission import refusals, select
from raymq.actors.rocketmq_tx.checkback import CheckRounds
from raymq.actors.config import ClusterConfig
from raymq.actors.groups.dead_letters import DLQ_RESEND_PID_BASE, DeadLetters  # noqa: F401 (tests)
from raymq.actors.timing.delay import SCHEDULER_PID_BASE, DelayScheduler  # noqa: F401 (tests)
from raymq.actors.front.diversion import check_transactional, divert_to_system_topics
from raymq.actors.faults import NO_FAULTS, Faults, faults_named
from raymq.actors.metrics import NullMetrics
from raymq.actors.rocketmq_tx.records import ops_record, resolution_batch
from raymq.actors.groups.offsets import GroupOffsets
from raymq.actors.retention import Janitor, drop_topic
from raymq.actors.rocketmq_tx.halves import HalfIndex, carries_halves
from raymq.actors.kafka_tx.shard_side import KafkaTxnQueues, commit_batch
from raymq.actors.protocol import (HALF_TOPIC, SCHEDULE_TOPIC, SYSTEM_PROPERTIES,
                                   TIMER_TOPIC, CheckRequest, EndOutcome, EndRequest,
                                   EndResult, SendReply, check_group, with_steps)
from raymq.actors.front.requests import (answers_in_one_line, check_ends, check_offsets, check_pull,
                                   check_producer_ids, check_pull_options, check_queues,
                                   check_send)
from raymq.actors.front.reads import QueueReads, as_delivered, stored_message
from raymq.actors.front.routes import RouteTable
from raymq.actors.timing.roll import scheduled_message
from raymq.actors.timing.timers import WHEEL_DIR, Cancellations, TimerScheduler, cancel_scheduled
from raymq.storage import MessageStore, RecordBatch, steps
from raymq.storage.clock import Clock, SystemClock
from raymq.storage.errors import InvalidMessageError
from raymq.storage.producers import INTERNAL_PRODUCER_BASE
from raymq.storage.records import Record, StoredMessage
from raymq.storage.store import PutStatus

log = logging.getLogger("raymq.shard")


class BrokerShard:
    def __init__(self, index: int, config: dict | ClusterConfig, *,
                 fetch_routes: Callable[[int], list] | None = None,
                 clock: Clock | None = None, metrics=None, background: bool = True,
                 faults: Faults = NO_FAULTS, directory: str | None = None,
                 fetch_settings: Callable[[], dict] | None = None):
        self.index = index
        self.config = config if isinstance(config, ClusterConfig) else ClusterConfig.from_dict(config)
        self.clock = clock or SystemClock()
        self.metrics = metrics or NullMetrics()
        self.directory = directory or os.path.join(self.config.resolved_data_dir(), f"shard-{index}")
        self.store = MessageStore(self.directory, self.config.store_config(), self.clock,
                                  background=background)
        self._levels_ms = self.config.delay_levels_ms
        self._tx_lock = threading.RLock()
        self.faults = faults  # test faults (``set_fault`` swaps them at run time)
        self.routes = RouteTable(index, fetch_routes)
        self.reads = QueueReads(self.store, self.clock, self.metrics)
        self.offsets = GroupOffsets(index, self.store, self.config.max_groups)
        self.halves = HalfIndex(index, self.store, self.config.retention_ms)
        self.checks = CheckRounds(index, self.store, self.halves, lambda records: self.store.put(
            RecordBatch.from_records(records)), self._tx_lock, self.config, self.metrics)
        self.cancels = Cancellations(self.store)
        self.delays = DelayScheduler(index, self.store, self._levels_ms,
                                     self.config.schedule_tick_ms, self.clock, self.metrics,
                                     self.reads.wake, self.cancels)
        self.timers = TimerScheduler(index, self.store, os.path.join(self.directory, WHEEL_DIR),
                                     self.config.timer_bucket_ms, self.config.schedule_tick_ms,
                                     self.clock, self.metrics, self.reads.wake, self.cancels)
        self.dead_letters = DeadLetters(index, self.store, self.config, self._levels_ms,
                                        lambda *a: self._store_request(*a), self.metrics)
        self.ktx = KafkaTxnQueues(self.store, self.clock, self.offsets.admit, self.reads.wake,
                                  compact_records=self.config.state_log_compact_records)
        self.reads.txns = self.ktx
        self.checks.confirmed = self.reads.confirmed_offset
        self.offsets.cut_back()
        self.halves.load()
        self.janitor = Janitor(self, fetch_settings)  # (retention, a disk that fills)
        if background:
            for part in (self.delays, self.timers, self.ktx, self.janitor):
                part.start()

    # ------------------------------------------------------------- routes
    def set_routes(self, routes: Iterable[tuple[str, int]]) -> None:
        self.routes.set(routes)

    # --------------------------------------------------------------- send
    def send(self, batch: RecordBatch | None, producer_id: int = 0, sequence: int = 0,
             ends: list | None = None, acks: str = "all") -> SendReply:
        """Store a producer request.  Idempotent with a producer id and sequence.  ``acks``:
        what a replicated shard's reply waits for (``ShardReplica.call``).

        ``ends`` are transaction ends riding on the request (``end_transactions``;
        idempotent too): applied after the batch is written, their outcomes
        returned in ``ends``.  The reply waits for one fsync covering both.
        """
        ends = check_send(batch, producer_id, sequence, ends, acks)
        if steps.enabled:
            return with_steps(self._send_checked(batch, producer_id, sequence, ends))
        return self._send_checked(batch, producer_id, sequence, ends)

    def _send_checked(self, batch, producer_id: int, sequence: int, ends) -> SendReply:
        self.janitor.refuse_if_full(batch)  # (a request of ends alone goes on)
        if producer_id >= INTERNAL_PRODUCER_BASE:
            # the shard's own writers keep their progress as such producers' sequences
            raise InvalidMessageError(f"producer id {producer_id} is reserved for the broker "
                                      f"(client ids are below 2**62)")
        refused = refusals(batch, len(self._levels_ms), SYSTEM_PROPERTIES,
                           max_delay_ms=self.config.max_delay_ms, now_ms=self.clock.now_ms()) \
            if batch is not None and len(batch) else None
        if not refused:
            return self._store_request(batch, producer_id, sequence, ends)
        keep = [i for i in range(len(batch)) if i not in refused]  # refused alone
        reply = self._store_request(select(batch, keep) if keep else None, producer_id,
                                    sequence, ends)
        return _spread(reply, len(batch), keep, refused)

    def _store_request(self, batch: RecordBatch | None, producer_id: int, sequence: int,
                       ends: list | None) -> SendReply:
        if not ends:
            return self._send(batch, producer_id, sequence, wait=True)[0]
        n = len(batch) if batch is not None else 0
        if not n:
            out, written = self._send(batch, producer_id, sequence, wait=False)
            out.ends = self.end_transactions(ends)  # its fsync covers the batch too
            if written is not None and self.store.wait_durable(written) is not PutStatus.PUT_OK:
                out.status = "FLUSH_DISK_TIMEOUT"
            return out
        # one put: the batch, then the real messages and op records of the ends
        batch = self._prepare(batch)
        t0 = self.clock.monotonic_ms()
        with self._tx_lock:
            plan = self.halves.plan_ends(ends)
            res = self._write_resolutions(plan.records, plan.resolved, wait=False, ahead=batch,
                                          producer_id=producer_id, sequence=sequence)
            self.halves.note_new(batch, res)
        out = self._sent(batch, res, self.store.wait_durable(res))
        self.metrics.observe("put_latency_ms", self.clock.monotonic_ms() - t0)
        out.ends = plan.outcomes
        return out

    def _send(self, batch: RecordBatch | None, producer_id: int, sequence: int, *, wait: bool):
        """Store the batch: (the reply, the put's result or None)."""
        if batch is None or not len(batch):
            return SendReply("SEND_OK", [], []), None
        batch = self._prepare(batch)
        t0 = self.clock.monotonic_ms()
        res = self.store.put(batch, producer_id=producer_id, sequence=sequence, wait=wait)
        self.metrics.observe("put_latency_ms", self.clock.monotonic_ms() - t0)
        if carries_halves(batch, res):  # only then the lock: other sends do not wait on it
            with self._tx_lock:
                self.halves.note_new(batch, res)
        return self._sent(batch, res, res.status), res

    def _prepare(self, batch: RecordBatch) -> RecordBatch:
        """Check the routes of a producer batch; divert delayed and transactional records."""
        self.routes.check(batch.queues())
        if batch.properties is not None:
            batch = divert_to_system_topics(batch, self._levels_ms, self.clock.now_ms())
        return batch

    def _sent(self, batch: RecordBatch, res, status: PutStatus) -> SendReply:
        """The reply to a send: the batch's own records (a put may carry more after them)."""
        n = len(batch)
        self.reads.wake()
        self.metrics.inc("messages_in", n)
        self.metrics.inc("bytes_in", _bytes_of(res.size_array, n))
        status = self.faults.send_status(status)
        return SendReply("SEND_OK" if status is PutStatus.PUT_OK else status.name,
                         res.phys_array[:n].tolist(), _reply_offsets(batch, res, n, self.timers),
                         res.duplicate)

    # ---------------------------------------------------- transaction ends
    def end_transactions(self, requests: list) -> list[EndResult]:
        """Commit or roll back halves: [(producer group, transaction id, origins, state)].

        Idempotent: a duplicate or late end for a resolved half does nothing.
        UNKNOW does nothing.  A group or transaction id that does not match
        the half is refused (that request's outcome says why; the others go on).
        All the resolutions of the call are written in one put (one fsync).
        """
        requests = check_ends(requests)
        with self._tx_lock:
            plan = self.halves.plan_ends(requests)
            written = self._write_resolutions(plan.records, plan.resolved, wait=False)
        if plan.resolved:
            self.reads.wake()
        if written is not None:  # the fsync is shared with other puts, outside the lock
            self.store.wait_durable(written)
        return plan.outcomes

    def end_transaction(self, group: str, txid: str, origins: list[int],
                        state: str) -> EndOutcome:
        """One end; refusals raise (the checker and operators use this)."""
        return self._end(EndRequest(group, txid, tuple(origins), state), operator=False)

    def resolve_half(self, origin: int, state: str) -> EndOutcome:
        """An operator commits or rolls back a pending or expired half.  Asking a half
        already committed to roll back (or back) raises, saying what it became."""
        return self._end(EndRequest("", "", (origin,), state), operator=True)

    def _end(self, end: EndRequest, *, operator: bool) -> EndOutcome:
        with self._tx_lock:
            outcome, real, done = self.halves.plan_end(end, operator=operator)
            records = real + ([ops_record(list(done.items()))] if done else [])
            self._write_resolutions(records, done)
        if done:
            self.reads.wake()
        return outcome

    def _write_resolutions(self, records: list[Record], done: dict, *, wait: bool = True,
                           ahead: RecordBatch | None = None, producer_id: int = 0,
                           sequence: int = 0):
        """Write real messages and op records in one put, then mark the halves resolved.

        ``ahead`` is a producer batch written first in the same put (idempotent
        with its producer id and sequence: a resend writes and resolves nothing).
        With ``wait=False`` the put is not yet flushed: the caller waits with
        ``store.wait_durable`` on the result before it answers.
        """
        if not records and ahead is None:
            return None
        batch = resolution_batch(records, ahead, lambda b: divert_to_system_topics(
            b, self._levels_ms, self.clock.now_ms()))  # (one put: all or nothing)
        written = self.store.put(batch, producer_id=producer_id, sequence=sequence, wait=wait)
        if not written.duplicate:  # a resend: its resolutions went with the first copy
            self.halves.apply(done)
            self.metrics.inc("transactions_ended", len(done))
        return written

    # ------------------------------------------------------- check-back
    def check_round(self, live_groups: list[str], *, window: int = 2000,
                    max_checks_per_group: int = 1000, now_ms: int | None = None,
                    checks_used: dict[str, int] | None = None) -> list[CheckRequest]:
        """One check-back round over this shard's halves: the checks to ask (``CheckRounds.run``)."""
        now = self.clock.now_ms() if now_ms is None else now_ms
        return self.checks.run(live_groups, now_ms=now, window=window,
                               max_checks_per_group=max_checks_per_group, checks_used=checks_used)

    def uncount_checks(self, checks: list[tuple[int, int]]) -> int:
        """Take back checks that never reached a producer (``CheckRounds.uncount``)."""
        return self.checks.uncount(checks)

    def half_list(self, *, expired: bool = False, limit: int = 1000) -> list[dict]:
        """Pending halves (or expired ones): id, group, transaction, age, checks, topic."""
        with self._tx_lock:
            return self.halves.list_halves(self.clock.now_ms(), expired=expired, limit=limit)

    def transaction_status(self) -> dict:
        with self._tx_lock:
            return self.halves.status()

    def debug_step_times(self, on: bool) -> None:
        """Stamp where each request's time goes (``raymq.storage.steps``): a send's reply
        then carries its shard-side steps (``SendReply.steps``)."""
        steps.enable(on)

    def set_fault(self, fault: str | None) -> None:
        """Test hooks: 'crash_at:POINT[:N]', 'flush_disk_timeout', 'ktx_reply_lost'
        (``raymq.actors.faults`` says what each does)."""
        self.faults = faults_named(fault)

    # ------------------------------------------------- reads and offsets
    def pull(self, requests: list[tuple[str, int, int, int]], wait_ms: int = 0,
             tags: dict[str, list[str]] | None = None, group: str | None = None,
             isolation: str = "read_committed", form: str = "messages",
             reset: str = "earliest") -> list[tuple]:
        """Read several queues, long-polling up to ``wait_ms`` (``QueueReads.pull``): user
        topics this shard serves, and the retry topic of the consumer's own ``group``
        (RayMQ's other topics have operator calls).  ``isolation`` ``read_committed``
        reads up to each queue's last stable offset and leaves out aborted Kafka-style
        transactions; ``read_uncommitted`` reads everything written.  ``form``
        ``messages`` answers ``MessageBatch`` es, ``spans`` the records undecoded
        (``RecordSpans``: for columnar readers, without a tag filter), ``kafka`` spans
        with each queue's (high watermark, log start).  ``reset``: below a
        queue's log start, ``earliest``, ``latest`` or ``error`` (``QueueReads._reset``)."""
        check_pull(requests, wait_ms, tags)
        check_pull_options(group, isolation, form, tags, reset)
        self.routes.check_readable({(t, q) for t, q, _o, _n in requests}, group)
        return self.reads.pull(requests, wait_ms, tags, isolation == "read_committed",
                               _SPANS[form], reset, group)

    def commit_offsets(self, group: str, offsets: dict[tuple[str, int], int]) -> None:
        """Set committed offsets of a group (next offset to consume).  Idempotent."""
        check_offsets(offsets, group)
        self.routes.check_readable(set(offsets), group)
        self.offsets.commit(group, offsets)

    def delete_offsets(self, group: str, queues: list[tuple[str, int]]) -> None:
        """Forget a group's committed offsets of ``queues`` (its next reader starts as a new
        group's would)."""
        check_group(group)
        check_queues(queues)
        self.routes.check_readable(set(queues), group)
        self.offsets.delete(group, queues)

    def get_offsets(self, group: str, queues: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Committed offsets (-1: none yet)."""
        check_group(group)
        check_queues(queues)
        return self.offsets.get(group, queues)

    def queue_bounds(self, queues: list, times: list | None = None, isolation=None) -> dict:
        """Each queue's (log start, end, first offset stored at or after its time in
        ``times``, else -1): ``offsets_for_times``, ``reset-offsets``, ListOffsets."""
        check_queues(queues)
        self.routes.check(set(queues))
        return self.reads.bounds(queues, times, isolation)

    def producer_sequences(self, pids: list[int]) -> list[int | None]:
        """Each client producer's last stored put sequence (None: none remembered)."""
        check_producer_ids(pids)
        return [self.store.last_sequence(p) or None for p in pids]

    def get_message(self, phys_offset: int) -> StoredMessage:
        """The message a client's id names, as its consumers get it (a delayed or
        transactional message: its real topic and queue, queue offset -1); "no such
        message" for an id that names none, or one not confirmed yet (a replicated
        shard's look-ups see what its readers see)."""
        self.reads.check_confirmed(phys_offset)
        return as_delivered(self.index, stored_message(self.store, self.index, phys_offset))

    def find_by_key(self, topic: str, key: str, max_scan: int = 200_000) -> list[StoredMessage]:
        """Messages of ``topic`` on this shard with ``key``, scanning the newest ``max_scan``
        (of a replicated shard, the confirmed ones)."""
        return self.reads.find_by_key(topic, key, max_scan)

    def queue_info(self) -> dict:
        self.routes.refresh()
        depth = {f"{t}/{q}": self.store.max_queue_offset(t, q) for t, q in self.routes.sorted()}
        return {"shard": self.index, "queues": depth, "lag": self.offsets.lag(),
                "schedule_pending": self.delays.pending(),
                "max_delay_lateness_ms": self.delays.max_lateness_ms,
                "timers": self.timers.status(),
                "log_bytes": self.store.max_phys_offset, "retention": self.janitor.status()}

    def drop_topic(self, topic: str) -> bool:
        """The controller deleted ``topic``: what this shard holds of it goes
        (``raymq.actors.retention.drop_topic``); whether it held any."""
        return drop_topic(self, topic)

    # -------------------------------------------------- delays and retries
    def deliver_due(self) -> int:
        """Move every due delayed and timer message to its real queue; return the wait (ms)
        to the next."""
        return min(self.delays.deliver_due(), self.timers.deliver_due())

    def cancel_scheduled(self, phys_offset: int) -> str:
        """Cancel a delayed or timer message before it is delivered (its send result's
        physical offset): 'cancelled' or 'already cancelled'; ``AlreadyDeliveredError``
        after it was delivered, ``NotScheduledError`` for a message that never waited."""
        return cancel_scheduled(scheduled_message(self.timers, phys_offset), self.timers,
                                self.delays)

    def timer_list(self, due_before_ms: int, limit: int = 100) -> list[dict]:
        """Timer messages not yet delivered that are due before ``due_before_ms``."""
        return self.timers.list_due(int(due_before_ms), int(limit))

    def send_back(self, group: str, phys_offset: int, *, reason: str = "",
                  dead_letter: bool = False, retry_after_ms: int | None = None) -> dict:
        """A consumer failed on a message: redeliver it later, or dead-letter it
        (``DeadLetters.send_back``)."""
        if retry_after_ms is not None and (
                isinstance(retry_after_ms, bool) or not isinstance(retry_after_ms, int)
                or not 0 <= retry_after_ms <= self.config.max_delay_ms):
            raise InvalidMessageError(f"retry_after_ms must be 0..{self.config.max_delay_ms} "
                                      f"(max_delay_ms), got {retry_after_ms!r}")
        return self.dead_letters.send_back(group, phys_offset, reason=reason,
                                           dead_letter=dead_letter,
                                           retry_after_ms=retry_after_ms)

    def dlq_list(self, group: str, offset: int = 0, max_messages: int = 100) -> list[StoredMessage]:
        """Dead letters of a group on this shard, from ``offset``."""
        return self.dead_letters.list(group, offset, max_messages)

    def dlq_resend(self, group: str, phys_offsets: list[int] | None = None) -> list[str]:
        """Send dead letters back to the group's retry topic (``DeadLetters.resend``)."""
        return self.dead_letters.resend(group, phys_offsets)

    # ------------------------------------------- Kafka-style transactions
    def ktx_register(self, producer_id: int, epoch: int, queues: list, groups=()) -> None:
        """The coordinator adds queues and groups to a producer's transaction here."""
        self.ktx.register(producer_id, epoch, _registration_checked(self, queues, groups),
                          list(groups))

    def ktx_send(self, batch: RecordBatch, producer_id: int, epoch: int,
                 sequence: int, wait_ms: int = 0, durable: bool = True) -> SendReply:
        """A Kafka-style transactional write (``KafkaTxnQueues.send``): all or nothing;
        ``durable=False``: answered once written (its commit makes it durable)."""
        queues = _ktx_checked(self, batch, producer_id, sequence)
        t0 = self.clock.monotonic_ms()
        res = self.ktx.send(batch, queues, producer_id, epoch, sequence,
                            lambda b, pid, seq: self.store.put(b, producer_id=pid, sequence=seq,
                                                               wait=durable is not False),
                            wait_ms, self.config.send_timeout_ms)
        self.metrics.observe("put_latency_ms", self.clock.monotonic_ms() - t0)
        self.faults.ktx_stored()
        return self._sent(batch, res, res.status)

    def ktx_commit_batch(self, batch: RecordBatch, producer_id: int, epoch: int, sequence: int):
        """A Kafka-style transaction of one request, one put (``KafkaTxnQueues.commit_batch``)."""
        res = commit_batch(self.ktx, batch, _ktx_checked(self, batch, producer_id, sequence),
                           producer_id, epoch, sequence,
                           lambda b, pid, seq: self.store.put(b, producer_id=pid, sequence=seq))
        return SendReply("SEND_OK", [], [], True) if res is None \
            else self._sent(batch, res, res.status)  # (None: a resend, stored before)

    def ktx_offsets(self, producer_id: int, epoch: int, group: str, offsets: dict, wait_ms=0):
        """A group's next offsets, to commit with the producer's transaction."""
        check_offsets(offsets, group)
        self.routes.check_readable(set(offsets), group)
        self.offsets.values(group, offsets)  # (each in its queue's range)
        self.ktx.add_offsets(producer_id, epoch, group, dict(offsets), wait_ms,
                             self.config.send_timeout_ms)

    def ktx_end(self, producer_id: int, epoch: int, outcome: str, expect: int | None = None,
                decide: bool = False) -> dict:
        """The coordinator ends a producer's transaction here (``KafkaTxnQueues.end``)."""
        return self.ktx.end(producer_id, epoch, outcome, expect=expect, decide=decide is True)

    def ktx_verify(self, producer_id: int, epoch: int, expect: int) -> None:
        """Before a two-phase commit: the producer's writes here are all here, durable."""
        self.ktx.verify(producer_id, epoch, int(expect))

    def ktx_epoch(self, producer_id: int) -> int:
        """The highest epoch of a Kafka-style producer seen here (-1: none)."""
        return self.ktx.epoch_of(producer_id)

    def ktx_status(self) -> list[dict]:
        """Open Kafka-style transactions on this shard (``raymq tx hanging``)."""
        return self.ktx.status(self.clock.now_ms())

    # ---------------------------------------------------------------- admin
    def ping(self) -> dict:
        return {"shard": self.index, "directory": self.directory, "pid": os.getpid()}

    def close(self) -> None:
        for part in (self.delays, self.timers, self.ktx, self.janitor):
            part.stop()
        self.store.close()




def _registration_checked(shard: BrokerShard, queues: list, groups) -> list[tuple[str, int]]:
    """The queues (checked, served here) and groups (checked) a coordinator registers."""
    check_queues(queues)
    for g in groups:
        check_group(g)
    queues = [(t, q) for t, q in queues]
    shard.routes.check(set(queues))
    return queues


def _ktx_checked(shard: BrokerShard, batch: RecordBatch, producer_id: int,
                 sequence: int) -> set[tuple[str, int]]:
    """A Kafka-style transactional write's checks (the request, room on the disk, routes
    served here); its queues."""
    check_send(batch, producer_id, sequence, None)
    check_transactional(batch, len(shard._levels_ms), SYSTEM_PROPERTIES)
    shard.janitor.refuse_if_full(batch)
    queues = batch.queues()
    shard.routes.check(queues)
    return queues


def _bytes_of(sizes, n: int) -> float:
    """The bytes of a put's first ``n`` records (a few: Python's sum; numpy's costs ~4 us
    however few they are)."""
    return float(sum(sizes[:n].tolist()) if n <= 16 else sizes[:n].sum())


def _reply_offsets(batch: RecordBatch, res, n: int, timers) -> list[int]:
    """The queue offsets a send's reply gives its records: -1 for one diverted (delayed,
    a timer's, a half), whose offset in its real queue comes when it is delivered
    (committed); ``timers`` hear of the earliest timer record scheduled."""
    queue_offsets = res.queue_offset_array[:n].tolist()
    if batch.properties is None:  # only then can a record have been diverted
        return queue_offsets
    topics = batch.column("topics")
    waiting = (SCHEDULE_TOPIC, HALF_TOPIC, TIMER_TOPIC)
    if not any(t in topics for t in waiting):
        return queue_offsets
    if TIMER_TOPIC in topics:
        codes = batch.column("tag_codes")
        timers.scheduled(min(codes) if batch.topics == TIMER_TOPIC else min(
            c for t, c in zip(topics, codes) if t == TIMER_TOPIC))
    return [-1 if t in waiting else o for t, o in zip(topics, queue_offsets)]


#: A pull's ``form`` -> ``QueueReads.pull``'s ``spans``.
_SPANS = {"messages": False, "spans": True, "kafka": "kafka"}
#: The calls clients and operators make: a malformed one is answered in one line.
_PUBLIC_CALLS = ("send", "end_transactions", "end_transaction", "resolve_half", "check_round",
                 "uncount_checks", "half_list", "pull", "commit_offsets", "get_offsets",
                 "get_message", "find_by_key", "queue_bounds", "drop_topic", "send_back",
                 "dlq_list", "dlq_resend",
                 "ktx_register", "ktx_send", "ktx_offsets", "ktx_verify", "ktx_end",
                 "ktx_commit_batch", "ktx_epoch", "cancel_scheduled",
                 "timer_list")
for _name in _PUBLIC_CALLS:
    setattr(BrokerShard, _name, answers_in_one_line(getattr(BrokerShard, _name)))


def _spread(reply: SendReply, n: int, keep: list[int], refused: dict[int, str]) -> SendReply:
    """A reply for the stored records ``keep`` of an ``n``-record request, with -1 offsets
    (and the reason in ``refused``) for the others."""
    if reply.phys or not keep:  # (else a duplicate whose offsets are no longer known)
        phys, qoffs = [-1] * n, [-1] * n
        for j, i in enumerate(keep):
            phys[i], qoffs[i] = reply.phys[j], reply.queue_offsets[j]
        reply.phys, reply.queue_offsets = phys, qoffs
    reply.refused = refused
    return reply
