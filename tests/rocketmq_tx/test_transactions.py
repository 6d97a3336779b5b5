"""RocketMQ-style transactional messages on the session cluster."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
import ray

from raymq import LocalTransactionState as S
from raymq import Message, TransactionListener, rpc
from raymq.message import SendStatus
from raymq.storage.errors import InvalidMessageError, RayMQError
from tests.helpers import wait_for
from tests.client.test_cluster import read_to_end, wait_restarted
from tests.helpers import ROOT

pytestmark = pytest.mark.ray


class Listener(TransactionListener):
    """Executes by returning ``arg`` (or raising it); checks answer from ``self.db``."""

    def __init__(self, check_answer=S.COMMIT_MESSAGE):
        self.db: dict[str, object] = {}
        self.check_answer = check_answer
        self.checked: list[str] = []

    def execute_local_transaction(self, msg, arg):
        txid = msg[0].transaction_id if isinstance(msg, list) else msg.transaction_id
        self.db[txid] = arg
        if isinstance(arg, Exception):
            raise arg
        return arg

    def check_local_transaction(self, msg):
        self.checked.append(msg.transaction_id)
        return self.check_answer


def consume_all(mq, group, topics, expected: int, timeout_s: float = 30.0, *,
                delayed: bool = False) -> list:
    """What a new consumer of ``group`` reads of ``topics``: ``expected`` messages, and then
    whatever else there is, which is proven to be nothing more by state, not by a quiet
    window: once no half of these topics is pending (a pending half may still commit; a
    resolved one never does) and, with ``delayed``, nothing waits in a delay level, the
    consumer reads every queue to its end."""
    c = mq.consumer(group, topics)
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < expected and time.monotonic() < deadline:
        got += c.poll(100, 0.3)
    wait_for(lambda: not [h for h in mq.admin.half_list() if h["topic"] in topics],
             timeout_s, "no half of the topics pending")
    if delayed:
        wait_for(lambda: not any(n for s in mq.admin.status()["shards"]
                                 for n in s["info"]["schedule_pending"].values()),
                 timeout_s, "nothing waiting in the delay levels")
    got += read_to_end(c, mq, topics, timeout_s=timeout_s)
    c.close()
    return got


def pending(mq, group):
    return [h for h in mq.admin.half_list() if h["group"] == group]


def test_every_branch_of_the_flow(mq, name):
    mq.create_topic(name, queues=2)
    group = f"p{name}"
    lst = Listener(check_answer=S.COMMIT_MESSAGE)
    tp = mq.transaction_producer(group, lst)
    commit = tp.send_in_transaction(Message(name, b"commit"), S.COMMIT_MESSAGE)
    rollback = tp.send_in_transaction(Message(name, b"rollback"), S.ROLLBACK_MESSAGE)
    unknown = tp.send_in_transaction(Message(name, b"unknown"), S.UNKNOW)
    raised = tp.send_in_transaction(Message(name, b"raised"), RuntimeError("db down"))
    none = tp.send_in_transaction(Message(name, b"none"), None)
    assert commit.local_state is S.COMMIT_MESSAGE and rollback.local_state is S.ROLLBACK_MESSAGE
    assert unknown.local_state is raised.local_state is none.local_state is S.UNKNOW
    wait_for(lambda: not pending(mq, group), what="every half resolved by check-back")
    got = consume_all(mq, f"g{name}", [name], 4)
    assert sorted(m.body for m in got) == [b"commit", b"none", b"raised", b"unknown"]
    ids = {m.body: m.msg_id for m in got}
    assert ids[b"commit"] == commit.msg_id  # the id the producer got is the one consumers see
    assert set(lst.checked) == {unknown.transaction_id, raised.transaction_id,
                                none.transaction_id}
    tp.close()


def test_a_send_that_is_not_ok_rolls_back_without_running_the_local_transaction(mq, name):
    mq.create_topic(name, queues=1)
    group = f"p{name}"
    lst = Listener(check_answer=S.COMMIT_MESSAGE)  # a check would commit: none may happen
    tp = mq.transaction_producer(group, lst)
    handle = mq.shard_handle(mq.routes_for({name})[name][0])
    rpc.call(handle.set_fault, "flush_disk_timeout")  # stored, but not known durable
    try:
        res = tp.send_in_transaction(Message(name, b"unsure"), S.COMMIT_MESSAGE)
    finally:
        rpc.call(handle.set_fault, None)
    assert res.send_status is SendStatus.FLUSH_DISK_TIMEOUT
    assert res.local_state is S.ROLLBACK_MESSAGE
    assert lst.db == {}  # the local transaction never ran
    wait_for(lambda: not pending(mq, group), what="the half rolled back by its end")
    tp.send_in_transaction(Message(name, b"sure"), S.COMMIT_MESSAGE)
    got = consume_all(mq, f"g{name}", [name], 1)
    assert [m.body for m in got] == [b"sure"]
    assert lst.checked == []  # settled by the producer's end, not by a check-back
    tp.close()


def test_wrong_group_or_transaction_is_refused_and_late_ends_are_harmless(mq, name):
    mq.create_topic(name, queues=1)
    group = f"p{name}"
    tp = mq.transaction_producer(group, Listener(check_answer=S.UNKNOW))
    res = tp.send_in_transaction(Message(name, b"x"), S.UNKNOW)
    shard, origin = res.results[0][5], res.results[0][6]
    handle = mq.shard_handle(shard)
    with pytest.raises(InvalidMessageError, match="does not match"):
        rpc.call(handle.end_transaction, "other-group", res.transaction_id, [origin],
                 "COMMIT_MESSAGE")
    with pytest.raises(InvalidMessageError, match="does not match"):
        rpc.call(handle.end_transaction, group, "other-tx", [origin], "COMMIT_MESSAGE")
    assert [h["origin"] for h in pending(mq, group)] == [origin]  # still pending
    assert rpc.call(handle.end_transaction, group, res.transaction_id, [origin],
                    "COMMIT_MESSAGE") == "COMMITTED"
    for state in ("COMMIT_MESSAGE", "ROLLBACK_MESSAGE"):  # duplicate and late: nothing happens
        assert rpc.call(handle.end_transaction, group, res.transaction_id, [origin], state) == "NOOP"
    got = consume_all(mq, f"g{name}", [name], 1)
    assert [m.body for m in got] == [b"x"]
    tp.close()


def test_delay_level_is_honoured_after_commit_without_a_loop(mq, name):
    mq.create_topic(name, queues=1)
    group = f"p{name}"
    tp = mq.transaction_producer(group, Listener())
    level = 4
    t0 = int(time.time() * 1000)
    res = tp.send_in_transaction(Message(name, b"later", delay_level=level), S.COMMIT_MESSAGE)
    got = consume_all(mq, f"g{name}", [name], 1, delayed=True)
    assert [m.body for m in got] == [b"later"]  # once: no half <-> schedule loop
    assert got[0].store_ms >= t0 + mq.config.delay_levels_ms[level - 1]
    assert got[0].msg_id == res.msg_id
    assert not pending(mq, group)
    tp.close()


def test_no_live_producer_check_not_counted_half_kept_until_one_registers(mq, name):
    mq.create_topic(name, queues=1)
    group = f"p{name}"
    tp = mq.transaction_producer(group, Listener(check_answer=S.UNKNOW))
    res = tp.send_in_transaction(Message(name, b"orphan"), S.UNKNOW)
    tp.close()  # no live instance of the group any more
    # (while the producer was still closing, a round may have checked the half once: it
    # was live then; what matters is that nothing is counted from here on)
    mq.admin.check_now()  # a round begun while it was live has ended by now
    [half] = pending(mq, group)
    before = half["checks"]
    assert before <= 1
    # rounds a check-back interval apart: the half is due in each (its timeout, or its
    # back-off, has passed since it was stored or last checked), so had any of them
    # counted a check, the half would have expired by the last
    rounds = mq.config.txn_max_checks + 1
    for _ in range(rounds):
        mq.admin.check_now()
        time.sleep(max(mq.config.txn_timeout_ms, mq.config.txn_check_backoff_max_ms) / 1000)
    [half] = pending(mq, group)
    assert half["checks"] == before and half["waiting_for_producer"]
    assert not [h for h in mq.admin.half_list(expired=True) if h["group"] == group]
    st = mq.admin.status()["transactions"]
    assert any(group in t["groups_without_live_producer"] for t in st)
    # a new process of the group comes up: it answers the check
    tp2 = mq.transaction_producer(group, Listener(check_answer=S.COMMIT_MESSAGE))
    wait_for(lambda: not pending(mq, group), what="the orphan half committed by the new instance")
    got = consume_all(mq, f"g{name}", [name], 1)
    assert [m.msg_id for m in got] == [res.msg_id]
    tp2.close()


def test_max_checks_move_to_expired_and_operator_resolves(mq, name):
    mq.create_topic(name, queues=1)
    group = f"p{name}"
    lst = Listener(check_answer=S.UNKNOW)
    tp = mq.transaction_producer(group, lst)
    res = tp.send_in_transaction(Message(name, b"undecided"), S.UNKNOW)
    expired = wait_for(lambda: [h for h in mq.admin.half_list(expired=True) if h["group"] == group],
                       what="the half expired after the maximum checks")
    # each check counted was asked once (a check still queued is not pushed twice)
    assert lst.checked == [res.transaction_id] * mq.config.txn_max_checks
    assert not pending(mq, group)
    assert expired[0]["id"] == res.msg_id
    assert mq.admin.half_resolve(expired[0]["id"], "commit") == "COMMITTED"
    assert mq.admin.half_resolve(expired[0]["id"], "commit") == "NOOP"  # a duplicate
    # a conflicting end is no silent NOOP (issue 11): the operator is told what it became
    with pytest.raises(InvalidMessageError, match="already COMMITTED"):
        mq.admin.half_resolve(expired[0]["id"], "rollback")
    assert not [h for h in mq.admin.half_list(expired=True) if h["group"] == group]
    got = consume_all(mq, f"g{name}", [name], 1)
    assert [m.body for m in got] == [b"undecided"]
    tp.close()


def test_check_storm_is_bounded_per_group_and_round(mq, name):
    mq.create_topic(name, queues=2)
    group = f"p{name}"
    slow = threading.Event()

    class Slow(Listener):
        def check_local_transaction(self, msg):
            slow.wait(0.05)  # a slow listener does not stall the round
            return super().check_local_transaction(msg)
    tp = mq.transaction_producer(group, Slow())
    n = 120
    for i in range(n):
        tp.send_in_transaction(Message(name, f"{i}".encode()), S.UNKNOW)
    limit = mq.config.txn_max_checks_per_group
    seen = []
    deadline = time.monotonic() + 60
    while pending(mq, group) and time.monotonic() < deadline:
        for sent in mq.admin.check_now():
            seen.append(sent.get(group, 0))
    assert not pending(mq, group)
    assert max(seen) == limit  # per group and round, over all the shards: reached, not passed
    got = consume_all(mq, f"g{name}", [name], n)
    assert sorted(int(m.body) for m in got) == list(range(n))
    tp.close()


def test_a_hung_listener_takes_no_more_checks_than_it_can_answer(mq, name):
    """An instance whose check threads are all stuck (a database lock) leaves the other
    checks at the registry, where another instance takes them; nothing expires meanwhile."""
    from raymq import deploy
    from raymq.actors.rocketmq_tx.checker import registry_for
    mq.create_topic(name, queues=1)
    group = f"p{name}"
    release, stuck = threading.Event(), threading.Event()

    class Hung(Listener):
        def check_local_transaction(self, msg):
            stuck.set()
            release.wait(60)
            return super().check_local_transaction(msg)
    hung = mq.transaction_producer(group, Hung(), check_threads=1)
    a = hung.send_in_transaction(Message(name, b"a"), S.UNKNOW)
    b = hung.send_in_transaction(Message(name, b"b"), S.UNKNOW)
    registry = deploy.get_registry(registry_for(group, mq.config.num_registries))
    try:
        assert stuck.wait(30)
        # the other check waits at the registry instead of behind the stuck one
        wait_for(lambda: rpc.call(registry.status)[group]["queued_checks"] >= 1,
                 what="a check left at the registry")
        helper = Listener(check_answer=S.COMMIT_MESSAGE)
        other = mq.transaction_producer(group, helper)
        wait_for(lambda: len(pending(mq, group)) <= 1, what="the other instance settles one")
        assert helper.checked and not [h for h in mq.admin.half_list(expired=True)
                                        if h["group"] == group]
    finally:
        release.set()
    wait_for(lambda: not pending(mq, group), what="both settled")
    got = consume_all(mq, f"g{name}", [name], 2)
    assert sorted(m.msg_id for m in got) == sorted([a.msg_id, b.msg_id])
    other.close()
    hung.close()


def test_close_waits_for_a_transaction_running_its_local_transaction(mq, name):
    """close() while a send_in_transaction is inside its local transaction: the end of
    that transaction still goes out (check-back would find no live instance)."""
    mq.create_topic(name, queues=1)
    group = f"p{name}"
    entered, go = threading.Event(), threading.Event()

    class Slow(Listener):
        def execute_local_transaction(self, msg, arg):
            entered.set()
            go.wait(30)
            return super().execute_local_transaction(msg, arg)
    lst = Slow(check_answer=S.ROLLBACK_MESSAGE)
    tp = mq.transaction_producer(group, lst)
    results = []
    sender = threading.Thread(daemon=True, target=lambda: results.append(tp.send_in_transaction(
        Message(name, b"paid"), S.COMMIT_MESSAGE, timeout_ms=60_000)))
    sender.start()
    assert entered.wait(30)
    closer = threading.Thread(daemon=True, target=tp.close)
    closer.start()

    def closed():
        try:
            tp.send_in_transaction(Message(name, b"late"), S.COMMIT_MESSAGE)
        except RayMQError as err:
            return "closed" in str(err)
        return False
    wait_for(closed, what="the producer refusing new transactions")
    # a close that did not wait would be done within this window on an idle machine; on a
    # busy one it might not, but it would have closed the producer first, and the end
    # lost: the check-back (ROLLBACK) would then take the message away (checked below)
    closer.join(2)
    assert closer.is_alive() and not tp._producer._closed  # close waits for the transaction
    go.set()
    sender.join(30)
    closer.join(30)
    assert not closer.is_alive() and results[0].local_state is S.COMMIT_MESSAGE
    got = consume_all(mq, f"g{name}", [name], 1)
    assert [m.msg_id for m in got] == [results[0].msg_id]
    assert lst.checked == [] and not pending(mq, group)


def test_batch_transaction_across_topics_all_or_nothing(mq, name):
    other = f"{name}-b"
    mq.create_topic(name, queues=2)
    mq.create_topic(other, queues=3)
    group = f"p{name}"
    tp = mq.transaction_producer(group, Listener(check_answer=S.ROLLBACK_MESSAGE))
    yes = [Message(name, b"a1"), Message(other, b"b1"), Message(other, b"b2", key="k")]
    no = [Message(name, b"x1"), Message(other, b"y1")]
    r = tp.send_in_transaction(yes, S.COMMIT_MESSAGE)
    assert [x.topic for x in r.results] == [name, other, other]  # one result per message
    assert {x.status for x in r.results} == {SendStatus.SEND_OK}
    tp.send_in_transaction(no, S.ROLLBACK_MESSAGE)
    tp.send_in_transaction([Message(name, b"u1"), Message(other, b"u2")], S.UNKNOW)  # -> rollback
    wait_for(lambda: not pending(mq, group), what="all halves resolved")
    got = consume_all(mq, f"g{name}", [name, other], 3)
    assert sorted(m.body for m in got) == [b"a1", b"b1", b"b2"]
    tp.close()


def test_a_batch_with_one_part_not_stored_durably_rolls_back_every_part(mq, name):
    mq.create_topic(name, queues=1)
    first = mq.routes_for({name})[name][0]
    other = None
    for i in range(8):  # a second topic on another shard
        candidate = f"{name}-{i}"
        mq.create_topic(candidate, queues=1)
        if mq.routes_for({candidate})[candidate][0] != first:
            other = candidate
            break
    assert other is not None
    group = f"p{name}"
    lst = Listener(check_answer=S.COMMIT_MESSAGE)
    tp = mq.transaction_producer(group, lst)
    handle = mq.shard_handle(mq.routes_for({other})[other][0])
    rpc.call(handle.set_fault, "flush_disk_timeout")
    try:
        r = tp.send_in_transaction([Message(name, b"a"), Message(other, b"b")],
                                   S.COMMIT_MESSAGE)
    finally:
        rpc.call(handle.set_fault, None)
    assert r.send_status is SendStatus.FLUSH_DISK_TIMEOUT
    assert r.local_state is S.ROLLBACK_MESSAGE and lst.db == {}
    wait_for(lambda: not pending(mq, group), what="both halves rolled back")
    tp.send_in_transaction([Message(name, b"c"), Message(other, b"d")], S.COMMIT_MESSAGE)
    got = consume_all(mq, f"g{name}", [name, other], 2)
    assert sorted(m.body for m in got) == [b"c", b"d"]
    tp.close()


def kill_inside_the_commit_put(mq, name, point: str):
    """A transaction of 3 messages of 3 MiB (its commit's one put -- the real messages,
    then the op records -- spans two frames of at most 8 MiB) whose commit kills its
    shard at storage crash point ``point`` of that put: the production path, not a
    fault's own.  The end call is not retried; the producer's check answers ROLLBACK,
    so a commit that did not survive the crash is rolled back.  Returns what a new
    consumer reads once the half is resolved, and the transaction's result."""
    mq.create_topic(name, queues=1)
    group = f"p{name}"
    shard = mq.routes_for({name})[name][0]
    handle = mq.shard_handle(shard)
    lst = Listener(check_answer=S.ROLLBACK_MESSAGE)
    tp = mq.transaction_producer(group, lst)
    bodies = [bytes([i]) * (3 * 1024 * 1024) for i in range(3)]
    res = tp.send_in_transaction([Message(name, b) for b in bodies], S.UNKNOW)
    before = rpc.call(handle.ping)["pid"]
    rpc.call(handle.set_fault, f"crash_at:{point}")
    with pytest.raises(RayMQError):  # the shard died in the put: no answer
        rpc.call(handle.end_transaction.options(max_task_retries=0), group,
                 res.transaction_id, [r.phys_offset for r in res.results], "COMMIT_MESSAGE",
                 timeout_s=60)
    assert rpc.call(handle.ping, timeout_s=60)["pid"] != before  # it did die
    wait_for(lambda: not pending(mq, group), what="the half resolved after the restart")
    got = consume_all(mq, f"g{name}", [name], 3 if point == "put.appended" else 0)
    tp.close()
    return got, bodies, res, lst


