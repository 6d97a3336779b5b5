"""TransactionCoordinator: Kafka-style transactions of the transactional ids hashed to it
(seed 002): producer ids and epochs, the transaction state machine (``txn_state``) kept
in a durable transaction log on the storage engine, and two-phase commit over shards.

Commit: the coordinator logs PREPARE_COMMIT (the point of no return), has every shard
of the transaction write its commit markers (``BrokerShard.ktx_end``, in parallel),
then logs COMPLETE_COMMIT with the epoch bumped (KIP-890: a late write or marker of the
finished transaction is fenced).  Abort is the same with ABORT.  Every state is logged
(fsync) before it is acted on or answered.  On restart the log is replayed (the newest
record of each transactional id wins) and every transaction found in PREPARE_COMMIT or
PREPARE_ABORT is completed; a background loop aborts transactions open longer than
their timeout.  A second ``init_producer`` of the same id bumps the epoch: the old
instance is fenced and its open transaction aborted.

Each call is idempotent for its own retry (Ray resends calls in flight to a restarted
actor): a commit asked again after it completed answers the same.
"""
from __future__ import annotations

import logging
import os
import threading
import zlib
from typing import Callable

from raymq.actors.config import ClusterConfig
from raymq.actors.kafka_tx.fast_commit import FastCommit
from raymq.actors.faults import faults_named
from raymq.actors.kafka_tx.shard_side import KeyedLocks
from raymq.actors.protocol import check_group
from raymq.actors.kafka_tx.log import TxnLog
from raymq.actors.kafka_tx.state import (MAX_EPOCH, TxnMetadata, TxnState, ended_with,
                                         epoch_exhausted, init_producer, transition)
from raymq.storage.clock import Clock, SystemClock
from raymq.storage.faults import crash_point
from raymq.storage.errors import (ConcurrentTransactionsError, InvalidMessageError,
                                  InvalidTxnStateError, ProducerFencedError,
                                  TransactionAbortedError)

log = logging.getLogger("raymq.coordinator")

PREPARED = frozenset({TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT})
#: A prepared transaction whose markers failed is tried again after this back-off (ms),
#: doubling up to the second figure.
PREPARE_RETRY_MS = (50, 5000)
OUTCOME_STATES = {"COMMIT": (TxnState.PREPARE_COMMIT, TxnState.COMPLETE_COMMIT),
                  "ABORT": (TxnState.PREPARE_ABORT, TxnState.COMPLETE_ABORT)}
_TXN_ID_MAX = 255


def coordinator_for(transactional_id: str, num_coordinators: int) -> int:
    """The coordinator of a transactional id."""
    return zlib.crc32(transactional_id.encode()) % num_coordinators


def check_transactional_id(tid) -> str:
    if not isinstance(tid, str) or not 0 < len(tid) <= _TXN_ID_MAX or any(
            c in tid for c in "\n\r\x00"):
        raise InvalidMessageError(f"invalid transactional id {tid!r}: 1-{_TXN_ID_MAX} "
                                  "characters, no line breaks")
    return tid


def group_entry(shard: int, group: str) -> str:
    """How a group whose offsets a transaction commits on ``shard`` is kept in its metadata."""
    return f"{shard}:{group}"


def _describe(meta: TxnMetadata, now: int) -> dict:
    return {"transactional_id": meta.transactional_id, "producer_id": meta.producer_id,
            "epoch": meta.epoch, "state": meta.state.name, "timeout_ms": meta.timeout_ms,
            "age_ms": now - meta.start_ms if meta.start_ms >= 0 else None,
            "queues": sorted([s, t, q] for s, t, q in meta.queues),
            "groups": sorted(meta.groups)}


def shards_of(meta: TxnMetadata) -> dict[int, tuple[list, list]]:
    """shard -> (its queues, its groups) in the transaction."""
    out: dict[int, tuple[list, list]] = {}
    for shard, topic, qid in sorted(meta.queues):
        out.setdefault(shard, ([], []))[0].append((topic, qid))
    for entry in sorted(meta.groups):
        shard, _, group = entry.partition(":")
        out.setdefault(int(shard), ([], []))[1].append(group)
    return out


