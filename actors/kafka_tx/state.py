"""The Kafka-style transaction state machine of the transaction coordinator.

Owns the states of a transactional id (``TxnState``, ids written to disk),
the table of allowed moves (``VALID_PREVIOUS``), the metadata the
coordinator appends to its log (``TxnMetadata`` and its JSON form) and the
InitProducerId rules (``init_producer``).  Pure logic: no Ray, no I/O.

A move is made in three steps, as in Kafka's ``TransactionMetadata``
(``prepareTransitionTo`` / ``appendTransactionToLog`` /
``completeTransitionTo``): ``transition`` *prepares* the new metadata (or
raises ``InvalidTxnStateError``), the caller appends it durably, and only
once the append succeeded keeps it as the current metadata (*complete*).  A
failed append leaves the old metadata current: nothing else changed.

Epochs fence.  Every completed transaction bumps the producer epoch (KIP-890
part 2), so a late write or marker of the previous transaction carries a
stale epoch; InitProducerId bumps it too, fencing the previous instance.  An
epoch handed to a producer stays below ``MAX_EPOCH`` (Kafka's
``isEpochExhausted``), so the coordinator can always fence it once more; past
that, the transactional id moves to a new producer id at epoch 0.
"""
from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass

from raymq.storage.errors import (ConcurrentTransactionsError, InvalidTxnStateError,
                                  TransactionAbortedError)

#: The largest epoch (Kafka's epoch is a short).  Producers get at most MAX_EPOCH - 1.
MAX_EPOCH = 32767
#: Version of the JSON form of ``TxnMetadata``.
JSON_VERSION = 1


class TxnState(enum.IntEnum):
    """The state of a transactional id; the value is its stable id, written to disk.

    Outgoing moves (the inverse of ``VALID_PREVIOUS``):

    - EMPTY: -> ONGOING (first queue or group added), EMPTY (InitProducerId), DEAD
    - ONGOING: -> ONGOING (more added), PREPARE_COMMIT, PREPARE_ABORT,
      PREPARE_EPOCH_FENCE
    - PREPARE_COMMIT: -> COMPLETE_COMMIT (commit markers written)
    - PREPARE_ABORT: -> COMPLETE_ABORT (abort markers written)
    - COMPLETE_COMMIT, COMPLETE_ABORT: -> ONGOING, EMPTY, DEAD (as EMPTY)
    - DEAD: none (the transactional id expired; its metadata is dropped)
    - PREPARE_EPOCH_FENCE: -> PREPARE_ABORT
    """

    EMPTY = 0
    ONGOING = 1
    PREPARE_COMMIT = 2
    PREPARE_ABORT = 3
    COMPLETE_COMMIT = 4
    COMPLETE_ABORT = 5
    DEAD = 6
    PREPARE_EPOCH_FENCE = 7


_S = TxnState
#: state -> the states it may be entered from (Kafka's ``validPreviousStates``)
VALID_PREVIOUS: dict[TxnState, frozenset[TxnState]] = {
    _S.EMPTY: frozenset({_S.EMPTY, _S.COMPLETE_COMMIT, _S.COMPLETE_ABORT}),
    _S.ONGOING: frozenset({_S.ONGOING, _S.EMPTY, _S.COMPLETE_COMMIT, _S.COMPLETE_ABORT}),
    _S.PREPARE_COMMIT: frozenset({_S.ONGOING}),
    _S.PREPARE_ABORT: frozenset({_S.ONGOING, _S.PREPARE_EPOCH_FENCE}),
    _S.COMPLETE_COMMIT: frozenset({_S.PREPARE_COMMIT}),
    _S.COMPLETE_ABORT: frozenset({_S.PREPARE_ABORT}),
    _S.DEAD: frozenset({_S.EMPTY, _S.COMPLETE_COMMIT, _S.COMPLETE_ABORT}),
    _S.PREPARE_EPOCH_FENCE: frozenset({_S.ONGOING}),
}
#: States with a transaction whose queues are not yet resolved by markers.
OPEN = frozenset({_S.ONGOING, _S.PREPARE_COMMIT, _S.PREPARE_ABORT, _S.PREPARE_EPOCH_FENCE})
#: States without a transaction: no queues, no groups, start_ms == -1.
CLOSED = frozenset(TxnState) - OPEN
_COMPLETE = frozenset({_S.COMPLETE_COMMIT, _S.COMPLETE_ABORT})
_STATE_IDS = frozenset(int(s) for s in TxnState)