@pytest.mark.slow
def test_a_commit_cut_between_the_frames_of_its_one_put_leaves_nothing(mq, name):
    """Killed after the real messages' frame, before the op records' frame: recovery
    cuts the partial put, so no real message is visible and the half still pending;
    the check-back (ROLLBACK) decides it -- nothing of the transaction is delivered."""
    got, _bodies, res, lst = kill_inside_the_commit_put(mq, name, "put.partly_appended")
    assert got == []
    assert res.transaction_id in lst.checked  # it was the check-back that decided


@pytest.mark.slow
def test_a_commit_whose_one_put_was_written_survives_a_kill_before_indexing(mq, name):
    """Killed after the whole put is in the log, before it is indexed: recovery indexes
    it, the half is committed (the check-back's ROLLBACK comes too late), and each real
    message is delivered exactly once, with the producer's message id."""
    got, bodies, res, lst = kill_inside_the_commit_put(mq, name, "put.appended")
    assert [m.body for m in got] == bodies
    assert [m.msg_id for m in got] == res.msg_ids
    assert res.transaction_id not in lst.checked  # recovered resolved: never asked


def actor_pid(handle):
    """The process id of a checker or registry (None while it is between processes)."""
    try:
        return rpc.call(handle.ping, timeout_s=30)["pid"]
    except RayMQError:
        return None


