"""The transaction coordinator's state machine (pure, no Ray): every move of the table,
epoch bumps and fencing, InitProducerId, the JSON form and expiry."""
from __future__ import annotations

import itertools
import json
import pickle

import pytest

from raymq.actors.kafka_tx.state import (CLOSED, MAX_EPOCH, OPEN, VALID_PREVIOUS,
                                    ConcurrentTransactionsError, InvalidTxnStateError,
                                    TxnMetadata, TxnState, committed_alone, epoch_exhausted,
                                    init_producer, transition)
from raymq.storage import errors
from raymq.storage.errors import RayMQError

S = TxnState
TID = "orders-tx"
Q1, Q2 = (0, "orders", 1), (1, "payments", 0)

#: Kafka's validPreviousStates, written out again: the table must not drift.
KAFKA_TABLE = {
    S.EMPTY: {S.EMPTY, S.COMPLETE_COMMIT, S.COMPLETE_ABORT},
    S.ONGOING: {S.ONGOING, S.EMPTY, S.COMPLETE_COMMIT, S.COMPLETE_ABORT},
    S.PREPARE_COMMIT: {S.ONGOING},
    S.PREPARE_ABORT: {S.ONGOING, S.PREPARE_EPOCH_FENCE},
    S.COMPLETE_COMMIT: {S.PREPARE_COMMIT},
    S.COMPLETE_ABORT: {S.PREPARE_ABORT},
    S.DEAD: {S.EMPTY, S.COMPLETE_COMMIT, S.COMPLETE_ABORT},
    S.PREPARE_EPOCH_FENCE: {S.ONGOING},
}


def in_state(state: TxnState, epoch: int = 3, producer_id: int = 41) -> TxnMetadata:
    """Valid metadata in ``state``: an open one holds a transaction started at 100."""
    if state in OPEN:
        return TxnMetadata(TID, producer_id, epoch, 1000, state, frozenset({Q1}),
                           frozenset({"g1"}), start_ms=100, update_ms=150)
    return TxnMetadata(TID, producer_id, epoch, 1000, state, update_ms=150)


