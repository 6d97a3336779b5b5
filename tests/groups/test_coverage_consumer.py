"""Behaviours the README promises that no other test covered, on the session cluster:
tag expressions, what is committed when a queue moves to another member (after poll(),
and in the middle of a run() batch), the queues keyless sends go to, and a call that
cannot answer in time."""
from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from raymq import Message, rpc
from raymq.consumer import Consumer
from raymq.producer import STICKY_MESSAGES, Producer
from raymq.storage.errors import RequestTimeoutError
from tests.helpers import wait_for
from tests.client.test_cluster import Tuned, read_to_end

pytestmark = pytest.mark.ray


class NamedConsumer(Consumer):
    """A consumer whose member id the test picks.  The controller gives a group's queues
    out in blocks by sorted member id (RocketMQ's averaged allocation), so with one queue
    the member whose id sorts first owns it: the test knows which way a queue moves."""

    def __init__(self, mq, group, topics, member_id: str, **kwargs):
        self._chosen_id = member_id
        super().__init__(mq, group, topics, **kwargs)

    @property
    def member_id(self) -> str:
        return self._chosen_id

    @member_id.setter
    def member_id(self, _value) -> None:  # Consumer.__init__ sets a random one
        pass


def committed(mq, group: str, topic: str, qid: int = 0) -> int:
    shard = mq.routes_for({topic})[topic][qid]
    return mq.transport.call(shard, "get_offsets", group, [(topic, qid)],
                             timeout_s=30)[(topic, qid)]


# ------------------------------------------------------------------ tags
def test_tag_expressions_or_and_star(mq, name):
    mq.create_topic(name, queues=2)
    p = mq.producer("p")
    tags = ["paid", "refunded", "new", None]
    p.send_batch([Message(name, f"{i}".encode(), tags=tags[i % 4]) for i in range(80)])
    p.close()
    expect = {
        "paid || refunded": [i for i in range(80) if i % 4 in (0, 1)],
        " paid||new ": [i for i in range(80) if i % 4 in (0, 2)],  # spaces do not matter
        "*": list(range(80)),  # everything, untagged messages too
    }
    for k, (expression, wanted) in enumerate(expect.items()):
        c = mq.consumer(f"g{name}-{k}", [name], tags=expression)
        got = read_to_end(c, mq, [name])  # every queue to its end: nothing else can come
        c.close()
        assert sorted(int(m.body) for m in got) == wanted, expression


# ------------------------------------------------- a queue changing hands
def test_a_queue_moved_after_poll_is_committed_where_poll_stopped(mq, name):
    """With poll(), what poll returned counts as consumed when the queue is released (as
    with Kafka's auto-commit); what the old member had fetched beyond it does not."""
    mq.create_topic(name, queues=1)
    group = f"g{name}"
    p = mq.producer("p")
    p.send_batch([Message(name, f"{i}".encode()) for i in range(20)])
    old = NamedConsumer(mq, group, [name], "z-old")
    assert (name, 0) in old.assignment()
    first = []
    while len(first) < 5:
        first += old.poll(5 - len(first), 5.0)
    assert [m.source_offset for m in first] == [0, 1, 2, 3, 4]
    assert old._buffered > 0  # fetched ahead: these must not count as consumed
    new = NamedConsumer(mq, group, [name], "a-new")  # sorts first: the queue moves to it
    wait_for(lambda: (name, 0) in new.assignment(), what="the queue moving to the new member")
    assert (name, 0) not in old.assignment()
    assert committed(mq, group, name) == 5
    got = read_to_end(new, mq, [name])
    assert [m.source_offset for m in got] == list(range(5, 20))  # from there on, once
    new.close()
    old.close()
    assert committed(mq, group, name) == 20
    p.close()


def test_a_queue_moved_in_the_middle_of_a_run_batch_is_committed_before_that_batch(mq, name):
    """run(): the old member finishes its batch before the queue moves -- waiting up to
    half a session.  A handler stuck longer does not hold the queue: it moves, and its
    commit stops before the batch still in handlers, so the new owner gets that batch
    again (at least once) and nothing after it is lost."""
    mq.create_topic(name, queues=1)
    group = f"g{name}"
    p = mq.producer("p")
    p.send_batch([Message(name, f"{i}".encode()) for i in range(30)])
    old = NamedConsumer(mq, group, [name], "z-old")
    batches, stuck, go, handled = [], threading.Event(), threading.Event(), []
    real_poll = old._poll

    def recording_poll(*args, **kwargs):  # what each of run()'s batches took
        out = real_poll(*args, **kwargs)
        if out:
            batches.append([m.source_offset for m in out])
        return out
    old._poll = recording_poll

    def handler(m):
        if m.source_offset == 10:
            stuck.set()
            go.wait(60)  # (a database lock)
        handled.append(m.source_offset)
    runner = threading.Thread(daemon=True, target=old.run, args=(handler,),
                              kwargs={"batch": 8, "threads": 2, "idle_s": 0.2})
    runner.start()
    new = None
    try:
        assert stuck.wait(30)
        asked_s = time.monotonic()
        new = NamedConsumer(mq, group, [name], "a-new")  # sorts first: the queue moves to it
        wait_for(lambda: (name, 0) not in old.assignment(), 30, "the old member releasing")
        waited_s = time.monotonic() - asked_s
        assert not go.is_set() and 10 not in handled  # released with offset 10 in a handler
        # it waited for the batch first, up to half a session (a lower bound: a busy
        # machine only makes the wait longer)
        assert waited_s >= 0.9 * mq.config.session_timeout_ms / 2000
        [batch] = [b for b in batches if 10 in b]
        assert committed(mq, group, name) == batch[0] < 10  # not past the stuck message
        wait_for(lambda: (name, 0) in new.assignment(), what="the new owner taking it")
    finally:
        go.set()
        old.stop()  # (run() ends after the batch it is on)
    got = read_to_end(new, mq, [name])
    assert [m.source_offset for m in got] == list(range(batch[0], 30))  # the batch again, on
    runner.join(30)
    assert not runner.is_alive()
    # the old member finished its batch after the move and committed nothing for it
    assert sorted(handled) == list(range(batch[-1] + 1))
    assert committed(mq, group, name) == batch[0]
    new.close()
    old.close()
    assert committed(mq, group, name) == 30
    p.close()


