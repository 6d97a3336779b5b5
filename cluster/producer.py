"""Producer: queue selection, client-side batching into per-lane requests, idempotent
retries with back-off; its time (linger, back-off, born stamps) from an injected clock.

Concurrent ``send`` calls from many threads are coalesced into one request
per shard (Kafka-producer style ``linger_ms`` / ``batch_max_messages``); each
caller still gets its own ``SendResult``.

Requests to a shard travel in *lanes*: a queue always uses lane
``queue_id % producer_lanes``, each lane has its own producer id and
sequence, and one request per lane is in flight at a time.  So the order of
a queue is kept (its messages are in one lane, one request after another),
requests for different queues overlap, and every request is idempotent: it
is resent unchanged after a timeout or a shard restart and the shard stores
it once.

A busy lane is driven by one *runner* (an I/O thread): it sends a request,
waits for the answer, sends the next request of whatever gathered meanwhile,
then completes the answered callers, without handing off to another thread.  A
lane that is idle is started by the send that finds it so (or by the
producer's own thread, for lingering requests and retry back-offs); a synchronous
single ``send`` that finds its lane idle sends its request and reads the answer in
the caller's own thread, as Kafka's and RocketMQ's synchronous sends do (what gathered
meanwhile then goes to a runner).
"""
from __future__ import annotations

import logging
import os
import random
import threading
from collections import defaultdict, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from raymq.actors.protocol import EndOutcome, SendReply
from raymq.actors.front.requests import ACKS
from raymq.clock import client_clock
from raymq.storage import steps
from raymq.storage.clock import Clock
from raymq.transport import Outcome
from raymq.message import (Columns, Message, SendResult, SendStatus, assign_queues,
                           columns_to_batch, key_queue, record_properties, validate_messages)
from raymq.storage.records import RecordBatch, none_if_empty, shared_value
from raymq.storage.errors import ConfigError, InvalidMessageError, RayMQError

#: Whether a synchronous send to an idle lane goes from the caller's own thread
#: (``Producer._submit_one``); ``RAYMQ_INLINE_SENDS=0`` hands every send to a lane runner,
#: as before (to measure one against the other: ``raymq bench produce``).
INLINE_SENDS = os.environ.get("RAYMQ_INLINE_SENDS", "1") != "0"

log = logging.getLogger("raymq.producer")

#: End outcomes that leave the transaction to the check-back.
_NOT_ENDED = (EndOutcome.REFUSED, EndOutcome.FAILED)
#: A write stored, its in-sync replicas not known to hold it in time: sent again.
_UNREPLICATED = SendStatus.FLUSH_SLAVE_TIMEOUT.value
#: Keyless single sends to a topic before its sticky queue moves on.
STICKY_MESSAGES = 64
#: How long transaction ends wait for a request to ride on before they go alone: a
#: sender's next transaction comes within this, and one request then carries both.
END_LINGER_S = 0.001


@dataclass
class _Pending:
    batch: object  # a send_batch call's slice (RecordBatch), or a single send's row (tuple)
    future: Outcome  # -> list[SendResult], one per message
    topics: str | list[str]  # one topic for all its messages, or each one's
    qids: list[int]
    positions: list[int]  # where each message stands in its send_batch call
    queued_at_s: float = 0.0  # the producer clock's monotonic seconds


def _rows_batch(rows: list[tuple]) -> RecordBatch:
    """One batch of single sends' rows: (topic, queue, body, key, tags, properties, born,
    headers)."""
    topics, qids, bodies, keys, tags, props, born, headers = map(list, zip(*rows))
    return RecordBatch(shared_value(topics), shared_value(qids), bodies,
                       keys=none_if_empty(keys), tags=none_if_empty(tags),
                       properties=none_if_empty(props), born_ms=shared_value(born),
                       headers=none_if_empty(headers))


def _request_batch(parts: list) -> RecordBatch:
    """The request of a lane: its parts (single sends' rows and send_batch slices) in order."""
    if all(type(p) is tuple for p in parts):
        return _rows_batch(parts)
    batches, rows = [], []
    for p in parts:
        if type(p) is tuple:
            rows.append(p)
            continue
        if rows:
            batches.append(_rows_batch(rows))
            rows = []
        batches.append(p)
    if rows:
        batches.append(_rows_batch(rows))
    return RecordBatch.concat(batches)


class _Raise:
    """A call that could not even start: its result is the error."""

    def __init__(self, err: BaseException):
        self.err = err

    def result(self):
        raise self.err


