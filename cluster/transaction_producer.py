"""RocketMQ-style transactional messages, the application's side: sending halves, running
the local transaction, ending it, and answering check-backs (time from an injected clock).

``send_in_transaction(msg, arg)``:

1. the message is stored as a *half* in its shard (invisible to consumers);
2. on ``SEND_OK`` the listener's ``execute_local_transaction(msg, arg)`` runs
   the local (database) transaction -- an exception or ``None`` counts as
   ``UNKNOW``; a send that is not ``SEND_OK`` rolls back without running it;
3. ``end_transaction`` (commit / rollback; nothing for ``UNKNOW``) is sent
   one-way and a failure of it is swallowed: the broker's check-back settles
   the transaction later by asking ``check_local_transaction(msg)`` of *any*
   live producer instance of the group.

Check channel: each producer instance long-polls its group's
``ProducerGroupRegistry`` (``poll_checks``), which also renews its lease; a
check runs the listener in this process, where the database connection is.
A batch (several messages, topics, shards) is one transaction: all its halves
commit or roll back together.
"""
from __future__ import annotations

import enum
import itertools
import logging
import threading
import uuid
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

from raymq.actors.protocol import CheckRequest, EndRequest
from raymq.clock import client_clock
from raymq.message import Message, MessageExt, Prop, SendResult, SendStatus, messages_ext
from raymq.storage import steps
from raymq.storage.clock import Clock
from raymq.storage.errors import InvalidMessageError, RayMQError

log = logging.getLogger("raymq.transaction")


class LocalTransactionState(enum.Enum):
    COMMIT_MESSAGE = "COMMIT_MESSAGE"
    ROLLBACK_MESSAGE = "ROLLBACK_MESSAGE"
    UNKNOW = "UNKNOW"  # RocketMQ's spelling: the outcome is not known yet


class TransactionListener:
    """Implemented by the application; runs in the application's process."""

    def execute_local_transaction(self, msg, arg) -> LocalTransactionState:
        """Run the local (database) transaction of a stored half message.

        ``msg`` is the ``Message`` (``msg.transaction_id`` set), or the list of
        messages of a batch transaction.
        """
        raise NotImplementedError

    def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        """Answer a check-back: did the local transaction of ``msg`` commit?

        ``msg.transaction_id`` names the transaction; ``msg.topic`` is its real topic.
        """
        raise NotImplementedError


@dataclass
class TransactionSendResult:
    send_status: SendStatus | None
    local_state: LocalTransactionState
    transaction_id: str
    results: list[SendResult]

    @property
    def msg_id(self) -> str:
        return self.results[0].msg_id if self.results else ""

    @property
    def msg_ids(self) -> list[str]:
        return [r.msg_id for r in self.results]


def _state(value) -> LocalTransactionState:
    if isinstance(value, LocalTransactionState):
        return value
    return LocalTransactionState.UNKNOW


def _with_transaction_id(m: Message, txid: str) -> Message:
    """A copy of the caller's message that carries its transaction id
    (``dataclasses.replace`` re-runs ``__init__``: ~4% of a sender's time)."""
    shown = Message.__new__(Message)
    shown.__dict__.update(m.__dict__)
    shown.transaction_id = txid
    return shown


@dataclass(slots=True)
class _Transaction:
    """One transaction in flight: its halves submitted, its local transaction not yet run."""

    transaction_id: str
    messages: list[Message]
    is_batch: bool             # sent as a list (the listener gets the list)
    timeout_ms: int | None     # its own transaction timeout, if it has one
    started_s: float           # the clock's monotonic seconds when its halves were submitted
    parts: list                # [(future, positions)]: one per request its halves rode on