def epoch_exhausted(epoch: int) -> bool:
    """Whether a bump of ``epoch`` needs a new producer id (Kafka's ``isEpochExhausted``).

    A coordinator completing a transaction whose epoch is exhausted passes
    ``producer_id=`` (a freshly allocated id) to ``transition``.
    """
    return epoch >= MAX_EPOCH - 1


def _is_int(value) -> bool:
    return type(value) is int  # not bool, not float


def _as_queues(tid: str, queues) -> frozenset[tuple[int, str, int]]:
    """``queues`` as a frozenset of (shard, topic, queue id); raises if one is malformed."""
    out = set()
    for q in queues:
        if not (isinstance(q, (tuple, list)) and len(q) == 3 and _is_int(q[0]) and q[0] >= 0
                and isinstance(q[1], str) and _is_int(q[2]) and q[2] >= 0):
            raise InvalidTxnStateError(f"transactional id {tid!r}: bad queue {q!r}, "
                                       "expected (shard, topic, queue id)")
        out.add((q[0], q[1], q[2]))
    return frozenset(out)


def _as_groups(tid: str, groups) -> frozenset[str]:
    out = frozenset(groups)
    if not all(isinstance(g, str) for g in out):
        raise InvalidTxnStateError(f"transactional id {tid!r}: consumer groups must be strings")
    return out