class PartResults:
    """The results of one part of a send, made into ``SendResult`` objects on demand."""

    __slots__ = ("status", "shard", "topics", "qids", "queue_offsets", "phys")

    def __init__(self, status, shard, topics: str | list[str], qids: list[int],
                 queue_offsets, phys):
        self.status, self.shard, self.topics, self.qids = status, shard, topics, qids
        self.queue_offsets, self.phys = queue_offsets, phys

    def __len__(self) -> int:
        return len(self.qids)

    def __getitem__(self, i: int) -> SendResult:
        topic = self.topics if isinstance(self.topics, str) else self.topics[i]
        qid = self.qids[i]
        if self.phys is None:
            return SendResult(self.status, "", qid, -1, topic)
        return SendResult.located(self.status, self.shard, self.phys[i], qid,
                                  self.queue_offsets[i], topic)


class SendResults(Sequence):
    """What ``send_batch`` returns: one ``SendResult`` per message, in send order."""

    def __init__(self, parts: list[tuple[PartResults, list[int]]], n: int):
        self._parts = parts
        self._n = n

    @cached_property
    def _where(self) -> dict[int, tuple[int, int]] | None:
        """Position -> (part, index in it), made when first needed (a caller that never
        looks at its results does not pay a pass per message); None: the identity."""
        parts = self._parts
        if len(parts) == 1 and parts[0][1] == list(range(self._n)):
            return None
        return {pos: (p, i) for p, (_, positions) in enumerate(parts)
                for i, pos in enumerate(positions)}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        if self._where is None:
            return self._parts[0][0][i]
        p, j = self._where[i]
        return self._parts[p][0][j]

    def __repr__(self) -> str:
        return f"SendResults({self._n} results)"


