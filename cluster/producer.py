"""Producer: queue selection, client-side batching, idempotent retries.

Concurrent ``send`` calls from many threads are coalesced into one request
per shard (Kafka-producer style ``linger_ms`` / ``batch_max_messages``); each
caller still gets its own ``SendResult``.  Every request carries the
producer's id and a per-shard sequence; a request is resent unchanged after a
timeout or a shard restart, and the shard stores it once.  One request per
shard is in flight at a time, which keeps the order of a queue.
"""
from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future
from dataclasses import dataclass

import ray

from cluster import rpc
from cluster.message import Message, SendResult, SendStatus, key_queue, make_msg_id, merge_batches, to_batch
from storage.errors import RayMQError, RequestTimeoutError

log = logging.getLogger("raymq.producer")


@dataclass
class _Pending:
    batch: object  # RecordBatch of one message or one send_batch call's slice
    futures: list[Future]
    topic_qids: list[tuple[str, int]]


@dataclass
class _InFlight:
    ref: object
    items: list[_Pending]
    request: object
    sequence: int
    attempt: int
    deadline: float


class Producer:
    def __init__(self, mq, group: str = "default"):
        self._mq = mq
        self.group = group
        self.config = mq.config
        self.producer_id = random.SystemRandom().getrandbits(62) | 1
        self._seq: dict[int, int] = defaultdict(int)
        self._pending: dict[int, deque[_Pending]] = defaultdict(deque)
        self._inflight: dict[int, _InFlight] = {}
        self._retrying: dict[int, tuple[_InFlight, float]] = {}
        self._cv = threading.Condition()
        self._rr: dict[str, itertools.count] = defaultdict(itertools.count)
        self._closed = False
        self.retries = 0
        self._thread = threading.Thread(target=self._run, name="raymq-producer", daemon=True)
        self._thread.start()

    # --------------------------------------------------------------- API
    def send(self, msg: Message, timeout_s: float | None = None) -> SendResult:
        """Send one message; blocks until the shard stored it (or raises)."""
        return self.send_async(msg).result(timeout_s)

    def send_async(self, msg: Message) -> Future:
        return self._submit([msg])[0]

    def send_batch(self, msgs: list[Message], timeout_s: float | None = None) -> list[SendResult]:
        """Send many messages; one result each, in order."""
        return [f.result(timeout_s) for f in self._submit(list(msgs))]

    def close(self) -> None:
        """Send what is pending, then stop."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    # ---------------------------------------------------------- internal
    def _choose_queue(self, msg: Message, routes: list[int]) -> int:
        if msg.key:
            return key_queue(msg.key, len(routes))
        return next(self._rr[msg.topic]) % len(routes)

    def _submit(self, msgs: list[Message]) -> list[Future]:
        if self._closed:
            raise RayMQError("producer is closed")
        levels = len(self.config.delay_levels_ms)
        for m in msgs:
            m.validate(self.config.max_message_bytes, levels)
        routes = self._mq.routes_for({m.topic for m in msgs})
        by_shard: dict[int, list[tuple[Message, int, Future]]] = defaultdict(list)
        futures = []
        for m in msgs:
            qid = self._choose_queue(m, routes[m.topic])
            fut: Future = Future()
            futures.append(fut)
            by_shard[routes[m.topic][qid]].append((m, qid, fut))
        born = int(time.time() * 1000)
        with self._cv:
            for shard, items in by_shard.items():
                limit = self.config.batch_max_messages
                for lo in range(0, len(items), limit):
                    part = items[lo:lo + limit]
                    batch = to_batch([m for m, _, _ in part], [q for _, q, _ in part], born)
                    self._pending[shard].append(_Pending(batch, [f for _, _, f in part],
                                                         [(m.topic, q) for m, q, _ in part]))
            self._cv.notify_all()
        return futures

    def _take(self, shard: int) -> list[_Pending]:
        queue = self._pending[shard]
        items, count = [], 0
        while queue and count + len(queue[0].futures) <= self.config.batch_max_messages:
            p = queue.popleft()
            items.append(p)
            count += len(p.futures)
        if not items and queue:
            items.append(queue.popleft())
        return items

    def _start(self, shard: int, items: list[_Pending], request, sequence: int,
               attempt: int) -> None:
        handle = self._mq.shard_handle(shard)
        ref = handle.send.remote(request, self.producer_id, sequence)
        self._inflight[shard] = _InFlight(ref, items, request, sequence, attempt,
                                          time.monotonic() + self.config.send_timeout_ms / 1000)

    def _run(self) -> None:
        linger = self.config.linger_ms / 1000.0
        while True:
            with self._cv:
                now = time.monotonic()
                ready = [s for s, q in self._pending.items()
                         if q and s not in self._inflight and s not in self._retrying]
                due = [s for s, (_, when) in self._retrying.items() if when <= now]
                if not ready and not self._inflight and not due:
                    if self._closed and not any(self._pending.values()) and not self._retrying:
                        return
                    self._cv.wait(0.05 if not self._retrying else
                                  max(0.001, min(w for _, w in self._retrying.values()) - now))
                    continue
                starts = []
                for shard in ready:
                    items = self._take(shard)
                    self._seq[shard] += 1
                    starts.append((shard, items, self._seq[shard]))
            for shard in due:
                f, _ = self._retrying.pop(shard)
                try:
                    self._start(shard, f.items, f.request, f.sequence, f.attempt + 1)
                except Exception as err:
                    self._fail(f.items, err)
            for shard, items, seq in starts:
                request = merge_batches([p.batch for p in items])
                try:
                    self._start(shard, items, request, seq, 0)
                except Exception as err:  # no handle: fail these callers
                    self._fail(items, err)
            if not self._inflight:
                continue
            refs = [f.ref for f in self._inflight.values()]
            done, _ = ray.wait(refs, num_returns=1, timeout=max(linger, 0.001))
            if done:
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            done_set = set(done)
            now = time.monotonic()
            for shard, f in list(self._inflight.items()):
                if f.ref in done_set:
                    del self._inflight[shard]
                    try:
                        result = rpc.get(f.ref, 0)
                    except RayMQError as err:
                        self._retry_or_fail(shard, f, err)
                        continue
                    except Exception as err:  # a bug in the shard: surface it
                        self._fail(f.items, err)
                        continue
                    self._complete(shard, f, result)
                elif now > f.deadline:
                    del self._inflight[shard]
                    self._retry_or_fail(shard, f, RequestTimeoutError(
                        f"shard-{shard} did not answer within {self.config.send_timeout_ms} ms"))

    def _retry_or_fail(self, shard: int, f: _InFlight, err: RayMQError) -> None:
        if err.retriable and f.attempt < self.config.send_retries and not (
                self._closed and f.attempt >= 2):
            backoff = min(self.config.retry_backoff_ms * (2 ** f.attempt),
                          self.config.retry_backoff_max_ms) / 1000.0
            self.retries += 1
            log.warning("send to shard-%d failed (%s); retry %d in %.2f s", shard, err,
                        f.attempt + 1, backoff)
            self._retrying[shard] = (f, time.monotonic() + backoff)
            return
        self._fail(f.items, err)

    def _complete(self, shard: int, f: _InFlight, result: dict) -> None:
        status = SendStatus(result["status"])
        phys, qoffs = result["phys"], result["queue_offsets"]
        i = 0
        for p in f.items:
            for fut, (topic, qid) in zip(p.futures, p.topic_qids):
                if i < len(phys):
                    res = SendResult(status, make_msg_id(shard, phys[i]), qid, qoffs[i], topic)
                else:  # a duplicate whose offsets the shard no longer remembers
                    res = SendResult(status, "", qid, -1, topic)
                fut.set_result(res)
                i += 1

    @staticmethod
    def _fail(items: list[_Pending], err: BaseException) -> None:
        for p in items:
            for fut in p.futures:
                if not fut.done():
                    fut.set_exception(err)
