"""Fewer durable writes per Kafka-style commit (issue 27): a transaction's writes are
answered once written, not once fsynced, and a transaction that touched one shard
commits in one phase, that shard deciding.

- **One shard: one phase** (Spanner's coordinator-on-participant, one-phase commit with
  a single participant).  The coordinator logs no PREPARE first: it asks the shard to
  commit (``ktx_end(..., expect, decide=True)``); the shard checks that every write the
  producer was answered for is there (``expect``: its last sequence -- writes not yet
  durable are lost only with the machine), writes the markers with one fsync (which
  makes the writes durable too), and answers the outcome.  Then the coordinator logs
  PREPARE_x and COMPLETE_x together, without waiting.
- **In doubt.**  Until those are logged, the shard may have committed unknown to the
  coordinator (it crashed, or the reply was lost).  Such a transaction (asked in one
  phase, or found ONGOING with one shard on a restart) is never aborted blindly: an abort
  -- the producer's, its timeout, a new instance, an operator -- first asks the shard to
  abort it in one phase (``settle``), which answers COMMIT if it had committed it; the
  coordinator logs what the shard says.  A shard that cannot be reached keeps it ONGOING
  (its LSO is held there anyway) until it can.
- **Several shards: two phases**, as before, after a ``ktx_verify`` round on every shard
  that took writes without an fsync (they are made durable and counted first: a
  PREPARE_COMMIT is never logged over writes a crash lost).

Which crash at which step leads where is in the README ("Kafka-style commits").  Pure
logic over the coordinator's calls: no Ray.
"""
from __future__ import annotations

import dataclasses

from raymq.actors.kafka_tx.state import (TxnMetadata, TxnState, committed_alone, ended_with,
                                        epoch_exhausted, transition)
from raymq.storage.errors import InvalidTxnStateError, TransactionAbortedError
from raymq.storage.faults import crash_point

_STATES = {"COMMIT": (TxnState.PREPARE_COMMIT, TxnState.COMPLETE_COMMIT),
           "ABORT": (TxnState.PREPARE_ABORT, TxnState.COMPLETE_ABORT)}