class Producer:
    def __init__(self, mq, group: str = "default", *, clock: Clock | None = None,
                 acks: str = "all"):
        """``acks``: what a send waits for on a replicated shard -- ``"all"`` (default:
        every in-sync replica holds it, and it is refused while fewer than
        ``min_insync_replicas`` are in sync) or ``"leader"`` (the leader's own write:
        faster, and lost if the leader is lost before a follower copied it)."""
        if acks not in ACKS:
            raise ConfigError(f"acks must be one of {', '.join(ACKS)}, not {acks!r}")
        self.acks = acks
        self._mq = mq
        self.group = group
        self.config = mq.config
        clock = client_clock(clock)
        self._now_ms = clock.now_ms  # bound once: these are per message
        self._monotonic_s = clock.monotonic_s
        self._sleep_s = clock.sleep_s
        rng = random.SystemRandom()
        self.lanes = max(1, int(mq.config.producer_lanes))
        self._lane_pids = [rng.getrandbits(62) | 1 for _ in range(self.lanes)]
        self.producer_id = self._lane_pids[0]
        self._seq: dict[int, int] = defaultdict(int)
        self._pending: dict[int, deque[_Pending]] = defaultdict(deque)
        self._lock = threading.Lock()  # the producer's state; plain, so cheap to take
        self._cv = threading.Condition(self._lock)  # the producer thread waits on it
        self._rr_next: dict[str, int] = {}
        self._sticky_count: dict[str, int] = {}
        self._ends: dict[int, list] = defaultdict(list)
        self._ends_due_s: dict[int, float] = {}  # shard -> when its waiting ends go alone
        self._num_levels = len(self.config.delay_levels_ms)
        self._closed = False
        self.retries = 0
        self.requests = 0  # requests sent to shards (attempts), for benchmarks and status
        #: the steps of the last request answered, and of the last ``send`` (steps on)
        self.last_shard_steps: list | None = None
        self.last_steps: list | None = None
        from raymq.metrics import RayMetrics
        self.metrics = RayMetrics(client="producer", group=group, clock=clock)
        self._active: set[tuple[int, int]] = set()  # lanes with a runner
        # a busy lane keeps its runner: one thread per lane, or a lane could wait for one
        self._runners = ThreadPoolExecutor(
            max_workers=max(64, int(mq.config.num_shards) * self.lanes),
            thread_name_prefix="raymq-lane")
        self._thread = threading.Thread(target=self._run, name="raymq-producer", daemon=True)
        self._thread.start()

    # --------------------------------------------------------------- API
    def send(self, msg: Message, timeout_s: float | None = None) -> SendResult:
        """Send one message; blocks until the shard stored it (or raises)."""
        if self._closed:
            raise RayMQError("producer is closed")
        if steps.enabled:
            return self._send_stamped(msg, timeout_s)
        return self._submit_one(msg, None, inline=timeout_s is None)[0].result(timeout_s)[0]

    def _send_stamped(self, msg: Message, timeout_s: float | None) -> SendResult:
        """``send`` with its steps stamped (``raymq.storage.steps`` on): ``last_steps``
        holds them after it, the shard's with the client's."""
        steps.start("client.call")
        result = self._submit_one(msg, None, inline=timeout_s is None)[0].result(timeout_s)[0]
        steps.mark("client.woken")
        self.last_steps = (steps.take() or []) + (self.last_shard_steps or [])
        return result

    def send_async(self, msg: Message) -> Future:
        """Send one message; the future gives its ``SendResult``."""
        out: Future = Future()
        [part] = self._submit([msg])

        def done(f: Future) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(f.result()[0])
        part[0].add_done_callback(done)
        return out

    def send_batch(self, msgs: list[Message], timeout_s: float | None = None) -> "SendResults":
        """Send many messages; a sequence with one ``SendResult`` each, in order.

        Messages to different shards travel in parallel; a failure of any
        raises (the others may have been stored: results are per shard).
        """
        msgs = list(msgs)
        if not msgs:
            return SendResults([], 0)
        parts = [(fut.result(timeout_s), positions) for fut, positions in self._submit(msgs)]
        return SendResults(parts, len(msgs))

    def add_ends(self, shard: int, ends: list) -> None:
        """Queue one-way transaction ends for a shard; they ride on the next request there.

        ``ends``: ``[(group, transaction id, origins, state)]`` (``BrokerShard.end_transactions``).
        """
        with self._lock:
            self._ends[shard].extend(ends)
            lanes = [(shard, lane) for lane in range(self.lanes)]
            waiting = [k for k in lanes if self._pending.get(k) and k not in self._active]
            if waiting:  # a request about to go: they ride on it
                self._kick(waiting[0])
            else:  # nothing to ride on yet: wait a moment for the sender's next request
                # (or for the answer of one in flight: its lane's next claim takes them)
                self._ends_due_s.setdefault(shard, self._monotonic_s() + END_LINGER_S)
                self._cv.notify_all()

    def close(self) -> None:
        """Send what is pending, then stop."""
        with self._lock:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
        self._runners.shutdown(wait=True)
        self.metrics.flush()

    # ---------------------------------------------------------- internal
    def _next_rr(self, topic: str, count: int) -> int:
        """Reserve ``count`` round-robin slots of a topic; return the first."""
        with self._lock:
            start = self._rr_next.get(topic, 0)
            self._rr_next[topic] = start + count
            return start

    def _assign(self, cols: Columns, routes: dict[str, list[int]]):
        """Queue id and shard of every message (``assign_queues``: sticky round-robin of
        ``batch_max_messages`` chunks; one queue per message for single sends)."""
        return assign_queues(cols, routes, self._next_rr, self.config.batch_max_messages)

    def _submit(self, msgs: list[Message], system_props: dict[str, str] | None = None, *,
                inline: bool = False) -> list[tuple[Future, list[int]]]:
        """Queue messages for the sender; (future of results, positions) per part.

        ``system_props`` (RayMQ's own, e.g. transaction markers) are added to
        every message after validation.  ``inline``: the caller waits for the result
        anyway, so a single message to an idle lane is sent and awaited in its own thread
        (``_submit_one``).
        """
        if self._closed:
            raise RayMQError("producer is closed")
        if len(msgs) == 1:
            return [self._submit_one(msgs[0], system_props, inline=inline)]
        cols = validate_messages(msgs, self.config.max_message_bytes,
                                 len(self.config.delay_levels_ms),
                                 max_delay_ms=self.config.max_delay_ms)
        if system_props:
            cols.properties = [{**(p or {}), **system_props} for p in cols.properties]
        routes = self._mq.routes_for(set(cols.topic))
        qids, shards = self._assign(cols, routes)
        born_ms = self._now_ms()
        limit = self.config.batch_max_messages
        parts, pendings = [], []
        lanes = shards * self.lanes + qids % self.lanes
        single = lanes.min() == lanes.max()
        for lane_key in np.unique(lanes).tolist():
            key = divmod(lane_key, self.lanes)
            idx_all = np.arange(cols.n) if single else np.flatnonzero(lanes == lane_key)
            for lo in range(0, len(idx_all), limit):
                idx = idx_all[lo:lo + limit].tolist()
                q = qids[idx_all[lo:lo + limit]].tolist()
                batch = columns_to_batch(cols, idx, q, born_ms)
                fut = Outcome()
                pendings.append((key, _Pending(batch, fut, batch.topics, q, idx,
                                               self._monotonic_s())))
                parts.append((fut, idx))
        with self._lock:
            if self._closed:  # close() may have begun since the check above
                raise RayMQError("producer is closed")
            for key, pending in pendings:
                self._pending[key].append(pending)
            for key in {key for key, _ in pendings}:
                self._kick(key)
        return parts

    def _submit_one(self, m: Message, system_props: dict[str, str] | None, *,
                    inline: bool = False) -> tuple[Future, list[int]]:
        """The single-message path: no columns, no numpy (this is per message).

        ``inline`` (a caller that waits for the result): when the lane is idle, the
        caller's own thread sends the request and reads its answer, as Kafka's and
        RocketMQ's synchronous sends do -- no hand-off to a lane runner and back, two
        thread wake-ups fewer a request.  A busy lane takes the message into its next
        request as usual (single sends of many threads share requests)."""
        m.validate(self.config.max_message_bytes, self._num_levels, self.config.max_delay_ms)
        route = self._mq.routes_for((m.topic,))[m.topic]
        qid = key_queue(m.key, len(route)) if m.key else self._sticky_queue(m.topic, len(route))
        shard = route[qid]
        props = None
        if m.properties or m.delay_level or m.deliver_at_ms is not None \
                or m.deliver_after_ms is not None or system_props:
            props = [record_properties(m.properties, m.delay_level, m.deliver_at_ms,
                                       system_props, m.deliver_after_ms)]
        body = m.body if type(m.body) is bytes else bytes(m.body)
        row = (m.topic, qid, body, m.key or None, m.tags or None, props and props[0],
               self._now_ms(), m.headers or None)
        fut = Outcome()
        key = (shard, qid % self.lanes)
        work = None
        with self._lock:
            if self._closed:  # close() may have begun since the caller's check
                raise RayMQError("producer is closed")
            self._pending[key].append(_Pending(row, fut, m.topic, [qid], [0],
                                               self._monotonic_s()))
            if inline and INLINE_SENDS:
                work = self._claim(key, self._monotonic_s())
            if work is None:
                self._kick(key)
        if work is not None:
            self._drive(key, work, inline=True)
        return fut, [0]

    def _take(self, key: tuple[int, int]) -> list[_Pending]:
        queue = self._pending[key]
        items, count = [], 0
        while queue and count + len(queue[0].positions) <= self.config.batch_max_messages:
            p = queue.popleft()
            items.append(p)
            count += len(p.positions)
        if not items and queue:
            items.append(queue.popleft())
        return items

    def _claim(self, key: tuple[int, int], now_s: float):
        """With ``_cv`` held: lane ``key``'s next request, if it should go now.

        Returns ``(items, sequence, ends)`` and marks the lane active, or None
        (the lane has a runner already, has nothing to send, or lingers).
        """
        if key in self._active:
            return None
        queue = self._pending.get(key)
        if not queue:
            if not self._ends.get(key[0]):
                return None
            if now_s < self._ends_due_s.get(key[0], 0.0) and not self._closed:
                return None  # ends alone: they wait a moment for a request to ride on
        linger_s = self.config.linger_ms / 1000.0
        if linger_s and queue and not self._closed and \
                now_s - queue[0].queued_at_s < linger_s and \
                sum(len(p.positions) for p in queue) < self.config.batch_max_messages:
            return None  # wait for more to come
        items = self._take(key) if queue else []
        ends = self._ends.pop(key[0], [])  # (a shard's ends ride on any lane's request)
        self._ends_due_s.pop(key[0], None)
        sequence = 0
        if items:
            self._seq[key] += 1
            sequence = self._seq[key]
        self._active.add(key)
        return items, sequence, ends

    def _kick(self, key: tuple[int, int]) -> None:
        """With ``_cv`` held: give lane ``key`` a runner if it is idle and has work."""
        work = self._claim(key, self._monotonic_s())
        if work is not None:
            self._start(key, work)
        elif self.config.linger_ms:
            self._cv.notify_all()  # the producer thread times the linger

    def _start(self, key: tuple[int, int], work) -> None:
        """With ``_cv`` held: a runner for lane ``key``'s claimed work."""
        try:
            self._runners.submit(self._drive, key, work)
        except RuntimeError as err:  # the runners are gone (interpreter exit): fail, not hang
            self._active.discard(key)
            items, _sequence, ends = work
            self._fail(items, RayMQError(f"producer is closed: {err}"), ends)

    def _drive(self, key: tuple[int, int], work, inline: bool = False) -> None:
        """A lane's runner: its requests one after another, while it has any.

        When an answer arrives, the lane's next request goes out before the
        callers of the answered one are woken: woken callers hold the
        interpreter for a while, and the shard would wait for its next
        request meanwhile.  ``inline`` (a caller's own thread, ``_submit_one``): one
        request only; what the lane has next goes to a runner.
        """
        current = self._send_request(key, work)
        while current is not None:
            (items, _sequence, ends), request, args, call = current
            result, again = None, None
            try:
                result = self._answer(key, args, call)
            except BaseException as err:  # given up on, or a bug: these callers fail
                if items and ends:  # the ends were fine: they go again, on their own
                    again = ends
                    self._fail(items, err)
                else:
                    self._fail(items, err, ends)
            with self._lock:
                self._active.discard(key)
                if again:  # ahead of ends queued since (ends are idempotent)
                    self._ends[key[0]][:0] = again
                work = self._claim(key, self._monotonic_s())
                if work is not None and inline:  # (the caller has its answer: a runner
                    self._start(key, work)       # takes the lane's next request)
                    work = None
                elif work is None and (self._closed or self.config.linger_ms
                                       or self._ends.get(key[0])):
                    self._cv.notify_all()  # the producer thread starts what lingers
            current = self._send_request(key, work) if work is not None else None
            if result is not None:
                try:
                    self._complete(key[0], items, request, result)
                except BaseException as err:  # a malformed answer must not leave callers waiting
                    self._fail(items, err, ends)

    def _send_request(self, key: tuple[int, int], work):
        """Send lane ``key``'s request: (work, request batch, send arguments, call)."""
        items, sequence, ends = work
        request, args, call = None, (), None
        try:
            request = _request_batch([p.batch for p in items]) if items else None
            steps.mark("client.batched")
            args = (request, self._lane_pids[key[1]] if sequence else 0, sequence)
            if ends or self.acks != "all":
                args += (ends or None,)
            if self.acks != "all":
                args += (self.acks,)
            self.requests += 1
            call = self._mq.transport.begin(key[0], "send", args,
                                            timeout_s=self.config.send_timeout_ms / 1000)
        except BaseException as err:
            call = _Raise(err)
        return work, request, args, call

    def _answer(self, key: tuple[int, int], args: tuple, call) -> SendReply:
        """A request's answer; sent again (``_resend``) when it failed retriably, or when
        its write was answered ``FLUSH_SLAVE_TIMEOUT`` (a request with a sequence)."""
        try:
            reply = call.result()
        except RayMQError as err:
            return self._resend(key, args, err)
        if reply.status != _UNREPLICATED or not args[2]:
            return reply
        return self._resend(key, args, None, reply)

    def _resend(self, key: tuple[int, int], args: tuple, err: RayMQError | None,
                reply: SendReply | None = None) -> SendReply:
        """Send a request again after back-offs, while its failure ``err`` is retriable,
        or while its ``reply`` is ``FLUSH_SLAVE_TIMEOUT`` (``err`` None): stored, its
        in-sync replicas not known to hold it in time -- as while a follower that died
        is still in the in-sync set, until its lease runs out (Kafka's producer retries
        that too).  A resend has the request's sequence: the shard stores it once and
        waits again for the replicas.  Its last answer (``FLUSH_SLAVE_TIMEOUT`` still
        when the retries ran out); once a ``FLUSH_SLAVE_TIMEOUT`` came, resends that
        fail end in that answer, not their error: the write is known stored, its
        replicas unconfirmed (an error would read as not stored, and a caller who sends
        it again with another producer would store it twice).

        The lane waits through the back-off: a later request must not
        overtake this one (its queue order, and its sequence at the shard).
        """
        attempt, stored = 0, reply
        # a closing producer gives up early -- but not on transaction ends: dropped, a
        # committed transaction stays pending with no producer of its own left to answer
        # its check-back (a shard restarting while the producer closes)
        quick = not (len(args) > 3 and args[3])
        while True:
            if attempt >= self.config.send_retries or (self._closed and attempt >= 2 and quick) \
                    or (err is not None and not err.retriable):
                if err is None:
                    return reply
                if stored is not None:
                    log.warning("send to shard-%d: resends failed (%s) after it was stored "
                                "unreplicated: FLUSH_SLAVE_TIMEOUT", key[0], err)
                    return stored
                raise err
            backoff_s = min(self.config.retry_backoff_ms * (2 ** attempt),
                            self.config.retry_backoff_max_ms) / 1000.0
            attempt += 1
            self.retries += 1
            self.metrics.inc("send_retries")
            why = err if err is not None else "stored, not confirmed by its in-sync " \
                "replicas in time: FLUSH_SLAVE_TIMEOUT"
            log.warning("send to shard-%d failed (%s); retry %d in %.2f s", key[0], why,
                        attempt, backoff_s)
            self._sleep_s(backoff_s)
            self.requests += 1
            try:
                reply = self._mq.transport.call(key[0], "send", *args,
                                                timeout_s=self.config.send_timeout_ms / 1000)
            except RayMQError as again:
                err = again
                continue
            if reply.status != _UNREPLICATED:
                return reply
            err, stored = None, reply

    def _run(self) -> None:
        """The producer's own thread: starts lanes whose linger ran out; ends the producer."""
        linger_s = self.config.linger_ms / 1000.0
        while True:
            with self._lock:
                now_s = self._monotonic_s()
                keys = [k for k, q in self._pending.items() if q]
                keys += [(s, 0) for s, e in self._ends.items() if e]
                due_s = []  # when lingering requests (or ends) go
                for key in keys:
                    work = self._claim(key, now_s)
                    if work is not None:
                        self._start(key, work)
                    elif linger_s and key not in self._active and self._pending.get(key):
                        due_s.append(self._pending[key][0].queued_at_s + linger_s)
                    elif key[0] in self._ends_due_s and key not in self._active:
                        due_s.append(self._ends_due_s[key[0]])
                if self._closed and not self._active and not any(self._pending.values()) \
                        and not any(self._ends.values()):
                    return
                self._cv.wait(max(0.0002, min([0.05] + [t - now_s for t in due_s])))

    def _sticky_queue(self, topic: str, queues: int) -> int:
        """The queue of a keyless single send: the topic's sticky queue.

        Kafka's sticky partitioning: concurrent single sends share a queue, so
        they share one request (and a transaction's end rides with the next
        halves to the same shard); after ``STICKY_MESSAGES`` sends the queue
        moves on, so over time the queues fill as evenly as round-robin.
        """
        with self._lock:
            turn = self._rr_next.get(topic, 0)
            count = self._sticky_count.get(topic, 0) + 1
            if count >= STICKY_MESSAGES:
                self._rr_next[topic], count = turn + 1, 0
            self._sticky_count[topic] = count
            return turn % queues

    def _complete(self, shard: int, items: list[_Pending], request, result: SendReply) -> None:
        if result.steps:
            self.last_shard_steps = result.steps
        for end in result.ends or ():
            if end.outcome in _NOT_ENDED:
                log.warning("end_transaction refused by shard-%d: %s", shard, end)
        status = SendStatus(result.status)
        if request is not None:
            self.metrics.inc("messages_sent", len(result.phys) or len(request))
        phys, qoffs = result.phys, result.queue_offsets
        refused = result.refused
        i = 0
        known = len(phys)
        for p in items:
            k = len(p.qids)
            why = refused and next((refused[j] for j in range(i, i + k) if j in refused), None)
            if why:  # refused alone by the shard: the other callers' messages are stored
                p.future.set_exception(InvalidMessageError(why))
            elif i + k <= known:
                p.future.set_result(PartResults(status, shard, p.topics, p.qids,
                                                qoffs[i:i + k], phys[i:i + k]))
            else:  # a duplicate whose offsets the shard no longer remembers
                p.future.set_result(PartResults(status, shard, p.topics, p.qids, [-1] * k,
                                                None))
            i += k

    @staticmethod
    def _fail(items: list[_Pending], err: BaseException, ends: list | None = None) -> None:
        for p in items:
            if not p.future.done():
                p.future.set_exception(err)
        if ends:  # swallowed, as a one-way end is: the check-back settles these
            log.warning("%d transaction end(s) not delivered: %s", len(ends), err)