@pytest.mark.slow
def test_checker_and_registry_killed_mid_round(mq, name):
    """The checker and the registry die while a round's checks are out: every half
    pending, some checks held by the producer's listener, the rest queued at the
    registry (lost with it).  After the restarts every half commits, exactly once."""
    mq.create_topic(name, queues=2)
    group = f"p{name}"
    answer = threading.Event()
    held = []

    class Held(Listener):
        def check_local_transaction(self, msg):
            held.append(msg.transaction_id)
            answer.wait(60)  # unanswered until the two are dead
            return super().check_local_transaction(msg)
    tp = mq.transaction_producer(group, Held(check_answer=S.COMMIT_MESSAGE), check_threads=4)
    try:
        for i in range(30):
            tp.send_in_transaction(Message(name, f"{i}".encode()), S.UNKNOW)
        from raymq import deploy
        checker, registry = deploy.get_checker(0), mq.registry_handle(group)
        pids = actor_pid(checker), actor_pid(registry)

        def checks_out():  # the round's checks: 4 taken (as many as check threads), the rest queued
            return len(held) == 4 and rpc.call(registry.status)[group]["queued_checks"] >= 1
        wait_for(checks_out, what="a round's checks out: held by the listener and queued")
        assert len(pending(mq, group)) == 30  # none answered: all pending when they die
        ray.kill(checker, no_restart=False)
        ray.kill(registry, no_restart=False)
        # the kill landed: both answer from new processes
        wait_for(lambda: actor_pid(checker) not in (None, pids[0]), 60, "a new checker")
        wait_for(lambda: actor_pid(registry) not in (None, pids[1]), 60, "a new registry")
    finally:
        answer.set()
    wait_for(lambda: not pending(mq, group), timeout_s=60, what="halves resolved after restarts")
    got = consume_all(mq, f"g{name}", [name], 30)
    # each exactly once: a check asked again after the restarts commits nothing twice
    assert sorted(int(m.body) for m in got) == list(range(30))
    assert not [h for h in mq.admin.half_list(expired=True) if h["group"] == group]
    tp.close()