def one_line_error(exc_info, *words):
    msg = str(exc_info.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_state_ids_are_stable_and_the_table_is_kafkas():
    assert [(s.name, s.value) for s in TxnState] == [
        ("EMPTY", 0), ("ONGOING", 1), ("PREPARE_COMMIT", 2), ("PREPARE_ABORT", 3),
        ("COMPLETE_COMMIT", 4), ("COMPLETE_ABORT", 5), ("DEAD", 6), ("PREPARE_EPOCH_FENCE", 7)]
    assert VALID_PREVIOUS == {s: frozenset(prev) for s, prev in KAFKA_TABLE.items()}
    assert all(type(v) is frozenset for v in VALID_PREVIOUS.values())
    assert OPEN == {S.ONGOING, S.PREPARE_COMMIT, S.PREPARE_ABORT, S.PREPARE_EPOCH_FENCE}
    assert CLOSED == set(TxnState) - OPEN


def test_every_pair_is_allowed_or_refused_as_the_table_says():
    allowed = refused = 0
    for frm, to in itertools.product(TxnState, TxnState):
        meta = in_state(frm)
        if frm in KAFKA_TABLE[to]:
            new = transition(meta, to, now_ms=500)
            assert (new.state, new.update_ms, new.transactional_id) == (to, 500, TID)
            allowed += 1
        else:
            with pytest.raises(InvalidTxnStateError) as e:
                transition(meta, to, now_ms=500)
            one_line_error(e, repr(TID), frm.name, to.name)
            assert e.value.code == "INVALID_TXN_STATE"
            refused += 1
    assert (allowed, refused) == (16, 48)


def test_a_walk_reaches_every_state():
    seen = []
    m, _ = init_producer(None, TID, 7, 1000, now_ms=0)
    for to in (S.ONGOING, S.PREPARE_COMMIT, S.COMPLETE_COMMIT, S.ONGOING, S.PREPARE_EPOCH_FENCE,
               S.PREPARE_ABORT, S.COMPLETE_ABORT, S.EMPTY, S.DEAD):
        m = transition(m, to, now_ms=len(seen) + 1, queues=[Q1] if to is S.ONGOING else ())
        seen.append(m.state)
    assert set(seen) | {S.EMPTY} == set(TxnState)
    with pytest.raises(InvalidTxnStateError):  # DEAD is final
        transition(m, S.EMPTY, now_ms=99)


def test_ongoing_accumulates_queues_and_groups_and_keeps_its_start():
    m = transition(in_state(S.EMPTY), S.ONGOING, 200, queues=[Q1], groups=["g1"])
    assert (m.queues, m.groups, m.start_ms, m.update_ms) == ({Q1}, {"g1"}, 200, 200)
    m = transition(m, S.ONGOING, 300, queues=[list(Q2)], groups=("g2",))
    assert (m.queues, m.groups, m.start_ms, m.update_ms) == ({Q1, Q2}, {"g1", "g2"}, 200, 300)
    m = transition(m, S.ONGOING, 400, queues=[Q1])  # already in: no change but the time
    assert (m.queues, m.start_ms, m.epoch) == ({Q1, Q2}, 200, 3)
    for done in (S.COMPLETE_COMMIT, S.COMPLETE_ABORT):  # a new transaction starts empty
        fresh = transition(in_state(done), S.ONGOING, 900, queues=[Q2])
        assert (fresh.queues, fresh.groups, fresh.start_ms) == ({Q2}, set(), 900)


def test_prepare_keeps_the_transaction_complete_clears_it_and_bumps_the_epoch():
    ongoing = transition(in_state(S.EMPTY), S.ONGOING, 200, queues=[Q1, Q2], groups=["g1"])
    for prep, done in ((S.PREPARE_COMMIT, S.COMPLETE_COMMIT), (S.PREPARE_ABORT, S.COMPLETE_ABORT)):
        p = transition(ongoing, prep, 300)
        assert (p.queues, p.groups, p.start_ms, p.epoch) == ({Q1, Q2}, {"g1"}, 200, 3)
        c = transition(p, done, 400)
        assert (c.queues, c.groups, c.start_ms, c.update_ms) == (set(), set(), -1, 400)
        assert (c.producer_id, c.epoch) == (41, 4)  # a late marker at epoch 3 is fenced
    fence = transition(ongoing, S.PREPARE_EPOCH_FENCE, 300)
    assert (fence.queues, fence.epoch, fence.start_ms) == ({Q1, Q2}, 3, 200)
    for closed in (S.EMPTY, S.DEAD):  # no bump outside COMPLETE_*
        m = transition(in_state(S.COMPLETE_ABORT), closed, 500)
        assert (m.epoch, m.queues, m.start_ms) == (3, set(), -1)


def test_explicit_values_and_misuse_of_the_keywords():
    m = transition(in_state(S.COMPLETE_COMMIT), S.EMPTY, 10, epoch=9, timeout_ms=5000)
    assert (m.epoch, m.timeout_ms, m.producer_id) == (9, 5000, 41)
    assert transition(in_state(S.PREPARE_COMMIT), S.COMPLETE_COMMIT, 10, epoch=3).epoch == 3
    assert transition(in_state(S.EMPTY), int(S.ONGOING), 10).state is S.ONGOING
    bad = [(S.PREPARE_COMMIT, S.COMPLETE_COMMIT, dict(queues=[Q1])),
           (S.ONGOING, S.PREPARE_ABORT, dict(groups=["g"])),
           (S.ONGOING, S.PREPARE_ABORT, dict(producer_id=99)),
           (S.COMPLETE_ABORT, S.EMPTY, dict(producer_id=41)),  # "new" id is the current one
           (S.EMPTY, S.ONGOING, dict(queues=[(0, "t")])),
           (S.EMPTY, S.ONGOING, dict(queues=[(-1, "t", 0)])),
           (S.EMPTY, S.ONGOING, dict(groups=[7])),
           (S.EMPTY, S.EMPTY, dict(epoch=MAX_EPOCH + 1)),
           (S.EMPTY, S.EMPTY, dict(timeout_ms=0))]
    for frm, to, kw in bad:
        with pytest.raises(InvalidTxnStateError) as e:
            transition(in_state(frm), to, 10, **kw)
        one_line_error(e, repr(TID))
    for to in (8, "ONGOING", None):
        with pytest.raises(InvalidTxnStateError):
            transition(in_state(S.EMPTY), to, 10)


def test_init_producer_starts_and_fences_previous_instances():
    m, drive = init_producer(None, TID, 7, 1000, now_ms=5)
    assert drive is None and m == TxnMetadata(TID, 7, 0, 1000, S.EMPTY, update_ms=5)
    for state in (S.EMPTY, S.COMPLETE_COMMIT, S.COMPLETE_ABORT):
        m, drive = init_producer(in_state(state), TID, 99, 2000, now_ms=600)
        assert drive is None
        assert (m.state, m.producer_id, m.epoch, m.timeout_ms, m.update_ms) == (
            S.EMPTY, 41, 4, 2000, 600)


def test_init_producer_aborts_an_open_transaction_first():
    ongoing = transition(in_state(S.EMPTY), S.ONGOING, 200, queues=[Q1, Q2], groups=["g1"])
    fenced, drive = init_producer(ongoing, TID, 99, 2000, now_ms=300)
    assert drive is S.PREPARE_ABORT
    assert (fenced.state, fenced.producer_id, fenced.epoch) == (S.PREPARE_ABORT, 41, 4)
    assert (fenced.queues, fenced.groups, fenced.timeout_ms) == ({Q1, Q2}, {"g1"}, 1000)
    with pytest.raises(ConcurrentTransactionsError):  # until its abort completed
        init_producer(fenced, TID, 99, 2000, now_ms=310)
    aborted = transition(fenced, S.COMPLETE_ABORT, 320)  # after the abort markers
    assert (aborted.epoch, aborted.queues) == (5, set())
    m, drive = init_producer(aborted, TID, 99, 2000, now_ms=330)
    assert (drive, m.state, m.producer_id, m.epoch, m.timeout_ms) == (None, S.EMPTY, 41, 6, 2000)


def test_init_producer_refusals():
    for state in (S.PREPARE_COMMIT, S.PREPARE_ABORT, S.PREPARE_EPOCH_FENCE):
        with pytest.raises(ConcurrentTransactionsError) as e:
            init_producer(in_state(state), TID, 99, 1000, now_ms=10)
        one_line_error(e, repr(TID), state.name)
        assert (e.value.code, e.value.retriable) == ("CONCURRENT_TRANSACTIONS", True)
        assert isinstance(e.value, RayMQError)
    with pytest.raises(InvalidTxnStateError) as e:
        init_producer(in_state(S.DEAD), TID, 99, 1000, now_ms=10)
    one_line_error(e, "DEAD")
    with pytest.raises(InvalidTxnStateError) as e:
        init_producer(in_state(S.EMPTY), "other", 99, 1000, now_ms=10)
    one_line_error(e, repr(TID), "'other'")
    assert InvalidTxnStateError.retriable is False


def test_an_exhausted_epoch_moves_to_a_new_producer_id():
    assert [epoch_exhausted(e) for e in (0, MAX_EPOCH - 2, MAX_EPOCH - 1, MAX_EPOCH)] == [
        False, False, True, True]
    m, _ = init_producer(in_state(S.COMPLETE_COMMIT, epoch=MAX_EPOCH - 2), TID, 99, 1000, 10)
    assert (m.producer_id, m.epoch) == (41, MAX_EPOCH - 1)  # the highest epoch a producer gets
    m, _ = init_producer(m, TID, 99, 1000, 20)
    assert (m.producer_id, m.epoch) == (99, 0)
    done = transition(in_state(S.PREPARE_COMMIT, epoch=MAX_EPOCH - 2), S.COMPLETE_COMMIT, 10)
    assert (done.producer_id, done.epoch) == (41, MAX_EPOCH - 1)
    exhausted = in_state(S.PREPARE_COMMIT, epoch=MAX_EPOCH - 1)
    with pytest.raises(InvalidTxnStateError) as e:
        transition(exhausted, S.COMPLETE_COMMIT, 10)
    one_line_error(e, repr(TID), "exhausted")
    done = transition(exhausted, S.COMPLETE_COMMIT, 10, producer_id=99)
    assert (done.producer_id, done.epoch, done.state) == (99, 0, S.COMPLETE_COMMIT)
    # an open transaction at the highest client epoch can still be fenced, then rotates
    fenced, _ = init_producer(in_state(S.ONGOING, epoch=MAX_EPOCH - 1), TID, 99, 1000, 10)
    assert fenced.epoch == MAX_EPOCH
    aborted = transition(fenced, S.COMPLETE_ABORT, 20, producer_id=99)
    assert (aborted.producer_id, aborted.epoch) == (99, 0)


def test_json_round_trip_is_stable():
    for state in TxnState:
        meta = in_state(state)
        assert TxnMetadata.from_json(meta.to_json()) == meta
    m = transition(in_state(S.EMPTY), S.ONGOING, 200, queues=[Q2, Q1], groups=["b", "a"])
    assert m.to_json() == (
        b'{"epoch":3,"groups":["a","b"],"producer_id":41,"queues":[[0,"orders",1],'
        b'[1,"payments",0]],"start_ms":200,"state":1,"timeout_ms":1000,'
        b'"transactional_id":"orders-tx","update_ms":200,"v":1}')
    back = TxnMetadata.from_json(m.to_json())
    assert back == m and back.state is S.ONGOING and type(back.queues) is frozenset
    odd = TxnMetadata("tx \u00e9\n\"", 1, 0, 1, S.EMPTY)
    assert TxnMetadata.from_json(bytearray(odd.to_json())) == odd


def _garbage() -> list:
    good = json.loads(in_state(S.ONGOING).to_json())

    def changed(**kw):
        d = dict(good, **kw)
        return json.dumps({k: v for k, v in d.items() if v is not ...}).encode()
    return [None, 42, b"", b"not json", b"\xff\xfe{}", b"[]", b"null", b"{}", b"[" * 100_000,
            b'{"v":1}', changed(v=2), changed(v=True), changed(v=...), changed(extra=1),
            changed(epoch=...), changed(state=8), changed(state=-1), changed(state="ONGOING"),
            changed(state=True), changed(epoch=1.0), changed(epoch=True),
            changed(epoch=MAX_EPOCH + 1), changed(epoch=-1), changed(producer_id=-1),
            changed(timeout_ms=0), changed(start_ms=-2), changed(update_ms="5"),
            changed(transactional_id=""), changed(transactional_id=7),
            changed(queues=[[0, "t"]]), changed(queues=[[0, 1, 2]]), changed(queues="abc"),
            changed(queues=[[0, [1], 2]]), changed(queues={"a": 1}), changed(queues=5),
            changed(groups=[1]), changed(groups=[["g"]]), changed(groups="g"),
            changed(state=0),  # EMPTY holding a transaction's queues and start
            changed(state=4, queues=[], groups=[])]  # COMPLETE_COMMIT with a start


def test_from_json_refuses_garbage_with_one_line():
    cases = _garbage()
    for data in cases:
        with pytest.raises(InvalidTxnStateError) as e:
            TxnMetadata.from_json(data)
        one_line_error(e)
    assert len(cases) == 40


def test_expired_and_is_open():
    m = in_state(S.ONGOING)  # started at 100, timeout 1000
    assert [m.expired(t) for t in (100, 1100, 1101)] == [False, False, True]
    for state in TxnState:
        meta = in_state(state)
        assert meta.is_open() == (state in (S.ONGOING, S.PREPARE_COMMIT, S.PREPARE_ABORT,
                                            S.PREPARE_EPOCH_FENCE))
        assert meta.expired(10**9) == (state is S.ONGOING)  # preparing: not the timeout's


def test_error_messages_stay_one_line():
    meta = TxnMetadata("a\nb", 1, 0, 1000, S.EMPTY)
    with pytest.raises(InvalidTxnStateError) as e:
        transition(meta, S.PREPARE_COMMIT, 10)
    one_line_error(e, "EMPTY", "PREPARE_COMMIT")


def test_metadata_and_errors_survive_pickling():  # as they cross Ray calls
    meta = transition(in_state(S.EMPTY), S.ONGOING, 200, queues=[Q1], groups=["g1"])
    assert pickle.loads(pickle.dumps(meta)) == meta
    for err in (InvalidTxnStateError("x to y"), ConcurrentTransactionsError("busy")):
        back = pickle.loads(pickle.dumps(err))
        assert (type(back), str(back), back.code) == (type(err), str(err), err.code)


def test_one_class_per_error_code():
    for name, code in (("InvalidTxnStateError", "INVALID_TXN_STATE"),
                       ("ConcurrentTransactionsError", "CONCURRENT_TRANSACTIONS")):
        ours = {"InvalidTxnStateError": InvalidTxnStateError,
                "ConcurrentTransactionsError": ConcurrentTransactionsError}[name]
        assert getattr(errors, name, ours) is ours and ours.code == code


@pytest.mark.parametrize("state", list(TxnState))
def test_a_transaction_of_one_request_moves_as_its_three_moves_would_in_one_step(state):
    """``committed_alone`` (issue 37) is ONGOING, PREPARE_COMMIT and COMPLETE_COMMIT in one
    step: the same metadata from where those moves are valid, refused elsewhere."""
    meta = in_state(state)
    try:
        three = transition(transition(transition(meta, S.ONGOING, 500, queues=[Q1]),
                                      S.PREPARE_COMMIT, 500), S.COMPLETE_COMMIT, 500)
    except InvalidTxnStateError:
        three = None
    if three is None or state is S.ONGOING:  # (from ONGOING it would commit writes before it)
        with pytest.raises(InvalidTxnStateError):
            committed_alone(meta, 500)
    else:
        assert committed_alone(meta, 500) == three and three.epoch == meta.epoch + 1
    with pytest.raises(InvalidTxnStateError, match="exhausted"):
        committed_alone(in_state(S.COMPLETE_COMMIT, epoch=MAX_EPOCH - 1), 500)
