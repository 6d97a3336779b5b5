"""Kafka-style transactional producer (seed 002): messages to any topics and queues, and
a consumer group's offsets, committed or aborted as one.

    kp = mq.transactional_producer("income-job")   # (producer id, epoch) from its coordinator
    with kp.transaction():                          # begin; commit, or abort on an exception
        kp.send(Message("income", b"..."))
        kp.send_offsets({("orders", 0): 124}, group="income-job")

The first write to a queue (and the first offsets of a group on a shard) asks the
transactional id's coordinator to add it to the transaction; the coordinator registers
it on the shard before answering, and the shard refuses a write to a queue not
registered for this producer's current epoch (KIP-890).  A write travels with the add
of its queue: the shard holds it until the registration lands (``wait_ms``).  Writes
to a shard carry a sequence per (producer, epoch, shard): a retry is stored once, a gap
is refused.
A ``send_batch`` writes to all its shards at once (one request each).
``commit`` asks the coordinator to commit (PREPARE_COMMIT logged, markers written in
every queue, COMPLETE_COMMIT logged); the producer's epoch moves on with every commit
and abort.  A newer instance with the same transactional id fences this one: its
calls raise ``ProducerFencedError`` and its open transaction is aborted.
``TransactionAbortedError`` from ``commit`` means the transaction was aborted before
it (its timeout passed, an operator aborted it); the producer can begin the next one.
Messages read with ``read_committed`` appear when the commit marker is written.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict

import numpy as np

from raymq.actors.kafka_tx.coordinator import check_transactional_id, coordinator_for
from raymq.actors.kafka_tx.state import epoch_exhausted
from raymq.message import (Message, SendResult, SendStatus, assign_queues, check_group,
                           columns_to_batch, validate_messages)
from raymq.producer import PartResults, SendResults
from raymq.storage.errors import (InvalidMessageError, InvalidTxnStateError,
                                  ProducerFencedError, RayMQError, TransactionAbortableError,
                                  TransactionAbortedError)

log = logging.getLogger("raymq.kafka_producer")


class TransactionalProducer:
    def __init__(self, mq, transactional_id: str, *, timeout_ms: int | None = None):
        check_transactional_id(transactional_id)
        self._mq = mq
        self.config = mq.config
        self.transactional_id = transactional_id
        self.timeout_ms = timeout_ms
        self._coordinator_index = coordinator_for(transactional_id,
                                                  self.config.num_coordinators)
        self._lock = threading.RLock()
        self._state = "ready"      # ready | in_transaction | fenced | closed
        self._queues: set[tuple[int, str, int]] = set()
        self._groups: set[tuple[int, str]] = set()
        self._seq: dict[int, int] = defaultdict(int)
        # shards written to without an fsync: while a transaction has one shard, its
        # writes are answered once written, and its commit (one fsync there) checks they
        # are all there (``raymq.actors.kafka_tx.fast_commit``)
        self._lazy: set[int] = set()
        # why the open transaction can only be aborted (None: it can commit): a write
        # failed after it was sent, so whether its shard stored it is unknown, and its
        # sequence may not be given to other messages (Kafka's abortable error)
        self._unknown: str | None = None
        self._reinit = False  # an end failed: init_producer again before the next begin
        # (messages, their columns, future) sent with send_async, not written yet
        self._pending: list[tuple] = []
        self._pending_n = 0
        #: transactions committed as one request (``commit``), for observability
        self.one_request_commits = 0
        self._rr: dict[str, int] = defaultdict(int)
        self.producer_id, self.epoch = self._ask("init_producer", transactional_id, timeout_ms)

    # ------------------------------------------------------------ the API
    def begin(self) -> None:
        with self._lock:
            self._usable()
            if self._state == "in_transaction":
                raise InvalidTxnStateError(f"{self.transactional_id}: a transaction is "
                                           f"already begun (commit or abort it first)")
            if self._reinit:
                self.producer_id, self.epoch = self._ask("init_producer",
                                                         self.transactional_id,
                                                         self.timeout_ms)
                self._reinit = False
            self._state = "in_transaction"

    def send(self, msg: Message) -> SendResult:
        """Write one message in the transaction; its result once the shard stored it."""
        return self.send_batch([msg])[0]

    def send_batch(self, msgs: list[Message]) -> SendResults:
        """Write messages in the transaction (one request per shard); their results, in
        order (a sequence of ``SendResult``, as the plain producer's ``send_batch``).
        Messages sent with ``send_async`` before them are written first."""
        if not msgs:
            return SendResults([], 0)
        cols = self._validated(msgs)
        with self._lock:
            self._in_transaction(writing=True)
            self._flush()
            return self._write_routed(cols, *self._route(cols))

    def send_async(self, msg: Message) -> SendFuture:
        """Kafka's ``send``: the message is checked now and written with the transaction's
        next request -- at the latest its commit, which writes a transaction of one
        request to one shard together with its commit marker (one put, one fsync).
        ``result()`` of the future written (writing what waits first)."""
        return self.send_batch_async([msg], one=True)

    def send_batch_async(self, msgs: list[Message], *, one: bool = False) -> SendFuture:
        """``send_async`` for many: the future's ``result()`` is their ``SendResult``s."""
        cols = self._validated(msgs)
        with self._lock:
            self._in_transaction(writing=True)
            future = SendFuture(self, one)
            if not cols.n:
                future.set(SendResults([], 0))
                return future
            self._pending.append((msgs, cols, future))
            self._pending_n += cols.n
            if self._pending_n >= self.config.batch_max_messages:
                self._flush()
            return future

    def flush(self) -> None:
        """Write every message sent with ``send_async`` and not written yet."""
        with self._lock:
            self._flush()

    def _validated(self, msgs: list[Message]):
        cols = validate_messages(msgs, self.config.max_message_bytes,
                                 len(self.config.delay_levels_ms))
        if cols.has("delay_level", 0) or cols.has("deliver_at_ms") \
                or cols.has("deliver_after_ms"):
            raise InvalidMessageError("a delayed message cannot be part of a Kafka-style "
                                      "transaction")
        return cols

    def _route(self, cols) -> tuple:
        """(queue ids, shards, the (shard, topic, queue) set) of the messages ``cols``."""
        topics = set(cols.topic)
        routes = self._mq.routes_for(topics)
        qids, shards = assign_queues(cols, routes, self._next_rr,
                                     self.config.batch_max_messages)
        if len(topics) == 1:  # (the usual batch: its queues without a pass per message)
            [topic] = topics
            queues = {(routes[topic][q], topic, q) for q in (
                set(qids.tolist()) if len(qids) <= 64 else np.unique(qids).tolist())}
        else:
            queues = set(zip(shards.tolist(), cols.topic, qids.tolist()))
        return qids, shards, queues

    def _flush(self, *, committing: bool = False) -> bool:
        """(under the lock) Write what ``send_async`` left waiting, resolving its futures;
        ``committing``: as a transaction of one request when it can be one (nothing
        written before, one shard).  Whether it committed so."""
        if not self._pending:
            return False
        pending, self._pending, self._pending_n = self._pending, [], 0
        cols = pending[0][1] if len(pending) == 1 else \
            self._validated([m for msgs, _c, _f in pending for m in msgs])
        routed = self._route(cols)
        one = committing and not self._queues and not self._groups \
            and self._unknown is None and not epoch_exhausted(self.epoch) \
            and len({s for s, _t, _q in routed[2]}) == 1
        try:
            results = self._commit_one(cols, *routed) if one \
                else self._write_routed(cols, *routed)
        except BaseException as err:
            for _m, _c, future in pending:
                future.set(None, err)
            raise
        self.one_request_commits += one
        start = 0
        for msgs, _c, future in pending:
            future.set(results if len(pending) == 1 else results[start:start + len(msgs)])
            start += len(msgs)
        return one

    def _commit_one(self, cols, qids, shards, queues) -> SendResults:
        """The transaction as one request to its one shard, through the coordinator
        (``commit_batch``); the transaction ends here (see ``_end``)."""
        shard = int(shards[0])
        batch = columns_to_batch(cols, list(range(cols.n)), qids.tolist(),
                                 int(time.time() * 1000))
        try:
            self.producer_id, self.epoch, reply = self._ask(
                "commit_batch", self.transactional_id, self.producer_id, self.epoch, shard,
                batch, self._seq[shard] + 1)
        except BaseException as err:
            self._ended(err)
            raise
        self._ended(None)
        return SendResults([(_part(reply, shard, batch.topics, qids.tolist()),
                             list(range(cols.n)))], cols.n)

    def _write_routed(self, cols, qids, shards, queues) -> SendResults:
        """(under the lock) The writes of ``cols`` routed, to every shard at once."""
        # the coordinator adds the new queues while the writes travel: a shard holds a
        # write to a queue not registered yet until the coordinator registers it there
        new = queues - self._queues
        asked = self._begin_ask("add_to_transaction", self.transactional_id,
                                self.producer_id, self.epoch, sorted(new), []) \
            if new else None
        waiting = {s for s, _t, _q in new}
        wait_ms = self.config.send_timeout_ms // 2
        lazy = len({s for s, _t, _q in self._queues | queues}
                   | {s for s, _g in self._groups}) == 1
        born_ms = int(time.time() * 1000)
        parts = []
        for shard in np.unique(shards).tolist():  # to every shard at once
            where = np.flatnonzero(shards == shard)
            idx, q = where.tolist(), qids[where].tolist()
            batch = columns_to_batch(cols, idx, q, born_ms)
            seq = self._seq[shard] + 1
            args = (batch, self.producer_id, self.epoch, seq,
                    wait_ms if shard in waiting else 0, not lazy)
            if lazy:
                self._lazy.add(shard)
            parts.append([shard, idx, q, seq, args, self._begin_send(shard, args)])
        if asked is not None:
            self._registered(asked, new, parts, waiting)
        results = []
        for k, (shard, idx, q, seq, args, call) in enumerate(parts):
            try:
                try:
                    reply = call.result()
                except RayMQError as err:
                    # (refused unregistered: its registration came later than it waited)
                    if not err.retriable and not (shard in waiting and isinstance(
                            err, InvalidTxnStateError)):
                        raise
                    reply = self._retrying(
                        lambda: self._begin_send(shard, args).result())
            except BaseException as err:
                if isinstance(err, ProducerFencedError):
                    self._state = "fenced"
                self._failed(err)
                self._settle(parts[k + 1:])
                raise
            self._seq[shard] = seq
            results.append((_part(reply, shard, args[0].topics, q), idx))
        return SendResults(results, cols.n)

    def send_offsets(self, offsets: dict[tuple[str, int], int], group: str) -> None:
        """Commit ``group``'s next offsets to read with this transaction (Kafka's
        ``sendOffsetsToTransaction``): ``{(topic, queue id): offset}``, each a message's
        ``queue_offset + 1``."""
        check_group(group)
        with self._lock:
            self._in_transaction(writing=True)
            self._flush()
            routes = self._mq.routes_for({t for t, _q in offsets})
            by_shard: dict[int, dict] = defaultdict(dict)
            for (topic, qid), off in offsets.items():
                if not 0 <= qid < len(routes[topic]):
                    raise InvalidMessageError(f"{topic} has no queue {qid}")
                by_shard[routes[topic][qid]][(topic, qid)] = off
            if not self._offsets_with_add(group, by_shard):
                # (the add or a write failed: in turn now, each retried while retriable)
                self._register(set(), {(s, group) for s in by_shard})
                for shard, values in by_shard.items():
                    try:
                        self._write(shard, "ktx_offsets", group, values)
                    except BaseException as err:
                        self._failed(err)
                        raise

    def _offsets_with_add(self, group: str, by_shard: dict) -> bool:
        """The offsets to every shard at once, each travelling with the add of its group
        (a shard holds them until the coordinator registers the group there, as it holds
        a write); whether all were taken (False: nothing is known lost -- offsets are
        idempotent -- and the caller goes on in turn)."""
        new = {(s, group) for s in by_shard} - self._groups
        asked = self._begin_ask("add_to_transaction", self.transactional_id,
                                self.producer_id, self.epoch, [], sorted(new)) if new else None
        wait_ms = self.config.send_timeout_ms // 2
        calls = [self._mq.transport.begin(
            shard, "ktx_offsets", (self.producer_id, self.epoch, group, values,
                                   wait_ms if (shard, group) in new else 0),
            timeout_s=self.config.send_timeout_ms / 1000) for shard, values in by_shard.items()]
        ok, fenced = True, None
        for call in ([asked] if asked is not None else []) + calls:
            try:  # (every answer read: each call's connection goes back to its pool)
                call.result()
            except ProducerFencedError as err:
                fenced = fenced or err
            except RayMQError as err:
                log.info("%s: offsets with their add: %s; again in turn",
                         self.transactional_id, err)
                ok = False
        if fenced is not None:
            self._state = "fenced"
            raise fenced
        if ok:
            self._groups |= new
        return ok

    def commit(self) -> None:
        """Commit the transaction: every message and offset of it becomes visible at once.
        ``TransactionAbortedError`` if it was aborted first (nothing of it is visible).
        Messages waiting from ``send_async`` are written first -- all of them at once,
        with the commit, when the transaction has nothing else and one shard."""
        with self._lock:
            self._in_transaction()
            if self._flush(committing=True):
                return
        self._end("COMMIT")

    def abort(self) -> None:
        """Abort the transaction: nothing of it is ever visible to read_committed readers
        (messages still waiting from ``send_async`` are never written)."""
        self._end("ABORT")

    @contextlib.contextmanager
    def transaction(self):
        """``begin``; ``commit`` at the end of the block, ``abort`` on an exception."""
        self.begin()
        try:
            yield self
        except BaseException:
            with self._lock:
                if self._state == "in_transaction":
                    try:
                        self.abort()
                    except RayMQError as err:  # the block's error matters more
                        log.warning("%s: abort after an error failed: %s",
                                    self.transactional_id, err)
            raise
        self.commit()

    def close(self) -> None:
        """Abort an open transaction (best effort) and stop."""
        with self._lock:
            if self._state == "in_transaction":
                try:
                    self.abort()
                except RayMQError as err:  # its coordinator aborts it on timeout anyway
                    log.warning("%s: abort on close failed: %s", self.transactional_id, err)
            self._state = "closed"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ inside
    def _usable(self) -> None:
        if self._state == "fenced":
            raise ProducerFencedError(f"{self.transactional_id}: fenced by a newer instance "
                                      f"(producer {self.producer_id} epoch {self.epoch})")
        if self._state == "closed":
            raise RayMQError(f"{self.transactional_id}: producer closed")

    def _in_transaction(self, *, writing: bool = False) -> None:
        self._usable()
        if self._state != "in_transaction":
            raise InvalidTxnStateError(f"{self.transactional_id}: no transaction begun "
                                       f"(begin() or transaction() first)")
        if writing and self._unknown is not None:
            raise TransactionAbortableError(
                f"{self.transactional_id}: the transaction can only be aborted: a write's "
                f"outcome is unknown ({self._unknown})")

    def _next_rr(self, topic: str, count: int) -> int:
        first = self._rr[topic]
        self._rr[topic] += count
        return first

    def _registered(self, asked, new: set, parts: list, waiting: set) -> None:
        """Wait for the coordinator to add ``new`` queues (``asked``).  If it failed, the
        writes held for them (``parts`` to ``waiting`` shards) are given up, and begun
        again once a retried add answers (a write the shard stored anyway is stored
        once: its sequence); when the add fails for good, the other writes are waited
        for (so that the shards' sequences and this producer's stay in step) and the
        transaction can only be aborted (a held write may have been stored)."""
        try:
            asked.result()
        except BaseException as err:
            held = [part for part in parts if part[0] in waiting]
            for part in held:
                part[-1].abandon()
            if isinstance(err, ProducerFencedError):
                self._state = "fenced"
            try:
                if not isinstance(err, RayMQError) or not err.retriable:
                    raise
                log.warning("%s: adding queues to the transaction: %s; retrying",
                            self.transactional_id, err)
                self._register(new, set())
            except BaseException as final:  # a held write may be stored: abort only
                self._failed(final)
                self._settle([part for part in parts if part[0] not in waiting])
                raise
            for part in held:
                part[-1] = self._begin_send(part[0], part[4])
        self._queues |= new

    def _begin_send(self, shard: int, args: tuple):
        """A transactional write to a shard begun (its ``result()`` waits for the reply)."""
        return self._mq.transport.begin(shard, "ktx_send", args,
                                        timeout_s=self.config.send_timeout_ms / 1000)

    def _settle(self, parts: list) -> None:
        """Wait for the answers of writes begun (after another one failed): connections
        back, and the sequence of each shard that stored its write moves on, in step with
        the shard's."""
        for shard, _i, _q, seq, _a, call in parts:
            try:
                call.result()
                self._seq[shard] = seq
            except RayMQError as err:
                self._failed(err)

    def _failed(self, err: BaseException) -> None:
        """A write (or offsets) sent failed: the transaction can only be aborted now."""
        if self._unknown is None:
            self._unknown = f"{type(err).__name__}: {err}"

    def _register(self, queues: set, groups: set) -> None:
        new_q, new_g = queues - self._queues, groups - self._groups
        if new_q or new_g:
            self._ask("add_to_transaction", self.transactional_id, self.producer_id,
                      self.epoch, sorted(new_q), sorted(new_g))
            self._queues |= new_q
            self._groups |= new_g

    def _write(self, shard: int, method: str, *args):
        """A call to a shard with this producer's id and epoch, retried while retriable."""
        return self._retrying(lambda: self._mq.transport.call(
            shard, method, self.producer_id, self.epoch, *args,
            timeout_s=self.config.send_timeout_ms / 1000))

    def _begin_ask(self, method: str, *args):
        """A call to the coordinator begun (its ``result()`` waits for the answer)."""
        return self._mq.coordinator_transport.begin(self._coordinator_index, method, args,
                                                    timeout_s=60)

    def _ask(self, method: str, *args):
        """A call to the transactional id's coordinator (over its data channel)."""
        return self._retrying(lambda: self._mq.coordinator_transport.call(
            self._coordinator_index, method, *args, timeout_s=60))

    def _retrying(self, call):
        started, deadline, backoff = time.monotonic(), None, 0.0
        while True:
            try:
                return call()
            except ProducerFencedError:
                self._state = "fenced"
                raise
            except RayMQError as err:
                if deadline is None:  # (the settings read only once a call failed)
                    deadline = started + max(30.0, self.config.send_timeout_ms / 1000 *
                                             max(1, self.config.send_retries))
                    backoff = self.config.retry_backoff_ms / 1000
                if not err.retriable or time.monotonic() + backoff > deadline:
                    raise
                log.warning("%s: %s; retrying in %.2f s", self.transactional_id, err, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, self.config.retry_backoff_max_ms / 1000)

    def _end(self, outcome: str) -> None:
        with self._lock:
            self._in_transaction()
            unknown, asked = self._unknown, outcome if self._unknown is None else "ABORT"
            try:
                self.producer_id, self.epoch = self._ask(
                    "end_transaction", self.transactional_id, self.producer_id, self.epoch,
                    asked, dict(self._seq), sorted(self._lazy))
            except BaseException as err:
                self._ended(err)
                raise
            self._ended(None)
            if unknown is not None and outcome == "COMMIT":
                raise TransactionAbortedError(
                    f"{self.transactional_id}: transaction aborted, not committed: a "
                    f"write's outcome was unknown ({unknown})")

    def _ended(self, err: BaseException | None) -> None:
        """The transaction's end answered (or failed with ``err``): the producer is ready
        for the next.  Aborted before its commit: it goes on with the epoch after that
        abort; an end whose outcome is unknown: the next begin starts again from
        init_producer (which completes or aborts it first, and fences its late writes)."""
        try:
            if isinstance(err, TransactionAbortedError):
                self.producer_id, self.epoch = self._ask("init_producer",
                                                         self.transactional_id,
                                                         self.timeout_ms)
            elif err is not None:
                self._reinit = True
        finally:
            if self._state == "in_transaction":
                self._state = "ready"
            self._queues.clear()
            self._groups.clear()
            self._seq.clear()
            self._lazy.clear()
            self._unknown = None
            for _m, _c, future in self._pending:  # (only an abort leaves any)
                future.set(None, TransactionAbortedError(
                    f"{self.transactional_id}: aborted before the message was written"))
            self._pending, self._pending_n = [], 0


def _part(reply, shard: int, topics, qids: list[int]) -> PartResults:
    """The results of a write of ``qids``' messages to ``shard`` from its reply; offsets
    unknown (-1) when the reply does not name them: a retry the shard had stored once, or
    (None) a transaction of one request answered from the coordinator's log."""
    located = reply is not None and len(reply.phys) == len(qids)
    return PartResults(SendStatus(reply.status if reply is not None else "SEND_OK"), shard,
                       topics, qids, reply.queue_offsets if located else [-1] * len(qids),
                       reply.phys if located else None)


class SendFuture:
    """What ``send_async`` and ``send_batch_async`` return: ``result()`` waits for the
    write (writing what waits first) and gives its ``SendResult`` (``SendResult``s), or
    raises why it failed (``TransactionAbortedError``: the transaction ended first)."""

    def __init__(self, producer: TransactionalProducer, one: bool):
        self._producer, self._one = producer, one
        self._done = threading.Event()
        self._value = self._error = None

    def set(self, value, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self):
        if not self._done.is_set():
            self._producer.flush()
        if self._error is not None:
            raise self._error
        return self._value[0] if self._one else self._value