@pytest.mark.slow
def test_producer_process_killed_after_db_commit_another_instance_answers(mq, name, tmp_path):
    mq.create_topic(name, queues=1)
    group = f"p{name}"
    db = str(tmp_path / "orders.db")
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE orders(tx TEXT PRIMARY KEY, item TEXT)")
    con.commit()
    con.close()
    address = ray.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-m", "tests.tx_producer_process", address, db, name,
                           group], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert proc.returncode == 9, proc.stderr[-2000:]
    txid = proc.stdout.split("COMMITTED ")[1].split()[0]
    assert [h["transaction_id"] for h in pending(mq, group)] == [txid]

    class FromDb(TransactionListener):
        def check_local_transaction(self, msg):
            con = sqlite3.connect(db)
            row = con.execute("SELECT 1 FROM orders WHERE tx = ?", (msg.transaction_id,)).fetchone()
            con.close()
            return S.COMMIT_MESSAGE if row else S.ROLLBACK_MESSAGE
    tp = mq.transaction_producer(group, FromDb())
    wait_for(lambda: not pending(mq, group), what="the dead producer's transaction settled")
    got = consume_all(mq, f"g{name}", [name], 1)
    assert [m.body for m in got] == [b"order-from-the-dead"]
    tp.close()


def test_async_transactions_many_in_flight_from_one_thread(mq, name):
    mq.create_topic(name, queues=4)
    group = f"p{name}"
    lst = Listener(check_answer=S.ROLLBACK_MESSAGE)
    tp = mq.transaction_producer(group, lst)
    states = [S.COMMIT_MESSAGE if i % 3 else S.ROLLBACK_MESSAGE for i in range(90)]
    futures = [tp.send_in_transaction_async(Message(name, f"{i}".encode()), st)
               for i, st in enumerate(states)]
    results = [f.result(60) for f in futures]
    assert [r.local_state for r in results] == states
    assert len({r.transaction_id for r in results}) == 90
    got = consume_all(mq, f"g{name}", [name], 60)
    assert sorted(int(m.body) for m in got) == [i for i in range(90) if i % 3]
    assert not pending(mq, group)
    tp.close()