class FastCommit:
    """The coordinator's one-phase commits and their in-doubt transactions."""

    def __init__(self, coordinator, shards_of):
        self.c = coordinator
        self._shards_of = shards_of
        #: transactional ids whose one-phase commit may have reached their shard unlogged
        self.in_doubt: set[str] = set()
        #: transactional ids a restart found ended: transactions of one request may have
        #: moved their epoch on at a shard unlogged since (``epoch_seen``)
        self.unlogged: set[str] = set()

    def only_shard(self, meta: TxnMetadata) -> int | None:
        """The transaction's one shard, when it commits in one phase (None: two phases;
        an exhausted epoch, which rolls to a new producer id, always takes two)."""
        shards = self._shards_of(meta)
        if len(shards) != 1 or epoch_exhausted(meta.epoch):
            return None
        return next(iter(shards))

    def loaded(self, meta: TxnMetadata) -> None:
        """A restart found ``meta``: an ONGOING one-shard transaction is in doubt; after an
        ended one, transactions of one request may have committed unlogged."""
        if meta.state is TxnState.ONGOING and self.only_shard(meta) is not None:
            self.in_doubt.add(meta.transactional_id)
        elif meta.state is not TxnState.ONGOING:
            self.unlogged.add(meta.transactional_id)

    def epoch_seen(self, meta: TxnMetadata) -> TxnMetadata:
        """Before a new instance of ``meta``'s id is given the next epoch: ``meta`` at the
        highest epoch any shard saw of its producer, once after a restart.  Transactions of
        one request committed back to back move the epoch on at their shard before their
        COMPLETE_COMMITs are logged (``append_soon``); lost with a crash, the next epoch of
        the logged one would be fenced there for good, and would not fence the instance
        holding the shard's.  Every shard must answer (else the error, retriable)."""
        tid = meta.transactional_id
        if tid not in self.unlogged:
            return meta
        seen, errors = meta.epoch, []
        calls = [self.c._begin_shard(s, "ktx_epoch", (meta.producer_id,))
                 for s in range(self.c.config.num_shards)]
        for call in calls:  # (every answer read: none left on its connection)
            try:
                seen = max(seen, call.result())
            except Exception as err:  # noqa: BLE001 -- raised below, after every call
                errors.append(err)
        if errors:
            raise errors[0]
        self.unlogged.discard(tid)
        return dataclasses.replace(meta, epoch=seen) if seen > meta.epoch else meta

    def commit_or_verify(self, meta: TxnMetadata, seqs: dict, lazy) -> TxnMetadata:
        """A producer's commit of the ONGOING ``meta``: in one phase on its one shard (its
        COMPLETE_COMMIT); over more shards, the lazily written ones verified first
        (``meta`` back: two phases follow).  ``TransactionAbortedError`` once it was
        aborted instead (writes missing)."""
        seqs = {int(s): int(n) for s, n in seqs.items()}
        shard = self.only_shard(meta)
        if shard is not None:
            done = self.commit(meta, shard, seqs.get(shard))
        else:
            try:
                self.verify(meta, seqs, lazy)
                return meta
            except TransactionAbortedError:
                self.c._append(transition(meta, TxnState.PREPARE_ABORT, self.c.clock.now_ms()))
                done = self.c._complete(self.c._txns[meta.transactional_id])
        if done.state is TxnState.COMPLETE_ABORT:
            raise TransactionAbortedError(
                f"transactional id {meta.transactional_id!r}: aborted, not committed: a "
                f"shard lost writes of it in a crash before they were durable")
        return done

    def commit(self, meta: TxnMetadata, shard: int, expect: int | None) -> TxnMetadata:
        """Commit the ONGOING ``meta`` on its one shard; the COMPLETE_* metadata logged
        (COMPLETE_ABORT: the shard lacked writes, and aborted it)."""
        self.in_doubt.add(meta.transactional_id)
        try:
            reply = self._end(meta, shard, "COMMIT", expect)
        except TransactionAbortedError:  # writes missing there: nothing written; abort it
            reply = self._end(meta, shard, "ABORT", None)
        crash_point("coordinator.one_phase_decided")
        return self._logged(meta, reply["outcome"])

    def commit_batch(self, tid: str, producer_id: int, epoch: int, shard: int, batch,
                     sequence: int) -> tuple:
        """A transaction whose writes all go in one request to one shard, nothing of it
        written before: the shard writes them with their COMMIT markers in one put
        (``ktx_commit_batch``: never open there), then COMPLETE_COMMIT is logged, not
        waited for (``TxnLog.append_soon``: within 10 ms, off the request's path).  Lost
        with a crash, the epoch has moved on at the shard only, which fences nothing this
        id is given next; a resend is answered by the shard (a duplicate) or by the log
        (reply None).  (producer id, epoch) next, the reply."""
        c = self.c
        with c._txn_locks.of(tid):
            meta = c._txns.get(tid)
            if ended_with(meta, tid, producer_id, epoch, "COMMIT"):  # (its answer was lost)
                return meta.producer_id, meta.epoch, None
            meta = c._current(tid, producer_id, epoch)
            if meta.state is TxnState.ONGOING or epoch_exhausted(meta.epoch):
                raise InvalidTxnStateError(
                    f"transactional id {tid!r}: {meta.state.name} at epoch {meta.epoch}: "
                    f"not a transaction of one request (end_transaction commits it)")
            reply = c._begin_shard(shard, "ktx_commit_batch",
                                   (batch, producer_id, epoch, sequence)).result()
            crash_point("coordinator.batch_committed")
            done = committed_alone(meta, c.clock.now_ms())
            c.log.append_soon(done)  # (written by the log's writer, within 10 ms)
            c._keep(done, c.clock.monotonic_ms(), 0)
            return done.producer_id, done.epoch, reply

    def settle(self, meta: TxnMetadata) -> TxnMetadata:
        """Before an abort of ``meta``: if it is in doubt, its shard aborts it in one phase
        (or says it committed it); the metadata logged.  Else ``meta`` unchanged."""
        if meta.state is not TxnState.ONGOING or meta.transactional_id not in self.in_doubt:
            return meta
        shard = self.only_shard(meta)
        if shard is None:  # (more shards since: it never went one phase)
            self.in_doubt.discard(meta.transactional_id)
            return meta
        return self._logged(meta, self._end(meta, shard, "ABORT", None)["outcome"])

    def verify(self, meta: TxnMetadata, seqs: dict, lazy) -> None:
        """Before a two-phase commit: every shard that took writes without an fsync has
        them all, durably; ``TransactionAbortedError`` else (the caller aborts)."""
        written = {int(s) for s in lazy if seqs.get(int(s), 0) > 0}
        if written:
            self.c._on_shards(meta, "ktx_verify", lambda s, _q, _g: (
                meta.producer_id, meta.epoch, seqs[s]), only=written)

    def _end(self, meta: TxnMetadata, shard: int, outcome: str, expect: int | None) -> dict:
        # the markers carry the next epoch, as a two-phase end's (``_complete``)
        return self.c._begin_shard(shard, "ktx_end", (meta.producer_id, meta.epoch + 1,
                                                       outcome, expect, True)).result()

    def _logged(self, meta: TxnMetadata, outcome: str) -> TxnMetadata:
        """Log the shard's decision: PREPARE_x and COMPLETE_x, not waited for (lost with a
        crash, the restart finds the transaction ONGOING, in doubt, and asks again)."""
        now = self.c.clock.now_ms()
        prepare = transition(meta, _STATES[outcome][0], now)
        done = transition(prepare, _STATES[outcome][1], now)
        self.c._append(prepare, wait=False)
        self.c._append(done, wait=False)
        self.in_doubt.discard(meta.transactional_id)
        return done