@dataclass(frozen=True)
class TxnMetadata:
    """The coordinator's record of one transactional id: what it appends, then keeps.

    Built only valid (``InvalidTxnStateError`` otherwise): ids and epoch in
    range, and a state without a transaction (``CLOSED``) has no queues, no
    groups and ``start_ms == -1``.
    """

    transactional_id: str
    producer_id: int
    epoch: int
    timeout_ms: int
    state: TxnState = TxnState.EMPTY
    queues: frozenset[tuple[int, str, int]] = frozenset()  # (shard, topic, queue id) in the txn
    groups: frozenset[str] = frozenset()  # consumer groups whose offsets are in it (send_offsets)
    start_ms: int = -1  # when the open transaction began (-1: none)
    update_ms: int = 0  # when this metadata was prepared
    # the producer id before the last move to a new one (-1: none), kept only by that
    # move: a retried end of the transaction that rolled the producer id over is known
    # as one (Kafka's ``previousProducerId``, KIP-360)
    prev_producer_id: int = -1

    def __post_init__(self):
        tid = self.transactional_id
        if not isinstance(tid, str) or not tid:
            raise InvalidTxnStateError(f"transactional id must be a non-empty string, not {tid!r}")
        ints = {"producer_id": 0, "epoch": 0, "timeout_ms": 1, "start_ms": -1, "update_ms": None,
                "prev_producer_id": -1}
        for name, least in ints.items():
            value = getattr(self, name)
            if not _is_int(value) or (least is not None and value < least):
                raise InvalidTxnStateError(f"transactional id {tid!r}: bad {name} {value!r}")
        if self.epoch > MAX_EPOCH:
            raise InvalidTxnStateError(f"transactional id {tid!r}: epoch {self.epoch} "
                                       f"is over {MAX_EPOCH}")
        if not (isinstance(self.state, TxnState) or _is_int(self.state)) \
                or self.state not in _STATE_IDS:
            raise InvalidTxnStateError(f"transactional id {tid!r}: unknown state {self.state!r}")
        object.__setattr__(self, "state", TxnState(self.state))
        try:
            object.__setattr__(self, "queues", _as_queues(tid, self.queues))
            object.__setattr__(self, "groups", _as_groups(tid, self.groups))
        except TypeError as e:  # not iterable, or unhashable members
            raise InvalidTxnStateError(f"transactional id {tid!r}: bad queues or groups: "
                                       f"{e}") from None
        if self.state in CLOSED and (self.queues or self.groups or self.start_ms != -1):
            raise InvalidTxnStateError(f"transactional id {tid!r}: state {self.state.name} "
                                       "holds no transaction, but has queues, groups or a start")

    def is_open(self) -> bool:
        """Whether a transaction is open: ONGOING or PREPARE_* (markers not all written)."""
        return self.state in OPEN

    def expired(self, now_ms: int) -> bool:
        """Whether an ONGOING transaction outlived its timeout (the coordinator aborts it)."""
        return self.state is TxnState.ONGOING and now_ms - self.start_ms > self.timeout_ms

    def ended_by(self, producer_id: int, epoch: int) -> bool:
        """Whether this is the COMPLETE_* state of the transaction of (``producer_id``,
        ``epoch``): a retry of its end is answered with this outcome."""
        if self.state not in _COMPLETE:
            return False
        if producer_id == self.producer_id:
            return epoch == self.epoch - 1
        return (producer_id == self.prev_producer_id and self.epoch == 0
                and epoch_exhausted(epoch))

    def to_json(self) -> bytes:
        """The stable, compact JSON form (sorted keys and members, a format version);
        ``prev_producer_id`` only when set."""
        obj = {
            "v": JSON_VERSION, "transactional_id": self.transactional_id,
            "producer_id": self.producer_id, "epoch": self.epoch, "timeout_ms": self.timeout_ms,
            "state": int(self.state), "queues": sorted(self.queues), "groups": sorted(self.groups),
            "start_ms": self.start_ms, "update_ms": self.update_ms,
        }
        if self.prev_producer_id != -1:
            obj["prev_producer_id"] = self.prev_producer_id
        return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("ascii")

    @classmethod
    def from_json(cls, data: bytes) -> "TxnMetadata":
        """Metadata from ``to_json``'s form; ``InvalidTxnStateError`` on anything else."""
        try:
            obj = json.loads(data)
        except (ValueError, TypeError, RecursionError) as e:  # ValueError: bad JSON or UTF-8
            raise InvalidTxnStateError(f"transaction metadata is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise InvalidTxnStateError("transaction metadata is not a JSON object")
        if obj.get("v") != JSON_VERSION or type(obj.get("v")) is not int:
            raise InvalidTxnStateError(f"transaction metadata has format version {obj.get('v')!r}, "
                                       f"expected {JSON_VERSION}")
        fields = {f.name for f in dataclasses.fields(cls)}
        keys = set(obj) - {"v"}
        if "prev_producer_id" not in keys:  # (written only when set)
            fields.discard("prev_producer_id")
        if keys != fields:
            raise InvalidTxnStateError(f"transaction metadata keys: missing "
                                       f"{sorted(fields - keys)}, unknown {sorted(keys - fields)}")
        if not isinstance(obj["queues"], list) or not isinstance(obj["groups"], list):
            raise InvalidTxnStateError("transaction metadata: queues and groups must be lists")
        return cls(**{k: obj[k] for k in fields})


def _refuse(meta: TxnMetadata, to: TxnState, why: str) -> InvalidTxnStateError:
    return InvalidTxnStateError(f"transactional id {meta.transactional_id!r}: cannot go from "
                                f"{meta.state.name} to {to.name}: {why}")


def _new_producer(meta: TxnMetadata, to: TxnState, producer_id: int | None,
                  epoch: int | None) -> dict:
    """The producer id and epoch after moving to ``to`` (the epoch bumped on COMPLETE_*)."""
    if producer_id is not None:
        if to not in (TxnState.EMPTY, *_COMPLETE):
            raise _refuse(meta, to, "a new producer id is taken only by EMPTY or COMPLETE_*")
        if producer_id == meta.producer_id:
            raise _refuse(meta, to, f"new producer id {producer_id} is the current one")
        return {"producer_id": producer_id, "epoch": 0 if epoch is None else epoch,
                "prev_producer_id": meta.producer_id}
    if epoch is not None:
        return {"epoch": epoch}
    if to in _COMPLETE:
        if epoch_exhausted(meta.epoch):
            raise _refuse(meta, to, f"epoch {meta.epoch} is exhausted, a new producer id is needed")
        return {"epoch": meta.epoch + 1}  # fences late writes and markers of this transaction
    return {}


def ended_with(meta: TxnMetadata | None, tid: str, producer_id: int, epoch: int,
               outcome: str) -> bool:
    """Whether ``meta`` is the end of (``producer_id``, ``epoch``)'s transaction, with
    ``outcome``: an end asked again, answered as it completed.  Ended the other way, the
    end asked for is refused: ``TransactionAbortedError`` for a COMMIT (it was aborted
    first: timeout, operator), ``InvalidTxnStateError`` for an ABORT."""
    if meta is None or not meta.ended_by(producer_id, epoch):
        return False
    if ("COMMIT" if meta.state is TxnState.COMPLETE_COMMIT else "ABORT") == outcome:
        return True
    if outcome == "COMMIT":
        raise TransactionAbortedError(f"transactional id {tid!r}: its transaction was "
                                      f"aborted before the commit (timeout or operator)")
    raise InvalidTxnStateError(f"transactional id {tid!r}: its transaction was committed "
                               f"before this abort")


def committed_alone(meta: TxnMetadata, now_ms: int) -> TxnMetadata:
    """The COMPLETE_COMMIT after ``meta`` (EMPTY or COMPLETE_*) of a transaction of one
    request: what moving to ONGOING, PREPARE_COMMIT and COMPLETE_COMMIT makes, in one step
    (the epoch bumped).  ``InvalidTxnStateError`` from any other state, or an exhausted
    epoch (its commit needs a new producer id: the usual path)."""
    if meta.state not in VALID_PREVIOUS[TxnState.ONGOING] or meta.state is TxnState.ONGOING:
        raise _refuse(meta, TxnState.COMPLETE_COMMIT, "not a valid previous state")
    if epoch_exhausted(meta.epoch):
        raise _refuse(meta, TxnState.COMPLETE_COMMIT, f"epoch {meta.epoch} is exhausted")
    return dataclasses.replace(meta, state=TxnState.COMPLETE_COMMIT, update_ms=now_ms,
                               prev_producer_id=-1, queues=frozenset(), groups=frozenset(),
                               start_ms=-1, epoch=meta.epoch + 1)


def transition(meta: TxnMetadata, to: TxnState, now_ms: int, *, queues=(), groups=(),
               epoch: int | None = None, timeout_ms: int | None = None,
               producer_id: int | None = None) -> TxnMetadata:
    """Prepare the move of ``meta`` to ``to``: the metadata to append durably, then keep.

    Raises ``InvalidTxnStateError`` (one line: transactional id, from- and
    to-state) when ``meta.state`` is not in ``VALID_PREVIOUS[to]``; nothing
    changes then.  Rules of the new metadata (``update_ms`` is ``now_ms``):

    - ONGOING adds ``queues`` and ``groups`` (only this move takes them); from
      EMPTY or COMPLETE_* the transaction starts empty at ``now_ms``, from
      ONGOING it keeps its sets and start;
    - PREPARE_* keep queues, groups and start;
    - EMPTY, COMPLETE_*, DEAD clear them (``start_ms`` -1); COMPLETE_* bump the
      epoch by one, or, when ``epoch_exhausted``, need ``producer_id``;
    - ``producer_id`` (EMPTY or COMPLETE_* only, a different id) starts at
      epoch 0 and keeps the old id as ``prev_producer_id`` (any other move clears
      it); ``epoch`` and ``timeout_ms`` replace the values when given.
    """
    if not (isinstance(to, TxnState) or (_is_int(to) and to in _STATE_IDS)):
        raise InvalidTxnStateError(f"transactional id {meta.transactional_id!r}: "
                                   f"unknown state {to!r}")
    to, queues, groups = TxnState(to), tuple(queues), tuple(groups)
    if meta.state not in VALID_PREVIOUS[to]:
        raise _refuse(meta, to, "not a valid previous state")
    if (queues or groups) and to is not TxnState.ONGOING:
        raise _refuse(meta, to, "only a move to ONGOING adds queues or groups")
    changes: dict = {"state": to, "update_ms": now_ms, "prev_producer_id": -1}
    if to is TxnState.ONGOING:
        tid, going = meta.transactional_id, meta.state is TxnState.ONGOING
        changes["queues"] = (meta.queues if going else frozenset()) | _as_queues(tid, queues)
        changes["groups"] = (meta.groups if going else frozenset()) | _as_groups(tid, groups)
        changes["start_ms"] = meta.start_ms if going else now_ms
    elif to in CLOSED:
        changes.update(queues=frozenset(), groups=frozenset(), start_ms=-1)
    changes.update(_new_producer(meta, to, producer_id, epoch))
    if timeout_ms is not None:
        changes["timeout_ms"] = timeout_ms
    return dataclasses.replace(meta, **changes)


def init_producer(meta: TxnMetadata | None, transactional_id: str, new_producer_id: int,
                  timeout_ms: int, now_ms: int) -> tuple[TxnMetadata, TxnState | None]:
    """Prepare Kafka's InitProducerId: (metadata to append, state to drive to or None).

    - no metadata: EMPTY, ``new_producer_id`` at epoch 0;
    - EMPTY or COMPLETE_*: EMPTY, same producer id at epoch + 1 (fencing the
      previous instance), the new ``timeout_ms``; when ``epoch_exhausted``,
      ``new_producer_id`` at epoch 0 instead;
    - ONGOING: the open transaction is aborted first: PREPARE_ABORT at
      epoch + 1 (fencing the previous instance), second element
      PREPARE_ABORT.  The caller appends it, writes abort markers to its
      queues, completes to COMPLETE_ABORT (``transition``), then calls
      ``init_producer`` again for the producer's epoch and timeout;
    - PREPARE_*: ``ConcurrentTransactionsError`` (retriable): it completes first;
    - DEAD: ``InvalidTxnStateError``: the caller forgets dead metadata (passes None).

    ``new_producer_id`` is used only for no metadata or an exhausted epoch.
    """
    if meta is None:
        return TxnMetadata(transactional_id, new_producer_id, 0, timeout_ms, update_ms=now_ms), None
    if meta.transactional_id != transactional_id:
        raise InvalidTxnStateError(f"metadata of transactional id {meta.transactional_id!r} "
                                   f"given for {transactional_id!r}")
    state = meta.state
    if state in (TxnState.EMPTY, *_COMPLETE):
        if epoch_exhausted(meta.epoch):
            return transition(meta, TxnState.EMPTY, now_ms, producer_id=new_producer_id,
                              timeout_ms=timeout_ms), None
        return transition(meta, TxnState.EMPTY, now_ms, epoch=meta.epoch + 1,
                          timeout_ms=timeout_ms), None
    if state is TxnState.ONGOING:
        fenced = transition(meta, TxnState.PREPARE_ABORT, now_ms, epoch=meta.epoch + 1)
        return fenced, TxnState.PREPARE_ABORT
    if state is TxnState.DEAD:
        raise InvalidTxnStateError(f"transactional id {transactional_id!r} is DEAD: "
                                   "its metadata is to be dropped, not reused")
    raise ConcurrentTransactionsError(f"transactional id {transactional_id!r} is in {state.name}: "
                                      "retry once it completed")