@pytest.mark.slow
def test_shards_killed_under_concurrent_transactions_commit_once_abort_never(mq, name):
    """Transactions from several threads while every shard of the topic is killed: halves,
    ends riding on requests and resends cross the restarts.  Every transaction whose local
    commit ran is delivered exactly once; nothing else is delivered; no half is left."""
    mq.create_topic(name, queues=4)
    group = f"p{name}"
    lock = threading.Lock()
    committed: set[bytes] = set()

    class Db(TransactionListener):
        def execute_local_transaction(self, msg, arg):
            if arg is S.COMMIT_MESSAGE:
                with lock:
                    committed.add(msg.body)
            return arg

        def check_local_transaction(self, msg):  # the local database decides
            with lock:
                return S.COMMIT_MESSAGE if msg.body in committed else S.ROLLBACK_MESSAGE
    tp = mq.transaction_producer(group, Db())
    done, errors, stop = [0], [], threading.Event()

    def stream(t):
        i = 0
        while not stop.is_set():
            state = S.ROLLBACK_MESSAGE if i % 3 == 0 else S.COMMIT_MESSAGE
            try:  # a long transaction timeout: no check-back races a local transaction here
                tp.send_in_transaction(Message(name, f"{t}-{i}".encode()), state,
                                       timeout_ms=5000)
            except Exception as err:  # not stored: its local transaction never ran
                errors.append(err)
            with lock:
                done[0] += 1
            i += 1
    threads = [threading.Thread(daemon=True, target=stream, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: done[0] >= 100, what="some transactions done")
    shards = sorted(set(mq.routes_for({name})[name]))
    pids = {s: rpc.call(mq.shard_handle(s).ping, timeout_s=30)["pid"] for s in shards}
    for s in shards:
        ray.kill(mq.shard_handle(s), no_restart=False)

    def restarted():
        try:
            return all(rpc.call(mq.shard_handle(s).ping, timeout_s=30)["pid"] != pids[s]
                       for s in shards)
        except rpc.RayMQError:
            return False
    wait_for(restarted, 90, "the shards restarted")
    after = done[0]
    wait_for(lambda: done[0] >= after + 100, 90, "transactions after the restart")
    stop.set()
    for t in threads:
        t.join(120)
    assert len(errors) < done[0] / 2
    wait_for(lambda: not pending(mq, group), timeout_s=90, what="every half resolved")
    got = consume_all(mq, f"g{name}", [name], len(committed), timeout_s=60)
    bodies = [m.body for m in got]
    assert len(bodies) == len(set(bodies))  # none delivered twice
    assert set(bodies) == committed  # every local commit delivered, no rollback delivered
    tp.close()


@pytest.mark.slow
def test_close_finishes_the_async_transactions_in_flight(mq, name):
    mq.create_topic(name, queues=2)
    group = f"p{name}"
    tp = mq.transaction_producer(group, Listener())
    # in flight for a while: the shards restart under them (a long transaction timeout:
    # none is late, so every one commits)
    shards = sorted(set(mq.routes_for({name})[name]))
    before = {s: rpc.call(mq.shard_handle(s).ping, timeout_s=30)["pid"] for s in shards}
    futures = [tp.send_in_transaction_async(Message(name, f"{i}".encode()), S.COMMIT_MESSAGE,
                                            timeout_ms=60_000) for i in range(300)]
    for s in shards:
        ray.kill(mq.shard_handle(s), no_restart=False)
    in_flight = sum(not f.done() for f in futures)  # (a future never goes back to not done)
    tp.close()  # at once, with most of them still in flight
    assert in_flight > 0  # close() had transactions to finish
    wait_restarted(mq, before)  # the kill landed: the shards answer from new processes
    assert all(f.done() for f in futures)
    assert [f.result().local_state for f in futures] == [S.COMMIT_MESSAGE] * 300
    with pytest.raises(RayMQError, match="closed"):
        tp.send_in_transaction_async(Message(name, b"late"), S.COMMIT_MESSAGE)
    got = consume_all(mq, f"g{name}", [name], 300, timeout_s=60)
    assert sorted(int(m.body) for m in got) == list(range(300))
    assert not pending(mq, group)