class TransactionProducer:
    def __init__(self, mq, group: str, listener: TransactionListener, *, check_threads: int = 4,
                 executor_threads: int = 8, drop_end: Callable[[str], bool] | None = None,
                 clock: Clock | None = None):
        from raymq.producer import Producer
        clock = client_clock(clock)
        self._monotonic_s = clock.monotonic_s
        self._mq = mq
        self.group = group
        self.listener = listener
        #: the steps of the last ``send_in_transaction`` (``raymq.storage.steps`` on)
        self.last_steps: list | None = None
        self.instance_id = f"{group}-{uuid.uuid4().hex[:12]}"
        # transaction ids: this instance's random prefix and a counter (a uuid4 per
        # transaction is a getrandom call each, ~5% of a sender's time)
        self._txid_prefix = uuid.uuid4().hex
        self._txid_counter = itertools.count(1)
        self._producer = Producer(mq, group, clock=clock)
        self._drop_end = drop_end  # fault injection: lose this transaction's end
        self._registry = mq.registry_handle(group)
        self._stop = threading.Event()
        self._in_flight: set[Future] = set()  # async transactions not finished yet
        self._sync_in_flight = 0  # synchronous ones (a counter: a Future each costs)
        self._in_flight_lock = threading.Condition()
        self.checks_answered = 0
        from raymq import rpc
        rpc.call(self._registry.heartbeat, group, self.instance_id, timeout_s=30)
        self._pool = ThreadPoolExecutor(max_workers=check_threads,
                                        thread_name_prefix="raymq-tx-check")
        # the poller takes only as many checks as there are idle check threads: what a
        # slow or hung listener cannot take stays at the registry for other instances
        self._idle_checks = check_threads
        self._idle_cv = threading.Condition()
        self._exec_pool = ThreadPoolExecutor(max_workers=executor_threads,
                                             thread_name_prefix="raymq-tx-exec")
        self._poller = threading.Thread(target=self._poll_checks, daemon=True,
                                        name="raymq-tx-checks")
        self._poller.start()

    # ----------------------------------------------------------------- send
    def send_in_transaction(self, msg: Message | list[Message], arg=None, *,
                            timeout_ms: int | None = None) -> TransactionSendResult:
        """Send half message(s), run the local transaction, end the transaction.

        A list of messages (to one or several topics) is one transaction.  The
        local transaction runs in the calling thread.
        """
        steps.start("client.call")
        tx = self._begin(msg, timeout_ms, None)
        try:
            parts = [(fut, positions, self._wait_part(fut)) for fut, positions in tx.parts]
            steps.mark("tx.halves_stored")
            return self._finish(tx, parts, arg)
        finally:
            self._sync_done()
            if steps.enabled:  # (the local transaction ran; the end is queued to ride)
                steps.mark("tx.ended")
                self.last_steps = (steps.take() or []) + (self._producer.last_shard_steps
                                                           or [])

    def _sync_done(self) -> None:
        with self._in_flight_lock:
            self._sync_in_flight -= 1
            if not self._sync_in_flight:
                self._in_flight_lock.notify_all()

    def send_in_transaction_async(self, msg: Message | list[Message], arg=None, *,
                                  timeout_ms: int | None = None) -> Future:
        """Like ``send_in_transaction`` without blocking: a future of its result.

        The local transaction runs in the producer's executor threads
        (``executor_threads``) once the halves are stored, so one application
        thread can have many transactions in flight.
        """
        out: Future = Future()
        out.set_running_or_notify_cancel()  # not cancellable: its end must go out
        tx = self._begin(msg, timeout_ms, out)  # in flight until it is finished
        remaining = [len(tx.parts)]
        lock = threading.Lock()

        def part_done(_f):
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            try:
                self._exec_pool.submit(self._finish_into, out, tx, arg)
            except RuntimeError:  # the pool is shut down: finish here, never leave it hanging
                self._finish_into(out, tx, arg)
        for fut, _positions in tx.parts:
            fut.add_done_callback(part_done)
        return out

    def _landed(self, out: Future) -> None:
        with self._in_flight_lock:
            self._in_flight.discard(out)

    def _finish_into(self, out: Future, tx: "_Transaction", arg) -> None:
        try:
            out.set_result(self._finish(tx, [(fut, positions, self._wait_part(fut))
                                             for fut, positions in tx.parts], arg))
        except BaseException as err:  # delivered to whoever waits on the future
            out.set_exception(err)

    @staticmethod
    def _wait_part(fut: Future):
        try:
            return fut.result()
        except Exception as err:  # this part was not stored
            return err

    def _begin(self, msg, timeout_ms: int | None, token: Future | None) -> "_Transaction":
        """Validate, register the transaction as in flight (``token``: its future, or None
        for a synchronous one) and submit its halves."""
        if self._stop.is_set():
            raise RayMQError("transaction producer is closed")
        batch = isinstance(msg, list)
        msgs = list(msg) if batch else [msg]
        if not msgs:
            raise RayMQError("a transaction needs at least one message")
        if timeout_ms is not None and (isinstance(timeout_ms, bool) or not isinstance(
                timeout_ms, int) or timeout_ms <= 0):
            raise InvalidMessageError("timeout_ms must be a positive number of milliseconds")
        txid = f"{self._txid_prefix}-{next(self._txid_counter):x}"
        props = {Prop.TRAN_MSG: "true", Prop.PRODUCER_GROUP: self.group,
                 Prop.TRANSACTION_ID: txid}
        if timeout_ms is not None:
            props[Prop.TXN_TIMEOUT_MS] = str(int(timeout_ms))
        started_s = self._monotonic_s()
        # in flight from here to its end: close() waits for it (its end must still go out)
        with self._in_flight_lock:
            if self._stop.is_set():
                raise RayMQError("transaction producer is closed")
            if token is None:
                self._sync_in_flight += 1
            else:
                self._in_flight.add(token)
        if token is not None:
            token.add_done_callback(self._landed)
        try:
            parts = self._producer._submit(msgs, system_props=props, inline=token is None)
        except BaseException as err:
            if token is None:
                self._sync_done()
            else:
                token.set_exception(err)
            raise
        return _Transaction(txid, msgs, batch, timeout_ms, started_s, parts)

    def _finish(self, tx: "_Transaction", parts: list, arg) -> TransactionSendResult:
        """Halves stored (or not): run the local transaction and end the transaction."""
        txid, msgs = tx.transaction_id, tx.messages
        results: list = [None] * len(msgs)
        failure = None
        for _fut, positions, part in parts:
            if isinstance(part, Exception):
                failure = failure or part
                continue
            for j, pos in enumerate(positions):
                results[pos] = part[j]
        if failure is not None:  # roll back the parts that were stored, then report
            self._end(txid, [r for r in results if r is not None],
                      LocalTransactionState.ROLLBACK_MESSAGE)
            raise failure
        send_status = SendStatus.SEND_OK
        for r in results:  # the first status that is not SEND_OK, if any
            if r.status is not SendStatus.SEND_OK:
                send_status = r.status
                break
        shown = [_with_transaction_id(m, txid) for m in msgs]
        limit_ms = tx.timeout_ms if tx.timeout_ms is not None \
            else self._mq.config.txn_timeout_ms
        late = (self._monotonic_s() - tx.started_s) * 1000 >= limit_ms
        if send_status is SendStatus.SEND_OK and late:
            # the halves may already have been checked back (and rolled back): do not run
            # a local transaction whose message could be gone
            log.warning("half of %s stored only after its transaction timeout; rolling back",
                        txid)
        if send_status is not SendStatus.SEND_OK or late:
            state = LocalTransactionState.ROLLBACK_MESSAGE
        else:
            try:
                state = _state(self.listener.execute_local_transaction(
                    shown if tx.is_batch else shown[0], arg))
            except Exception as err:  # the local transaction's failure: outcome unknown
                log.warning("execute_local_transaction of %s raised %s: %s; state UNKNOW",
                            txid, type(err).__name__, err)
                state = LocalTransactionState.UNKNOW
        self._end(txid, results, state)
        return TransactionSendResult(send_status, state, txid, results)

    def _end(self, txid: str, results: list[SendResult], state: LocalTransactionState) -> None:
        if state is LocalTransactionState.UNKNOW:
            return
        if self._drop_end is not None and self._drop_end(txid):
            log.warning("fault injection: end_transaction of %s dropped", txid)
            return
        by_shard: dict[int, list[int]] = defaultdict(list)
        for r in results:
            if r.shard is None or r.shard < 0 or r.phys_offset is None or r.phys_offset < 0:
                continue  # a resend the shard had stored before: check-back settles it
            by_shard[r.shard].append(r.phys_offset)
        for shard, origins in by_shard.items():  # one-way: rides on the next request there
            self._producer.add_ends(shard, [EndRequest(self.group, txid, tuple(origins),
                                                       state.value)])

    # ---------------------------------------------------------------- checks
    def _poll_checks(self) -> None:
        from raymq import rpc
        heartbeat_s = self._mq.config.heartbeat_interval_ms / 1000.0
        while not self._stop.is_set():
            with self._idle_cv:
                if not self._idle_checks:
                    self._idle_cv.wait(heartbeat_s)
                free = self._idle_checks
            try:
                if not free:  # every check thread busy: stay live, take nothing
                    rpc.call(self._registry.heartbeat, self.group, self.instance_id,
                             timeout_s=30)
                    continue
                reqs = rpc.call(self._registry.poll_checks, self.group, self.instance_id,
                                min(100, free), 500, timeout_s=30)
            except Exception as err:  # registry restarting: keep trying
                log.warning("transaction producer %s: poll_checks failed: %s",
                            self.instance_id, err)
                self._stop.wait(0.5)
                continue
            for req in reqs:
                with self._idle_cv:
                    self._idle_checks -= 1
                try:
                    self._pool.submit(self._answer, req)
                except RuntimeError:  # the pool is shut down: the registry asks again later
                    with self._idle_cv:
                        self._idle_checks += 1

    def _answer(self, req: dict) -> None:
        try:
            self._check(req)
        finally:
            with self._idle_cv:
                self._idle_checks += 1
                self._idle_cv.notify()

    def _check(self, req: CheckRequest) -> None:
        [msg] = messages_ext(req.shard, [req.message])
        try:
            state = _state(self.listener.check_local_transaction(msg))
        except Exception as err:  # unknown: asked again later
            log.warning("check_local_transaction of %s raised %s", req.transaction_id, err)
            state = LocalTransactionState.UNKNOW
        self.checks_answered += 1
        if state is LocalTransactionState.UNKNOW:
            return
        self._producer.add_ends(req.shard, [EndRequest(self.group, req.transaction_id,
                                                       (req.origin,), state.value)])

    # ----------------------------------------------------------------- close
    def close(self) -> None:
        """Refuse new transactions, let those in flight end (their ends are sent), stop
        answering checks and leave the group.  Not from inside a listener: it would wait
        for its own transaction."""
        from raymq import rpc
        with self._in_flight_lock:  # no transaction begins after this
            self._stop.set()
        with self._idle_cv:
            self._idle_cv.notify_all()
        self._poller.join()
        with self._in_flight_lock:  # transactions run to their end before the pools go
            in_flight = list(self._in_flight)
            while self._sync_in_flight:
                self._in_flight_lock.wait()
        wait(in_flight)
        self._exec_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._producer.close()  # sends the ends still queued
        try:
            rpc.call(self._registry.unregister, self.group, self.instance_id, timeout_s=10)
        except Exception as err:  # the lease runs out anyway
            log.warning("unregister failed: %s", err)