# ------------------------------------------------------ where keyless sends go
def test_keyless_send_batch_goes_to_one_queue_per_chunk(mq, name):
    """Kafka's sticky partitioning for batches: a keyless send_batch goes to one queue per
    chunk of batch_max_messages (here 10, a client setting), the queues taken in turn."""
    mq.create_topic(name, queues=4)
    p = Producer(Tuned(mq, batch_max_messages=10), "p")
    first = p.send_batch([Message(name, f"a{i}".encode()) for i in range(25)])
    assert [r.queue_id for r in first] == [0] * 10 + [1] * 10 + [2] * 5
    second = p.send_batch([Message(name, f"b{i}".encode()) for i in range(14)])
    assert [r.queue_id for r in second] == [3] * 10 + [0] * 4  # the turn goes on
    p.close()
    for results in (first, second):  # a chunk is stored together, in order
        for q in {r.queue_id for r in results}:
            offs = [r.queue_offset for r in results if r.queue_id == q]
            assert offs == list(range(offs[0], offs[0] + len(offs)))
    c = mq.consumer(f"g{name}", [name])
    got = read_to_end(c, mq, [name])
    c.close()
    by_queue = {q: [m.body for m in got if m.queue_id == q] for q in range(4)}
    a = [f"a{i}".encode() for i in range(25)]
    b = [f"b{i}".encode() for i in range(14)]
    assert {q: sorted(bodies) for q, bodies in by_queue.items()} == {
        0: sorted(a[:10] + b[10:]), 1: sorted(a[10:20]), 2: sorted(a[20:]), 3: sorted(b[:10])}


def test_keyless_single_sends_stay_on_a_queue_then_move_on(mq, name):
    """Keyless single sends share the topic's sticky queue for STICKY_MESSAGES sends, then
    the next queue (round-robin per message would fail both checks)."""
    mq.create_topic(name, queues=4)
    p = mq.producer("p")
    queues = [p.send(Message(name, b"x")).queue_id for _ in range(5 * STICKY_MESSAGES)]
    p.close()
    assert queues == [turn % 4 for turn in range(5) for _ in range(STICKY_MESSAGES)]
    p = mq.producer("p")  # from many threads: the count holds however they interleave
    per_queue, lock = Counter(), threading.Lock()

    def sender():
        for _ in range(60):
            q = p.send(Message(name, b"y")).queue_id
            with lock:
                per_queue[q] += 1
    threads = [threading.Thread(daemon=True, target=sender) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    p.close()
    # 480 sends: turns of 64 on queues 0, 1, 2, 3, 0, 1, 2 and the last 32 on 3
    assert dict(per_queue) == {0: 128, 1: 128, 2: 128, 3: 96}


# -------------------------------------------------------------- time-outs
def long_poll_that_outlasts(call, mq, name: str, timeout_s: float = 0.5):
    """A long poll of an empty queue answers after its wait (5 s): given ``timeout_s`` it
    cannot answer in time.  The error it raised, and how long the caller waited."""
    shard = mq.routes_for({name})[name][0]
    start = time.monotonic()
    with pytest.raises(Exception) as err:
        call(shard, [(name, 0, 0, 10)], 5000, timeout_s)
    return err.value, time.monotonic() - start


def test_a_ray_call_that_cannot_answer_in_time_is_a_retriable_request_timeout(mq, name):
    mq.create_topic(name, queues=1)
    err, waited_s = long_poll_that_outlasts(
        lambda shard, reqs, wait_ms, timeout_s: rpc.call(mq.shard_handle(shard).pull, reqs,
                                                         wait_ms, timeout_s=timeout_s), mq, name)
    assert type(err) is RequestTimeoutError and err.retriable and err.code == "REQUEST_TIMEOUT"
    assert 0.5 <= waited_s < 4.5  # at its own time-out, not when the shard answered


def test_a_direct_call_that_cannot_answer_in_time_is_a_retriable_request_timeout(mq, name):
    mq.create_topic(name, queues=1)
    shard = mq.routes_for({name})[name][0]
    for _ in range(2):  # on a fresh connection, then on a pooled one
        mq.transport.call(shard, "get_offsets", "nobody", [(name, 0)], timeout_s=30)
        err, waited_s = long_poll_that_outlasts(
            lambda shard, reqs, wait_ms, timeout_s: mq.transport.call(
                shard, "pull", reqs, wait_ms, timeout_s=timeout_s), mq, name)
        assert type(err) is RequestTimeoutError and err.retriable, repr(err)
        assert 0.5 <= waited_s < 1.5  # at its own time-out, once
        # the late answer is never read as the answer to a later call
        assert mq.transport.call(shard, "get_offsets", "nobody", [(name, 0)],
                                 timeout_s=30) == {(name, 0): -1}