class _Done:
    """A call made at once, answered like a begun one (``result``)."""

    def __init__(self, fn: Callable, *args):
        try:
            self._value, self._error = fn(*args), None
        except Exception as err:  # noqa: BLE001 -- raised by result(), as a future does
            self._value, self._error = None, err

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value


class TransactionCoordinator:
    def __init__(self, index: int, config: dict | ClusterConfig, *,
                 call_shard: Callable | None = None, begin_shard: Callable | None = None,
                 clock: Clock | None = None, background: bool = True,
                 directory: str | None = None):
        self.index = index
        self.config = config if isinstance(config, ClusterConfig) else \
            ClusterConfig.from_dict(config)
        self.clock = clock or SystemClock()
        # begin_shard(shard, method, args) -> a call begun (its result() waits): every
        # shard of a commit at once; or call_shard(shard, method, *args) -> its result:
        # one after another
        if (call_shard is None) == (begin_shard is None):
            raise TypeError("a coordinator calls shards with call_shard or begin_shard")
        self._begin_shard = begin_shard or (
            lambda shard, method, args: _Done(call_shard, shard, method, *args))
        self.directory = directory or os.path.join(self.config.resolved_data_dir(),
                                                   f"coordinator-{index}")
        self.log = TxnLog(self.directory, self.config.store_config(), self.clock,
                          compact_records=self.config.state_log_compact_records,
                          background=background)
        self._txns: dict[str, TxnMetadata] = {}
        self._began: dict[str, float] = {}   # tid -> monotonic ms its ONGOING began
        self._seen: dict[str, float] = {}    # tid -> monotonic ms of its last logged move
        self._retry: dict[str, tuple[float, float]] = {}  # prepared tid -> (next try, backoff)
        self._lock = threading.Lock()
        self._txn_locks = KeyedLocks()  # one transactional id's calls in turn
        self._last_counter = 0
        self._stop = threading.Event()
        # transactions this coordinator's own rounds completed: those a restart found
        # prepared, and those a shard failing while their markers were written left so
        self.completed_on_start = 0
        self.fast = FastCommit(self, shards_of)  # one-phase commits, in-doubt ones
        self._load()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"raymq-coordinator-{index}")
            self._thread.start()

    @property
    def store(self):
        """The store of its log (a replicated coordinator's leader hooks it)."""
        return self.log.store

    # ------------------------------------------------------------- the log
    def _load(self) -> None:
        loaded, self._last_counter = self.log.load()
        now, mono = self.clock.now_ms(), self.clock.monotonic_ms()
        for meta in loaded.values():  # an open transaction's age: at most its timeout
            self._keep(meta, mono, min(max(0, now - meta.start_ms), meta.timeout_ms))
            self.fast.loaded(meta)
        if self._txns:
            log.info("coordinator-%d: %d transactional ids from its log (%d records after "
                     "its snapshot)", self.index, len(self._txns), self.log.replayed)

    def _append(self, meta: TxnMetadata, *, wait: bool = True) -> None:
        """Log ``meta`` (durably, unless ``wait`` is False: a COMPLETE state, which a
        restart that lost it finds PREPARE_* and completes again) and keep it."""
        self.log.append(meta, wait=wait)
        self._keep(meta, self.clock.monotonic_ms(), 0)

    def _keep(self, meta: TxnMetadata, mono_ms: float, age_ms: int) -> None:
        """Keep ``meta`` as the current metadata of its id (DEAD: forget the id), noting on
        the monotonic clock when its transaction began (``age_ms`` before ``mono_ms``) and
        when it was last used."""
        tid = meta.transactional_id
        if meta.state is TxnState.DEAD:
            for table in (self._txns, self._began, self._seen, self._retry):
                table.pop(tid, None)
            return
        old = self._txns.get(tid)
        self._txns[tid] = meta
        self._seen[tid] = mono_ms
        if meta.state is not TxnState.ONGOING:
            self._began.pop(tid, None)
        elif old is None or old.state is not TxnState.ONGOING or tid not in self._began:
            self._began[tid] = mono_ms - age_ms

    def _new_producer_id(self) -> int:
        with self._lock:
            self._last_counter += 1
            return (self._last_counter << 8) | (self.index & 0xFF)

    def _id_for(self, meta: TxnMetadata | None) -> int:
        """A new producer id when InitProducerId needs one (a new or expired id, an
        exhausted epoch), else 0: ids are drawn only when handed out."""
        if meta is None or epoch_exhausted(meta.epoch):
            return self._new_producer_id()
        return 0

    # --------------------------------------------------------- producer calls
    def init_producer(self, transactional_id: str, timeout_ms: int | None = None) -> tuple:
        """(producer id, epoch) for a transactional producer starting: a known id gets
        its producer id with the next epoch (fencing the instance before it, whose open
        transaction is aborted first)."""
        check_transactional_id(transactional_id)
        timeout_ms = self.config.kafka_txn_timeout_ms if timeout_ms is None else timeout_ms
        limit = self.config.max_txn_timeout_ms
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) \
                or not 1 <= timeout_ms <= limit:
            raise InvalidMessageError(f"transaction timeout must be an int of 1-{limit} ms "
                                      f"(max_txn_timeout_ms), got {timeout_ms!r}")
        with self._txn_locks.of(transactional_id):
            meta = self._txns.get(transactional_id)
            if meta is not None and meta.state in PREPARED:
                meta = self._complete(meta)  # a transaction left half-done: finish it
            if meta is not None:
                meta = self.fast.settle(meta)  # (one committed in one phase stays so)
                meta = self.fast.epoch_seen(meta)  # (epochs moved on unlogged, after a crash)
            new, must = init_producer(meta, transactional_id, self._id_for(meta),
                                      timeout_ms, self.clock.now_ms())
            self._append(new)
            if must is not None:  # it had one open: aborted (markers), then the new epoch
                done = self._complete(new)
                new, _ = init_producer(done, transactional_id, self._id_for(done), timeout_ms,
                                       self.clock.now_ms())
                self._append(new)
            return new.producer_id, new.epoch

    def _current(self, tid: str, producer_id: int, epoch: int) -> TxnMetadata:
        meta = self._txns.get(tid)
        if meta is None:
            raise InvalidTxnStateError(f"transactional id {tid!r} is not initialised "
                                       f"(init_producer first)")
        if producer_id != meta.producer_id or epoch < meta.epoch:
            raise ProducerFencedError(f"transactional id {tid!r}: producer {producer_id} "
                                      f"epoch {epoch} is fenced by epoch {meta.epoch}")
        if epoch > meta.epoch:
            raise InvalidTxnStateError(f"transactional id {tid!r}: epoch {epoch} was never "
                                       f"given (current {meta.epoch})")
        if meta.state in PREPARED:
            raise ConcurrentTransactionsError(f"transactional id {tid!r}: the previous "
                                              f"transaction is still completing")
        return meta

    def add_to_transaction(self, transactional_id: str, producer_id: int, epoch: int,
                           queues: list, groups: list = ()) -> int:
        """Add ``queues`` [(shard, topic, queue id)] and ``groups`` [(shard, group)] to the
        producer's transaction (begun by the first); each shard registers them before
        this returns.  Returns the epoch."""
        queues = {(int(s), t, int(q)) for s, t, q in queues}
        entries = set()
        for shard, group in groups:
            check_group(group)
            entries.add(group_entry(int(shard), group))
        for shard, _t, _q in queues:
            self._check_shard(shard)
        with self._txn_locks.of(transactional_id):
            meta = self._current(transactional_id, producer_id, epoch)
            new = meta
            if not (meta.state is TxnState.ONGOING and queues <= meta.queues
                    and entries <= meta.groups):
                new = transition(meta, TxnState.ONGOING, self.clock.now_ms(),
                                 queues=queues - meta.queues, groups=entries - meta.groups)
                self._append(new)
                crash_point("coordinator.add_logged")
            # every one asked for, even one logged before: asked again, its answer did not
            # reach the producer (a shard that failed to take it, a lost reply); the shards
            # take a registration they have as a no-op
            added = TxnMetadata(transactional_id, producer_id, epoch, new.timeout_ms,
                                TxnState.ONGOING, frozenset(queues), frozenset(entries))
            self._on_shards(added, "ktx_register", lambda _s, queues_, groups_: (
                producer_id, epoch, queues_, groups_))
            return new.epoch

    def end_transaction(self, transactional_id: str, producer_id: int, epoch: int,
                        outcome: str, seqs: dict | None = None,
                        lazy: list = ()) -> tuple[int, int]:
        """Commit or abort the producer's transaction; returns the producer's next
        (producer id, epoch): a new producer id at epoch 0 when the epoch would overflow
        (Kafka's epoch exhaustion).  Idempotent: a retry of an end that completed answers
        the same, and a retry of one left prepared (a shard failed while its markers were
        written) drives it to its end.  ``TransactionAbortedError`` when it was aborted
        before this commit (timeout, operator, fencing).  ``seqs``: the producer's last
        sequence per shard; ``lazy``: the shards it wrote to without an fsync
        (``raymq.actors.kafka_tx.fast_commit``: one shard commits in one phase)."""
        if outcome not in OUTCOME_STATES:
            raise InvalidMessageError(f"outcome must be COMMIT or ABORT, got {outcome!r}")
        with self._txn_locks.of(transactional_id):
            meta = self._txns.get(transactional_id)
            if meta is not None and meta.producer_id == producer_id and meta.epoch == epoch:
                if meta.state in PREPARED:
                    meta = self._complete(meta)  # asked again while it is completing
                elif outcome == "ABORT":
                    meta = self.fast.settle(meta)  # (one committed in one phase stays so)
            if ended_with(meta, transactional_id, producer_id, epoch, outcome):
                return meta.producer_id, meta.epoch  # (a retry of an end that completed)
            meta = self._current(transactional_id, producer_id, epoch)
            if meta.state is not TxnState.ONGOING:  # nothing sent: nothing to end
                return meta.producer_id, meta.epoch
            if outcome == "COMMIT":
                meta = self.fast.commit_or_verify(meta, seqs or {}, lazy)
                if meta.state is not TxnState.ONGOING:
                    return meta.producer_id, meta.epoch
            prepare = transition(meta, OUTCOME_STATES[outcome][0], self.clock.now_ms())
            self._append(prepare)
            done = self._complete(prepare)
            return done.producer_id, done.epoch

    def commit_batch(self, transactional_id: str, producer_id: int, epoch: int, shard: int,
                     batch, sequence: int) -> tuple:
        """A transaction of one request, committed with it (``FastCommit.commit_batch``):
        (producer id, epoch) next, and the shard's reply."""
        self._check_shard(shard)
        return self.fast.commit_batch(transactional_id, producer_id, epoch, shard, batch,
                                      sequence)

    def _complete(self, prepare: TxnMetadata) -> TxnMetadata:
        """Markers on every shard of a prepared transaction, then its COMPLETE state.  The
        epoch moves on; when it would overflow, the transactional id moves to a new
        producer id at epoch 0 and the old one is fenced for good (markers at MAX_EPOCH)."""
        commit = prepare.state is TxnState.PREPARE_COMMIT
        done_state = TxnState.COMPLETE_COMMIT if commit else TxnState.COMPLETE_ABORT
        rolled = epoch_exhausted(prepare.epoch)
        done = transition(prepare, done_state, self.clock.now_ms(),
                          producer_id=self._new_producer_id() if rolled else None)
        fence = MAX_EPOCH if rolled else done.epoch
        outcome = "COMMIT" if commit else "ABORT"
        # the markers carry the next epoch: a late write of this transaction is fenced
        self._on_shards(prepare, "ktx_end", lambda _s, _q, _g: (prepare.producer_id, fence,
                                                               outcome))
        # (markers are idempotent: a lost COMPLETE is redone.  A new producer id is made
        # durable before it is handed out: never given twice, never taken back)
        self._append(done, wait=rolled)
        self._retry.pop(prepare.transactional_id, None)
        return done

    def _on_shards(self, meta: TxnMetadata, method: str, args_of: Callable,
                   only: set | None = None) -> None:
        """``method(*args_of(shard, queues, groups))`` on the transaction's shards (``only``:
        those of them), all sent before any answer is awaited; then the first error raised
        (a ``TransactionAbortedError`` first: it cannot commit, whatever else failed)."""
        calls, errors = [], []
        for shard, (queues, groups) in shards_of(meta).items():
            if only is not None and shard not in only:
                continue
            try:
                calls.append((shard, self._begin_shard(shard, method,
                                                       args_of(shard, queues, groups))))
            except Exception as err:  # noqa: BLE001 -- raised below, after every call
                errors.append((shard, err))
        for shard, call in calls:
            try:
                call.result()
            except Exception as err:  # noqa: BLE001 -- raised below, after every call
                errors.append((shard, err))
        if errors:
            shard, err = min(errors, key=lambda e: not isinstance(e[1], TransactionAbortedError))
            log.warning("coordinator-%d: %s of %r on shard-%d failed: %s", self.index, method,
                        meta.transactional_id, shard, err)
            raise err

    def _check_shard(self, shard: int) -> None:
        if not 0 <= shard < self.config.num_shards:
            raise InvalidMessageError(f"no shard {shard} (the cluster has "
                                      f"{self.config.num_shards})")

    # ------------------------------------------------------- timeouts, restart
    def _loop(self) -> None:
        while not self._stop.is_set():
            for step in (self.complete_prepared, self.abort_expired, self.expire_ids,
                         self.log.compact):
                try:
                    step()
                except Exception as err:  # noqa: BLE001 -- the loop must live on
                    log.warning("coordinator-%d: %s failed: %s", self.index, step.__name__,
                                err)
            wait_ms = self.config.kafka_txn_check_interval_ms
            if self._retry:
                wait_ms = min(wait_ms, max(1.0, min(at for at, _b in self._retry.values())
                                           - self.clock.monotonic_ms()))
            self._stop.wait(wait_ms / 1000.0)

    def complete_prepared(self) -> int:
        """One round of driving every PREPARE_COMMIT / PREPARE_ABORT transaction to its end
        (markers on every shard, then COMPLETE_*): a restart finds them, and a shard that
        failed while markers were written leaves them.  One that fails again is retried
        with a back-off (``PREPARE_RETRY_MS``, doubling); the others go on.  Returns how
        many completed."""
        now = self.clock.monotonic_ms()
        completed = 0
        for tid, meta in list(self._txns.items()):
            if meta.state not in PREPARED or self._retry.get(tid, (0, 0))[0] > now:
                continue
            try:
                with self._txn_locks.of(tid):
                    meta = self._txns[tid]
                    if meta.state in PREPARED:
                        self._complete(meta)
                        completed += 1
            except Exception as err:  # noqa: BLE001 -- a shard down: again, later
                backoff = min(PREPARE_RETRY_MS[1], max(PREPARE_RETRY_MS[0],
                                                       2 * self._retry.get(tid, (0, 0))[1]))
                self._retry[tid] = (now + backoff, backoff)
                log.warning("coordinator-%d: completing %r failed (again in %d ms): %s",
                            self.index, tid, backoff, err)
        self.completed_on_start += completed
        return completed

    def abort_expired(self) -> list[str]:
        """Abort every transaction open longer than its timeout; their ids.  Ages are
        measured on the monotonic clock: a wall clock stepped back does not keep a dead
        producer's transaction (and the LSO it holds) open longer."""
        now = self.clock.monotonic_ms()
        aborted = []
        for tid, began in list(self._began.items()):
            meta = self._txns.get(tid)
            if meta is None or meta.state is not TxnState.ONGOING \
                    or now - began <= meta.timeout_ms:
                continue
            try:
                with self._txn_locks.of(tid):
                    meta = self._txns[tid]
                    if meta.state is not TxnState.ONGOING or tid not in self._began \
                            or now - self._began[tid] <= meta.timeout_ms:
                        continue
                    meta = self.fast.settle(meta)
                    if meta.state is not TxnState.ONGOING:  # (settled by its one shard)
                        if meta.state is TxnState.COMPLETE_ABORT:
                            aborted.append(tid)
                        continue
                    log.warning("coordinator-%d: %r open for %d ms, past its timeout: "
                                "aborting it", self.index, tid, now - self._began[tid])
                    self._append(transition(meta, TxnState.PREPARE_ABORT, self.clock.now_ms()))
                    aborted.append(tid)  # (prepared: complete_prepared finishes it)
                    self._complete(self._txns[tid])
            except Exception as err:  # noqa: BLE001 -- prepared: complete_prepared goes on
                log.warning("coordinator-%d: aborting %r: %s", self.index, tid, err)
        return aborted

    def expire_ids(self) -> list[str]:
        """Forget transactional ids with no transaction open and no call for
        ``transactional_id_expiration_ms`` (Kafka's expiration of transactional ids): a
        DEAD record is logged and the metadata dropped, so that memory and the log's
        live state follow the ids in use.  A producer of an expired id starts again with
        ``init_producer`` (a new producer id).  Their ids."""
        now = self.clock.monotonic_ms()
        limit = self.config.transactional_id_expiration_ms
        gone = []
        for tid, seen in list(self._seen.items()):
            if now - seen <= limit:
                continue
            with self._txn_locks.of(tid):
                meta = self._txns.get(tid)
                if meta is None or meta.is_open() or now - self._seen.get(tid, now) <= limit:
                    continue
                self._append(transition(meta, TxnState.DEAD, self.clock.now_ms()))
                gone.append(tid)
        if gone:
            log.info("coordinator-%d: %d transactional ids expired", self.index, len(gone))
        return gone

    # ------------------------------------------------------------ operators
    def list_transactions(self) -> list[dict]:
        now = self.clock.now_ms()
        return [_describe(m, now) for _t, m in sorted(self._txns.items())]

    def describe_transaction(self, transactional_id: str) -> dict:
        meta = self._txns.get(transactional_id)
        if meta is None:
            raise InvalidTxnStateError(f"no transactional id {transactional_id!r} here")
        return _describe(meta, self.clock.now_ms())

    def abort_transaction(self, transactional_id: str) -> str:
        """An operator aborts an open transaction (KIP-664); its final state's name."""
        with self._txn_locks.of(transactional_id):
            meta = self._txns.get(transactional_id)
            if meta is None:
                raise InvalidTxnStateError(f"no transactional id {transactional_id!r} here")
            if meta.state in PREPARED:
                return self._complete(meta).state.name
            meta = self.fast.settle(meta)
            if meta.state is not TxnState.ONGOING:
                return meta.state.name
            self._append(transition(meta, TxnState.PREPARE_ABORT, self.clock.now_ms()))
            return self._complete(self._txns[transactional_id]).state.name

    def set_fault(self, fault: str | None) -> None:
        """Test hook: 'crash_at:POINT[:N]' kills this process at a storage crash point of
        its log (``raymq.actors.faults``)."""
        faults_named(fault)

    def ping(self) -> dict:
        return {"coordinator": self.index, "pid": os.getpid(), "transactional_ids":
                len(self._txns), "completed_on_start": self.completed_on_start,
                "replayed_on_start": self.log.replayed}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.log.close()
