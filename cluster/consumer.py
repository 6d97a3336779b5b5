"""Consumer: a member's group membership and queue leases, pull with prefetch, commits,
and push-style handling with retries (``run``); its time comes from an injected clock.

Queues of the subscribed topics (and of the group's retry topic) are shared
among the live members of the group by the controller; a member owns a queue
only while its lease lasts, and releases it (after committing) when the
controller moves it elsewhere.

``poll`` returns messages of the owned queues; ``commit`` makes the position
after everything polled so far durable at the shards.  ``run(handler)`` is
push-style: a handler that raises (or returns False) sends the message to the
group's retry topic with a growing delay, and after ``max_reconsume``
failures to the group's dead-letter topic.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from raymq import rpc
from raymq.clock import client_clock
from raymq.message import ISOLATIONS, MessageExt, check_group, messages_ext, retry_topic
from raymq.storage.clock import Clock
from raymq.storage.errors import InvalidMessageError, OffsetOutOfRangeError, RayMQError

log = logging.getLogger("raymq.consumer")



@dataclass
class _Queue:
    shard: int
    fetch: int      # next offset to pull
    position: int   # next offset after what poll() returned
    committed: int  # last committed offset


class Consumer:
    def __init__(self, mq, group: str, topics: list[str], *, isolation: str = "read_committed",
                 tags: dict[str, list[str]] | list[str] | str | None = None,
                 ordered: bool = False, start_from: str = "earliest",
                 clock: Clock | None = None, read_only: bool = False,
                 auto_commit: bool = True, auto_offset_reset: str = "earliest"):
        """``isolation``: ``read_committed`` (the default) reads each queue up to its last
        stable offset and never an aborted Kafka-style transaction's message;
        ``read_uncommitted`` reads all that is written (RocketMQ-style transactional
        messages are only ever visible once committed, in both).
        ``read_only``: a peek -- nothing is ever committed (``commit`` does nothing,
        neither does ``close`` or a queue moving to another member).
        ``auto_commit=False`` (Kafka's ``enable.auto.commit=false``): the consumer never
        commits by itself -- not on ``close``, not when a queue moves to another member,
        not after ``run``'s handlers; offsets move only by ``commit()`` or by a
        transactional producer's ``send_offsets``.
        ``auto_offset_reset``: where a queue goes on when the group's offset fell below its
        log start (the messages there aged out): ``earliest`` (the log start; the default),
        ``latest`` (its end), or ``error`` (``poll`` raises ``OffsetOutOfRangeError`` naming
        queue, offset and log start)."""
        check_group(group)
        if auto_offset_reset not in ("earliest", "latest", "error"):
            raise InvalidMessageError("auto_offset_reset must be 'earliest', 'latest' or "
                                      f"'error', got {auto_offset_reset!r}")
        self.auto_offset_reset = auto_offset_reset
        self._failure: RayMQError | None = None  # (an ``error`` reset, raised by poll)
        if isolation not in ISOLATIONS:
            raise InvalidMessageError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
        if start_from not in ("earliest", "latest"):
            raise InvalidMessageError("start_from must be 'earliest' or 'latest'")
        self._mq = mq
        self.config = mq.config
        clock = client_clock(clock)
        self._monotonic_s = clock.monotonic_s
        self._sleep_s = clock.sleep_s
        self.group = group
        self.read_only = read_only
        self.auto_commit = auto_commit
        self.isolation = isolation
        self.ordered = ordered
        self.start_from = start_from
        topics = [topics] if isinstance(topics, str) else list(topics)
        routes = mq.routes_for(set(topics))  # unknown topics fail here, clearly
        self.topics = topics
        self._routes = routes
        mq.ensure_group_topics(group)
        self._retry_topic = retry_topic(group)
        self._routes.update(mq.routes_for({self._retry_topic}))
        self._tags = self._tag_filter(tags)
        self.member_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.RLock()
        self._pulls_done = threading.Condition(self._lock)  # a pull in flight finished
        self._queues: dict[tuple[str, int], _Queue] = {}
        # fetched, not yet polled: chunks of one queue's messages, in offset order
        self._buffer: deque[tuple[tuple[str, int], list[MessageExt]]] = deque()
        self._buffered = 0
        self._inflight: dict[int, object] = {}
        self._inflight_req: dict[int, list[tuple[str, int, int, int]]] = {}
        self._stop = threading.Event()
        self._closed = False
        self.generation = 0
        self._lease_from_s = self._monotonic_s()  # when the last heartbeat through was sent
        self._processing: dict[tuple[str, int], int] = {}  # queue -> first offset in a handler
        self._handled = threading.Condition(self._lock)  # a run() batch is done
        from raymq.metrics import RayMetrics
        self.metrics = RayMetrics(client="consumer", group=group, clock=clock)
        self.heartbeat()  # own queues before the first poll
        self._hb = threading.Thread(target=self._heartbeat_loop, name="raymq-consumer-hb",
                                    daemon=True)
        self._hb.start()

    def _tag_filter(self, tags) -> dict[str, list[str]] | None:
        if tags is None:
            return None
        if isinstance(tags, str):
            tags = [t.strip() for t in tags.split("||") if t.strip() and t.strip() != "*"]
            if not tags:
                return None
        if isinstance(tags, list):
            return {t: list(tags) for t in self.topics}
        return {t: list(v) for t, v in tags.items()}

    # ---------------------------------------------------------- membership
    def assignment(self) -> list[tuple[str, int]]:
        with self._lock:
            return sorted(self._queues)

    def heartbeat(self) -> None:
        """One heartbeat: take granted queues, release moved ones (committing first)."""
        self._fence_if_lease_lost()
        sent_s = self._monotonic_s()
        with self._lock:
            held = sorted(self._queues)
        res = self._controller().call("heartbeat", self.group, self.member_id,
                                      self.topics + [self._retry_topic], held,
                                      socket.gethostname(), timeout_s=30)
        self._lease_from_s = sent_s  # the controller saw this member alive no earlier than this
        release = [tuple(q) for q in res["release"]]
        granted = [tuple(q) for q in res["granted"]]
        if release:
            self._release(release)
        with self._lock:
            new = [q for q in granted if q not in self._queues]
        if new:
            self._acquire(new)
        self.generation = res["generation"]

    def _controller(self) -> rpc.ControllerClient:
        """Calls to the controller of the cluster this consumer is on now."""
        return rpc.ControllerClient(self._mq.controller)

    def _acquire(self, queues: list[tuple[str, int]]) -> None:
        grown = {t for t, q in queues if q >= len(self._routes[t])}
        if grown:  # (a topic grown since this consumer learned its routes)
            self._routes.update(self._mq.refresh_routes(grown))
        by_shard = defaultdict(list)
        for topic, qid in queues:
            by_shard[self._routes[topic][qid]].append((topic, qid))
        for shard, qs in by_shard.items():
            offsets = self._mq.transport.call(shard, "get_offsets", self.group, qs,
                                              timeout_s=30)
            ends, starts = None, {}
            for q in qs:
                off = offsets[q]
                if off < 0 and self.start_from == "latest" and not q[0].startswith("%"):
                    if ends is None:
                        ends = self._mq.transport.call(shard, "pull",
                                                       [(t, i, 0, 0) for t, i in qs], 0,
                                                       None, self.group, self.isolation,
                                                       timeout_s=30)
                    off = starts[q] = next(e[4] for e in ends if (e[0], e[1]) == q)
                off = max(off, 0)
                with self._lock:
                    self._queues[q] = _Queue(shard, off, off, off)
            if starts:  # the group's start is recorded at once: whoever owns the queue next
                # goes on from here, not from a later end (what came between would be lost)
                self._mq.transport.call(shard, "commit_offsets", self.group, starts,
                                        timeout_s=30)
            log.info("consumer %s of %s: took %s", self.member_id, self.group, qs)

    def _release(self, queues: list[tuple[str, int]]) -> None:
        # a batch in run()'s handlers finishes first: its queue's next owner must not start
        # while this one still works on it (ordered mode), and it commits what was handled.
        # Bounded: past half a session the lease is at risk, and the release goes on.  The
        # queues go in the same step, so run() takes nothing more of them meanwhile (a
        # failed commit then means redelivery, never loss).
        with self._handled:
            self._handled.wait_for(lambda: not any(q in self._processing for q in queues),
                                   self.config.session_timeout_ms / 2000)
            points = {} if self._fence_if_lease_lost() or not self.auto_commit \
                else self._commit_points(queues)
            for q in queues:
                self._queues.pop(q, None)
            self._drop_buffered(set(queues))
        self._send_commits(points)
        log.info("consumer %s of %s: released %s", self.member_id, self.group, queues)

    def _fence_if_lease_lost(self) -> bool:
        """Give up every queue, without committing, once no heartbeat got through for a
        session: by then the controller may have handed the queues to another member.

        Measured from when the last successful heartbeat was *sent*, so this member
        stops no later than the controller expires it (Kafka's consumer does the same
        when it cannot reach its coordinator).  The next heartbeat that gets through
        takes queues again from their committed offsets.
        """
        silent_s = self._monotonic_s() - self._lease_from_s
        if silent_s * 1000 <= self.config.session_timeout_ms:
            return False
        with self._lock:
            if not self._queues:
                return True
            dropped = sorted(self._queues)
            self._queues.clear()
            self._processing.clear()
            self._drop_buffered(set(dropped))
        log.warning("consumer %s of %s: no heartbeat through for %.1f s (session %d ms): gave "
                    "up %s without committing", self.member_id, self.group, silent_s,
                    self.config.session_timeout_ms, dropped)
        self.metrics.inc("leases_lost")
        return True

    def _drop_buffered(self, queues: set) -> None:
        kept = deque((k, c) for k, c in self._buffer if k not in queues)
        self._buffered = sum(len(c) for _, c in kept)
        self._buffer = kept

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_ms / 1000.0):
            try:
                self.heartbeat()
            except Exception as err:  # the next heartbeat retries
                log.warning("consumer %s: heartbeat failed: %s", self.member_id, err)

    # ----------------------------------------------------------------- pull
    def poll(self, max_messages: int = 100, timeout_s: float = 1.0) -> list[MessageExt]:
        """Up to ``max_messages`` messages of the owned queues, waiting up to ``timeout_s``.

        Pulls run ahead of the application (prefetch): while the buffer runs
        low, the next pulls are already on their way.
        """
        return self._poll(max_messages, timeout_s, handling=False)

    def _poll(self, max_messages: int, timeout_s: float, *, handling: bool) -> list[MessageExt]:
        """``poll``; with ``handling`` (``run``) the messages taken are marked as in a
        handler in the same step, so that no release can pass them in between."""
        deadline_s = self._monotonic_s() + timeout_s
        while True:
            self._fence_if_lease_lost()
            failure, self._failure = self._failure, None
            if failure is not None:
                raise failure
            with self._lock:
                if self._buffer:
                    out = []
                    while self._buffer and len(out) < max_messages:
                        key, chunk = self._buffer.popleft()
                        room = max_messages - len(out)
                        if len(chunk) > room:
                            self._buffer.appendleft((key, chunk[room:]))
                            chunk = chunk[:room]
                        out += chunk
                        q = self._queues.get(key)
                        if q is not None:  # a chunk is in offset order: its last is the newest
                            q.position = max(q.position, chunk[-1].source_offset + 1)
                            if handling:
                                self._processing[key] = min(
                                    self._processing.get(key, chunk[0].source_offset),
                                    chunk[0].source_offset)
                    self._buffered -= len(out)
                    low = self._buffered < self.config.pull_batch_messages
                else:
                    out = None
            if out is not None:
                if low:
                    self._start_pulls(self.config.pull_wait_ms)
                    self._collect(0)
                return out
            remaining_s = deadline_s - self._monotonic_s()
            if remaining_s <= 0:
                return []
            self._fetch(min(remaining_s, self.config.pull_wait_ms / 1000.0))

    def _start_pulls(self, wait_ms: int) -> bool:
        """Start a pull on every shard of the owned queues that has none in flight."""
        with self._lock:
            by_shard = defaultdict(list)
            for (topic, qid), q in self._queues.items():
                by_shard[q.shard].append((topic, qid, q.fetch, self.config.pull_batch_messages))
            for shard, reqs in by_shard.items():
                if shard not in self._inflight:
                    call = self._mq.transport.submit(
                        shard, "pull", (reqs, int(wait_ms), self._tags, self.group,
                                        self.isolation, "messages", self.auto_offset_reset),
                        timeout_s=wait_ms / 1000 + self.config.send_timeout_ms / 1000)
                    self._inflight[shard] = call
                    self._inflight_req[shard] = reqs
                    call.add_done_callback(self._pull_finished)
            return bool(self._inflight)

    def _collect(self, timeout_s: float) -> None:
        """Take in the pulls that finished (waiting up to ``timeout_s`` for the first)."""
        with self._pulls_done:
            if not self._wait_pulls(any, timeout_s):
                return
            done = [(shard, c) for shard, c in self._inflight.items() if c.done()]
        for shard, call in done:
            with self._lock:
                if self._inflight.get(shard) is not call:
                    continue
                self._inflight.pop(shard, None)
                reqs = self._inflight_req.pop(shard, [])
            try:
                results = call.result()
            except OffsetOutOfRangeError as err:
                self._failure = err  # (auto_offset_reset 'error': poll says so)
                continue
            except RayMQError as err:
                log.warning("consumer %s: pull from shard-%d failed: %s", self.member_id, shard, err)
                self._stop.wait(0.1)
                continue
            self._take_results(shard, reqs, results)

    def _wait_pulls(self, how: Callable, timeout_s: float) -> bool:
        """Wait until ``how`` (``any`` or ``all``) of the pulls in flight are done; whether
        that happened (no pull in flight: only ``all`` holds).  Under ``_pulls_done``."""
        deadline_s = self._monotonic_s() + timeout_s
        while not (self._inflight and how(c.done() for c in self._inflight.values())):
            remaining_s = deadline_s - self._monotonic_s()
            if not self._inflight:
                return how is all
            if remaining_s <= 0:
                return False
            self._pulls_done.wait(remaining_s)
        return True

    def _pull_finished(self, _call) -> None:
        with self._pulls_done:
            self._pulls_done.notify_all()

    def _fetch(self, wait_s: float) -> None:
        """Start pulls for shards with none in flight; take in the results that are ready."""
        if not self._start_pulls(int(wait_s * 1000)):
            self._sleep_s(min(wait_s, 0.05))
            return
        self._collect(wait_s + 5.0)

    def _take_results(self, shard: int, reqs, results) -> None:
        sent = {(t, q): off for t, q, off, _ in reqs}
        with self._lock:
            for topic, qid, batch, next_offset, _end in results:
                q = self._queues.get((topic, qid))
                if q is None or q.shard != shard or q.fetch != sent.get((topic, qid)):
                    continue  # released or repositioned meanwhile
                if len(batch):
                    self._buffer.append(((topic, qid), messages_ext(shard, batch)))
                    self._buffered += len(batch)
                self.metrics.inc("messages_consumed", len(batch))
                if not len(batch) and q.position == q.fetch:
                    # past filtered entries, or back to the end from an offset past it (a
                    # seek, or a shard that lost its tail): the position follows either way
                    q.position = next_offset
                q.fetch = next_offset

    # --------------------------------------------------------------- commit
    def commit(self) -> None:
        """Commit the position after everything ``poll`` returned so far."""
        with self._lock:
            queues = list(self._queues)
        self._commit_queues(queues)

    def commit_async(self) -> None:
        """Like ``commit`` without waiting (Kafka's commitAsync): failures are logged and
        the next commit covers them."""
        self._commit_queues(list(self.assignment()), wait=False)

    def _commit_queues(self, queues, *, wait: bool = True) -> None:
        if self._fence_if_lease_lost():
            return  # the queues may be another member's now: never commit for them
        self._send_commits(self._commit_points(queues), wait=wait)

    def _commit_points(self, queues) -> dict[int, dict]:
        """What to commit for these queues, by shard: {shard: {queue: offset}}."""
        by_shard = defaultdict(dict)
        with self._lock:
            for key in queues:
                q = self._queues.get(key)
                if q is None:
                    continue
                # in push mode, never past a message a handler is still working on
                upto = min(q.position, self._processing.get(key, q.position))
                if upto != q.committed:
                    by_shard[q.shard][key] = upto
        return by_shard

    def _send_commits(self, by_shard: dict[int, dict], *, wait: bool = True) -> None:
        if self.read_only:
            return  # a peek: nothing it read counts as consumed
        for shard, offsets in by_shard.items():
            if wait:
                self._mq.transport.call(shard, "commit_offsets", self.group, offsets,
                                        timeout_s=30)
                self._committed(offsets)
            else:
                call = self._mq.transport.submit(shard, "commit_offsets", (self.group, offsets),
                                                 timeout_s=30)
                call.add_done_callback(lambda f, o=offsets: self._async_committed(f, o))

    def _committed(self, offsets: dict) -> None:
        with self._lock:
            for key, off in offsets.items():
                q = self._queues.get(key)
                if q is not None:
                    q.committed = off

    def _async_committed(self, fut, offsets: dict) -> None:
        try:
            fut.result()
        except Exception as err:  # the next commit covers it
            log.warning("consumer %s: async commit failed: %s", self.member_id, err)
            return
        self._committed(offsets)

    def seek(self, topic: str, queue_id: int, offset: int) -> None:
        with self._lock:
            q = self._queues.get((topic, queue_id))
            if q is None:
                raise RayMQError(f"{topic}/{queue_id} is not owned by this consumer")
            q.fetch = q.position = offset
            self._drop_buffered({(topic, queue_id)})

    def seek_to_time(self, ts_ms: int) -> dict[tuple[str, int], int]:
        """Go on, in every queue of its topics this consumer owns, from the first message
        stored at or after ``ts_ms`` (ms since the epoch; Kafka's ``offsetsForTimes`` then
        ``seek``): the log start when that aged out, the end when nothing is that recent.
        (The group's retry queue is left as it is.)  The offsets it moved to."""
        with self._lock:
            queues = [q for q in self._queues if q[0] in self.topics]
        found = self._mq.admin.offsets_for_times({q: int(ts_ms) for q in queues}) \
            if queues else {}
        for (topic, qid), offset in found.items():
            self.seek(topic, qid, offset)
        return found

    # ------------------------------------------------------------- push mode
    def nack(self, msg: MessageExt, reason: str = "", *,
             retry_after_ms: int | None = None) -> dict:
        """Give a message back: redelivered later through the retry topic (after the next
        delay level, or after ``retry_after_ms``: any time up to ``max_delay_ms``), or
        dead-lettered once ``max_reconsume`` is reached."""
        return self._mq.shard(msg.shard).call("send_back", self.group, msg.phys,
                                              reason=reason, retry_after_ms=retry_after_ms,
                                              timeout_s=30)

    def run(self, handler: Callable[[MessageExt], object], *, threads: int = 4,
            batch: int = 64, idle_s: float = 0.5) -> None:
        """Consume until ``stop()``: ``handler(msg)`` per message, concurrently.

        Blocks the calling thread until another thread calls ``stop()`` (or
        ``close()``): run it in a thread of its own when the caller has more to do.

        A handler that raises or returns False fails the message (retry topic,
        then dead letters).  Offsets are committed after each polled batch is
        done.  In ordered mode a queue's messages are handled one at a time,
        in order, and a failing message is retried in place.
        """
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="raymq-handler")
        held_back = 0  # batches in a row with a message that could not be sent back
        try:
            while not self._stop.is_set():
                if held_back:  # its shard may stay unable for a while: do not spin on it
                    self._stop.wait(min(5.0, 0.1 * 2 ** (held_back - 1)))
                msgs = self._poll(batch, idle_s, handling=True)
                if not msgs:
                    continue
                try:
                    if self.ordered:
                        by_queue = defaultdict(list)
                        for m in msgs:
                            by_queue[(m.source_topic, m.source_queue)].append(m)
                        list(pool.map(lambda ms: self._run_ordered(handler, ms),
                                      by_queue.values()))
                    else:
                        outcomes = list(pool.map(lambda m: _handle(handler, m), msgs))
                        again = self._give_back(
                            [m for m, (ok, _r) in zip(msgs, outcomes) if not ok],
                            [r for ok, r in outcomes if not ok])
                        held_back = held_back + 1 if again else 0
                finally:
                    with self._lock:
                        self._processing.clear()
                        self._handled.notify_all()
                if self.auto_commit:
                    self.commit()
        finally:
            pool.shutdown(wait=True)

    def _give_back(self, failed: list[MessageExt], reasons: list[str]) -> bool:
        """Send failed messages to the retry topic.  One that cannot be sent back (its
        shard unavailable) must not be passed by the commit: its queue goes back to it,
        and it is handled again (with what followed it: at least once), after a pause
        that grows while it keeps happening.  Whether any queue went back."""
        again: dict[tuple[str, int], MessageExt] = {}  # queue -> its first message to redo
        for m, reason in zip(failed, reasons):
            key = (m.source_topic, m.source_queue)
            if key in again:  # its queue goes back already: so does this one
                continue
            try:
                self.nack(m, reason)
            except RayMQError as err:
                log.warning("consumer %s: %s could not be sent back for a retry (%s); "
                            "it is handled again", self.member_id, m.msg_id, err)
                again[key] = m
        for m in again.values():
            self._seek_back(m)
        return bool(again)

    def _run_ordered(self, handler, msgs: list[MessageExt]) -> None:
        for m in msgs:
            for attempt in range(self.config.max_reconsume + 1):
                ok, reason = _handle(handler, m)
                if ok:
                    break
                if self._stop.is_set():  # stopping on a failure: this message comes again
                    self._seek_back(m)
                    return
                m.reconsume_count += 1
                self._sleep_s(min(1.0, 0.05 * (2 ** attempt)))
            else:
                try:
                    self._mq.shard(m.shard).call("send_back", self.group, m.phys,
                                                 reason=f"ordered: {reason}",
                                                 dead_letter=True, timeout_s=30)
                except RayMQError as err:  # not dead-lettered: it must come again
                    log.warning("consumer %s: %s could not be dead-lettered (%s); it is "
                                "handled again", self.member_id, m.msg_id, err)
                    self._seek_back(m)
                    return

    def _seek_back(self, m: MessageExt) -> None:
        try:
            self.seek(m.source_topic, m.source_queue, m.source_offset)
        except RayMQError:  # released meanwhile: its committed offset is before it
            pass

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Commit (unless read-only or ``auto_commit=False``), leave the group (its queues
        move to the other members)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._hb.join()
        with self._pulls_done:  # long polls end within pull_wait_ms
            self._wait_pulls(all, self.config.pull_wait_ms / 1000 + 5.0)
        try:
            if self.auto_commit:
                self.commit()
        finally:
            self._controller().call("leave", self.group, self.member_id, timeout_s=30)
            self.metrics.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _handle(handler, m: MessageExt) -> tuple[bool, str]:
    try:
        result = handler(m)
    except Exception as err:  # the handler's failure is the message's failure
        return False, f"{type(err).__name__}: {err}"
    return (result is not False), ("handler returned False" if result is False else "")
