"""The broker cluster on a session-scoped local Ray: send, consume, groups, failures."""
from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest
import ray

from raymq import Message, SendStatus
from raymq import rpc
from raymq.actors.config import ClusterConfig
from raymq.consumer import Consumer
from raymq.message import key_queue, make_msg_id, retry_topic
from raymq.storage.errors import (InvalidMessageError, OffsetOutOfRangeError, RayMQError,
                                  ReservedNameError, UnknownTopicError)
from raymq.storage.records import RecordBatch
from tests.helpers import wait_for

pytestmark = pytest.mark.ray


def drain(consumer, n: int, timeout_s: float = 30.0) -> list:
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += consumer.poll(500, 0.5)
    return got


def keys_for_queues(queues: int) -> list[str]:
    """A message key for each queue of a topic of ``queues`` queues: key i hashes to queue i."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < queues:
        found.setdefault(key_queue(f"k{i}", queues), f"k{i}")
        i += 1
    return [found[q] for q in range(queues)]


def queue_ends(mq, topic: str, isolation: str = "read_committed") -> dict[tuple[str, int], int]:
    """The end (next offset) of every queue of ``topic`` for a reader of ``isolation``, as
    its shards answer now."""
    ends = {}
    # a retry topic is read by its own group only
    group = topic[len("%RETRY%"):] if topic.startswith("%RETRY%") else None
    for qid, shard in enumerate(mq.routes_for({topic})[topic]):
        [(_t, _q, _batch, _next, end)] = mq.transport.call(shard, "pull", [(topic, qid, 0, 0)], 0,
                                                           None, group, isolation, timeout_s=30)
        ends[(topic, qid)] = end
    return ends


def read_to_end(consumer, mq, topics, *, queues=None, timeout_s: float = 30.0) -> list:
    """Poll until the consumer owns ``queues`` (default: every queue of ``topics``), has
    fetched each to the end it had when this began, and has handed out all it fetched.

    What those queues held is then delivered (or filtered out at the shard): "nothing
    more arrives" is proven by the consumer's positions, not by a quiet window that a
    slow bug could outlast.
    """
    ends = {}
    for t in topics:
        ends.update(queue_ends(mq, t, consumer.isolation))
    if queues is not None:
        ends = {q: e for q, e in ends.items() if q in set(queues)}
    got = []

    def at_end():
        got.extend(consumer.poll(500, 0.2))
        with consumer._lock:
            held = consumer._queues
            return not consumer._buffered and all(
                q in held and held[q].fetch >= end for q, end in ends.items())
    wait_for(at_end, timeout_s, f"the consumer at the end of {sorted(ends)}")
    return got


class Tuned:
    """The session client with client-side settings of a test's own: producers and
    consumers read theirs (pull sizes, batch sizes, lanes) from ``mq.config``, and the
    session cluster's own config is shared by every test."""

    def __init__(self, mq, **settings):
        self._mq = mq
        self.config = ClusterConfig.from_dict({**mq.config.to_dict(), **settings})

    def __getattr__(self, name):
        return getattr(self._mq, name)


def pids_of(mq, shards) -> dict[int, int]:
    """The process id of each shard (its actor's ``ping``; waits for a restarting one)."""
    return {s: rpc.call(mq.shard_handle(s).ping, timeout_s=90)["pid"] for s in shards}


def process_gone(pid: int) -> bool:
    """Whether a local process has exited (a zombie left for its parent counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_restarted(mq, before: dict[int, int], timeout_s: float = 90) -> dict[int, int]:
    """Wait until every shard of ``before`` answers from another process than it did
    (``ray.kill`` returns before the process is gone: a ping right after it may still
    reach the old one); the new process ids.  Times out if a kill did not land."""
    def pids():
        try:
            now = pids_of(mq, before)
        except RayMQError:  # between the two processes
            return None
        return now if all(now[s] != before[s] for s in before) else None
    return wait_for(pids, timeout_s, f"shards {sorted(before)} in new processes")


def test_send_consume_round_trip(mq, name):
    mq.create_topic(name, queues=4)
    p = mq.producer("p")
    msgs = [Message(name, f"body-{i}".encode(), key=f"k{i % 7}", tags="a" if i % 2 else "b",
                    properties={"i": str(i)}) for i in range(300)]
    results = p.send_batch(msgs)
    assert all(r.status is SendStatus.SEND_OK for r in results)
    assert len({r.msg_id for r in results}) == 300
    c = mq.consumer(f"g{name}", [name])
    got = drain(c, 300)
    assert sorted(int(m.properties["i"]) for m in got) == list(range(300))
    by_id = {r.msg_id: r for r in results}
    for m in got:
        r = by_id[m.msg_id]
        assert (m.queue_id, m.queue_offset, m.topic) == (r.queue_id, r.queue_offset, name)
        i = int(m.properties["i"])
        assert m.body == f"body-{i}".encode() and m.key == f"k{i % 7}"
    c.commit_async()
    wait_for(lambda: all(q.committed == q.position for q in c._queues.values()),
             what="the async commit acknowledged")
    c.close()
    again = mq.consumer(f"g{name}", [name])  # committed: nothing again
    assert read_to_end(again, mq, [name]) == []
    assert {q: again._queues[q].committed for q in queue_ends(mq, name)} == queue_ends(mq, name)
    p.send(Message(name, b"one more"))
    assert [m.body for m in drain(again, 1)] == [b"one more"]
    again.close()
    p.close()


def test_same_key_same_queue_in_order_from_many_threads(mq, name):
    mq.create_topic(name, queues=4)
    p = mq.producer("p")

    def sender(key):
        for i in range(150):
            p.send(Message(name, f"{key}:{i}".encode(), key=key))
    threads = [threading.Thread(daemon=True, target=sender, args=(f"key{k}",)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c = mq.consumer(f"g{name}", [name])
    got = drain(c, 600)
    seen = defaultdict(list)
    queues = defaultdict(set)
    for m in got:
        key, i = m.body.decode().split(":")
        seen[key].append(int(i))
        queues[key].add(m.queue_id)
    assert all(seen[k] == list(range(150)) for k in seen) and len(seen) == 4
    assert all(len(q) == 1 for q in queues.values())
    c.close()
    p.close()


def test_tag_filter(mq, name):
    mq.create_topic(name, queues=2)
    p = mq.producer("p")
    p.send_batch([Message(name, f"{i}".encode(), tags=("paid" if i % 3 == 0 else "new"))
                  for i in range(60)])
    c = mq.consumer(f"g{name}", [name], tags="paid")
    got = read_to_end(c, mq, [name])  # every queue read to its end: nothing else can come
    assert sorted(int(m.body) for m in got) == list(range(0, 60, 3))
    assert {m.tags for m in got} == {"paid"}
    c.close()


def test_consumer_group_rebalance_three_join_one_dies(mq, name):
    mq.create_topic(name, queues=6)
    group = f"g{name}"
    members = [mq.consumer(group, [name]) for _ in range(3)]

    def owned():
        return [set(q for q in c.assignment() if q[0] == name) for c in members]

    def balanced():
        sets = owned()
        return all(len(s) == 2 for s in sets) and len(set().union(*sets)) == 6
    wait_for(balanced, what="6 queues split 2/2/2")
    sets = owned()
    assert not (sets[0] & sets[1]) and not (sets[1] & sets[2]) and not (sets[0] & sets[2])

    p = mq.producer("p")
    p.send_batch([Message(name, f"{i}".encode()) for i in range(120)])
    # member 2 dies: no more heartbeats, no leave
    dead = members[2]
    dead._stop.set()
    dead._hb.join()
    survivors = members[:2]

    def taken_over():
        sets = [set(q for q in c.assignment() if q[0] == name) for c in survivors]
        return len(set().union(*sets)) == 6 and not (sets[0] & sets[1])
    got = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (taken_over() and len({m.body for m in got}) == 120):
        for c in survivors:
            got += c.poll(200, 0.2)
    assert taken_over()
    assert {int(m.body) for m in got} == set(range(120))  # nothing lost (at least once)
    for c in survivors:
        c.close()
    p.close()


def test_retry_then_dead_letter_then_resend(mq, name):
    mq.create_topic(name, queues=1)
    group = f"g{name}"
    p = mq.producer("p")
    sent = p.send(Message(name, b"poison", key="bad"))
    attempts = []
    c = mq.consumer(group, [name])

    def failing(m):
        attempts.append((m.msg_id, m.reconsume_count, m.topic))
        raise RuntimeError("cannot handle")
    runner = threading.Thread(daemon=True, target=c.run, args=(failing,), kwargs={"idle_s": 0.2})
    runner.start()
    dlq = wait_for(lambda: mq.admin.dlq_list(group), what="a dead letter")
    c.stop()
    runner.join()
    max_reconsume = mq.config.max_reconsume
    assert [a[1] for a in attempts] == list(range(max_reconsume + 1))
    assert {a[0] for a in attempts} == {sent.msg_id}  # the original id all along
    assert {a[2] for a in attempts} == {name}
    assert len(dlq) == 1 and dlq[0].body == b"poison"
    assert "RuntimeError" in dlq[0].properties["DLQ_REASON"]
    c.close()

    resent = mq.admin.dlq_resend(group)
    assert resent == [dlq[0].stored_id]
    assert mq.admin.dlq_resend(group) == []  # progress is kept
    ok = []
    c2 = mq.consumer(group, [name])
    runner = threading.Thread(daemon=True, target=c2.run, args=(ok.append,), kwargs={"idle_s": 0.2})
    runner.start()
    wait_for(lambda: ok, what="the resent message")
    c2.stop()
    runner.join()
    assert ok[0].body == b"poison" and ok[0].msg_id == sent.msg_id and ok[0].topic == name
    c2.close()
    p.close()


def test_a_failed_message_that_cannot_be_sent_back_is_handled_again(mq, name):
    """The retry copy cannot be written (its shard restarting): the message must not be
    committed past -- it comes again -- and run() goes on."""
    from raymq.storage.errors import BrokerUnavailableError
    mq.create_topic(name, queues=1)
    p = mq.producer("p")
    for i in range(4):
        p.send(Message(name, f"m{i}".encode()))
    c = mq.consumer(f"g{name}", [name])
    real_nack, refused = c.nack, []

    def nack(m, reason=""):  # the fault: the first give-back finds the shard unavailable
        if not refused:
            refused.append(m.body)
            raise BrokerUnavailableError("shard restarting")
        return real_nack(m, reason)
    c.nack = nack
    seen = []

    def handler(m):
        seen.append(m.body)
        return not (m.body == b"m1" and seen.count(b"m1") == 1)  # fails the first time
    runner = threading.Thread(daemon=True, target=c.run, args=(handler,), kwargs={"idle_s": 0.2})
    runner.start()
    wait_for(lambda: seen.count(b"m1") >= 2 and b"m3" in seen[seen.index(b"m1") + 1:],
             what="m1 handled again after its failed give-back")
    c.stop()
    runner.join(30)
    assert not runner.is_alive() and refused == [b"m1"]
    assert seen.count(b"m1") == 2  # once failed, once handled; no retry copy was made
    assert mq.admin.dlq_list(f"g{name}") == []
    c.close()
    shard = mq.routes_for({name})[name][0]
    assert mq.transport.call(shard, "get_offsets", f"g{name}", [(name, 0)],
                             timeout_s=30) == {(name, 0): 4}  # everything was committed
    assert set(queue_ends(mq, retry_topic(f"g{name}")).values()) == {0}  # no retry copy
    c2 = mq.consumer(f"g{name}", [name])  # so nothing comes again
    assert read_to_end(c2, mq, [name]) == []
    c2.close()
    p.close()


def test_a_message_that_keeps_failing_to_be_sent_back_is_retried_with_pauses(mq, name):
    """Its shard stays unable to write the retry copy for a while: run() must not spin
    on the message (handling it again and again at full speed)."""
    import time as _time

    from raymq.storage.errors import BrokerUnavailableError
    mq.create_topic(name, queues=1)
    p = mq.producer("p")
    p.send(Message(name, b"bad"))
    c = mq.consumer(f"g{name}", [name])
    real_nack, refusals = c.nack, []

    def nack(m, reason=""):  # the first five give-backs find the shard unable
        if len(refusals) < 5:
            refusals.append(_time.monotonic())
            raise BrokerUnavailableError("shard restarting")
        return real_nack(m, reason)
    c.nack = nack
    runner = threading.Thread(daemon=True, target=c.run, args=(lambda m: False,),
                              kwargs={"idle_s": 0.2})
    runner.start()
    wait_for(lambda: len(refusals) == 5, what="five refused give-backs")
    c.stop()
    runner.join(30)
    c.close()
    p.close()
    # pauses of 0.1, 0.2, 0.4 and 0.8 s between them (growing while it lasts)
    assert refusals[-1] - refusals[0] >= 1.4


def test_delay_levels_are_never_early(mq, name):
    mq.create_topic(name, queues=2)
    p = mq.producer("p")
    levels = mq.config.delay_levels_ms
    sent_ms = {}
    for level in (1, 3, 5):
        sent_ms[level] = int(time.time() * 1000)
        p.send(Message(name, str(level).encode(), delay_level=level))
    c = mq.consumer(f"g{name}", [name])
    got = drain(c, 3)
    wait_for(lambda: not any(n for s in mq.admin.status()["shards"]
                             for n in s["info"]["schedule_pending"].values()),
             what="nothing left waiting in the delay levels")
    got += read_to_end(c, mq, [name])
    assert sorted(int(m.body) for m in got) == [1, 3, 5]  # each delivered, once
    for m in got:
        level = int(m.body)
        assert m.store_ms >= sent_ms[level] + levels[level - 1]
        assert m.properties.get("DELAY") is None and m.topic == name
    c.close()


def test_idempotent_resend_is_stored_once(mq, name):
    mq.create_topic(name, queues=1)
    shard = mq.routes_for({name})[name][0]
    handle = mq.shard_handle(shard)
    batch = RecordBatch(name, 0, [b"a", b"b"])
    first = rpc.call(handle.send, batch, 987654321, 1)
    second = rpc.call(handle.send, batch, 987654321, 1)  # the "timeout" resend
    assert not first.duplicate and second.duplicate
    assert second.queue_offsets == first.queue_offsets
    got = rpc.call(handle.pull, [(name, 0, 0, 10)], 0)
    assert [m.body for m in got[0][2].messages()] == [b"a", b"b"]


@pytest.mark.slow
def test_kill_shard_during_produce_stream_loses_nothing_stores_once(mq, name, monkeypatch):
    mq.create_topic(name, queues=2)
    shards = sorted(set(mq.routes_for({name})[name]))
    assert len(shards) == 2  # one queue on each shard: both are killed under the stream
    keys = keys_for_queues(2)
    p = mq.producer("p")
    results, errors, stop = [], [], threading.Event()
    batches = [0]
    replaced = []  # connections the transport found broken and replaced (then sent again,
    # to the shard's leader as the controller says: a restarted replica leads again)
    direct = mq.transport.inner
    real_replace, real_rerouted = direct._replace, mq.transport.rerouted

    def counted_replace(call, err):
        replaced.append(call.method)
        return real_replace(call, err)

    def counted_rerouted(shard):
        replaced.append("send")  # (only sends go to these shards meanwhile)
        return real_rerouted(shard)
    monkeypatch.setattr(direct, "_replace", counted_replace)
    monkeypatch.setattr(mq.transport, "rerouted", counted_rerouted)

    def stream():  # until told to stop, after the restarts were proven
        try:
            while not stop.is_set():
                i = batches[0]
                results.extend(p.send_batch([Message(name, f"{i}-{j}".encode(), key=keys[j % 2])
                                             for j in range(50)]))
                batches[0] += 1
        except Exception as err:
            errors.append(err)
    t = threading.Thread(daemon=True, target=stream)
    before = pids_of(mq, shards)
    t.start()
    try:
        wait_for(lambda: len(results) >= 300, what="some acknowledged sends")
        retries_before = p.retries
        for s in shards:
            ray.kill(mq.shard_handle(s), no_restart=False)
        wait_restarted(mq, before)  # the kill landed: both answer from new processes
        at_restart = len(results)
        wait_for(lambda: len(results) >= at_restart + 500 or errors, 60,
                 "sends acknowledged by the restarted shards")
    finally:
        stop.set()
    t.join(120)
    assert not errors and not t.is_alive()
    n = batches[0] * 50
    assert len(results) == n and {r.status for r in results} == {SendStatus.SEND_OK}
    # the kill broke requests in flight: sent again by the producer (its retries) or by
    # the transport on a fresh connection (a broken pooled one is replaced once)
    assert p.retries > retries_before or "send" in replaced, (p.retries, replaced)
    c = mq.consumer(f"g{name}", [name])
    got = drain(c, n, timeout_s=60) + read_to_end(c, mq, [name])
    bodies = [m.body for m in got]
    assert len(bodies) == len(set(bodies)) == n  # none lost, none stored twice
    per_queue = defaultdict(list)
    for m in got:
        per_queue[m.queue_id].append(m.queue_offset)
    assert all(offs == list(range(n // 2)) for offs in per_queue.values())
    assert sorted(per_queue) == [0, 1]
    for key in keys:  # producer order per key kept across the restart
        seq = [tuple(map(int, m.body.decode().split("-"))) for m in got if m.key == key]
        assert seq == sorted(seq) and len(seq) == n // 2
    c.close()
    p.close()


@pytest.mark.slow
def test_kill_shard_during_consumption_delivers_everything_in_queue_order(mq, name):
    """Pulls of 20 messages a queue (a client setting of this consumer's own): each queue
    is read partly before the kill and mostly from the restarted shard, which the test
    proves (the positions fetched when the old processes were gone) before it checks
    delivery.  Commits after the restart must go through."""
    batch = 20
    mq.create_topic(name, queues=2)
    shards = sorted(set(mq.routes_for({name})[name]))
    keys = keys_for_queues(2)
    p = mq.producer("p")
    p.send_batch([Message(name, f"{i}".encode(), key=keys[i % 2]) for i in range(1000)])
    group = f"g{name}"
    c = Consumer(Tuned(mq, pull_batch_messages=batch), group, [name])
    got = []
    while len(got) < 300:
        got += c.poll(100, 1.0)
        c.commit()
    before = pids_of(mq, shards)
    fetched_at_restart: dict = {}

    def watch():  # the restart is proven when the new processes answer
        fetched_at_restart["pids"] = wait_restarted(mq, before)
    for s in shards:
        ray.kill(mq.shard_handle(s), no_restart=False)
    # no poll until the old processes are gone (ray.kill returns before): what was
    # fetched by then is all that came from them; every later pull reaches a new one
    wait_for(lambda: all(process_gone(before[s]) for s in shards), 60,
             "the killed shards' processes gone")
    with c._lock:
        fetched_at_restart.update({q: st.fetch for q, st in c._queues.items()
                                   if q[0] == name})
    watcher = threading.Thread(daemon=True, target=watch)
    watcher.start()
    transient = []
    deadline = time.monotonic() + 60
    while len({m.body for m in got}) < 1000 and time.monotonic() < deadline:
        got += c.poll(200, 0.5)
        restarted = "pids" in fetched_at_restart
        try:
            c.commit()
        except RayMQError as err:  # before the restart was proven: the shard may be down
            if restarted or not err.retriable:
                raise
            transient.append(err)
    watcher.join(90)
    assert "pids" in fetched_at_restart, "the shards were not seen restarting"
    after = fetched_at_restart.pop("pids")
    assert all(after[s] != before[s] for s in shards), (before, after)
    # each queue was read on after the restart: at most ~300 of 1000 had been consumed
    # and a few pulls of 20 fetched ahead when the new processes answered
    assert sorted(fetched_at_restart) == [(name, 0), (name, 1)]
    assert all(f <= 400 for f in fetched_at_restart.values()), fetched_at_restart
    assert {int(m.body) for m in got} == set(range(1000))
    per_queue = defaultdict(list)
    for m in got:
        per_queue[m.queue_id].append(m.queue_offset)
    for offs in per_queue.values():
        # forward only one step at a time (no gap); going back is a redelivery of an
        # uncommitted suffix after the restart, which then runs forward in order again
        assert all(b == a + 1 or b <= a for a, b in zip(offs, offs[1:]))
        first_seen = list(dict.fromkeys(offs))
        assert first_seen == list(range(500))
    c.close()
    committed = {}
    for qid, s in enumerate(mq.routes_for({name})[name]):
        committed.update(mq.transport.call(s, "get_offsets", group, [(name, qid)],
                                           timeout_s=30))
    assert committed == {(name, 0): 500, (name, 1): 500}  # the commits reached the new shards
    p.close()


def test_query_by_id_and_key(mq, name):
    mq.create_topic(name, queues=2)
    p = mq.producer("p")
    r = p.send(Message(name, b"find me", key="order-42", tags="t"))
    p.send(Message(name, b"other", key="order-43"))
    [m] = mq.admin.find(r.msg_id)
    assert (m.body, m.key, m.tags, m.topic) == (b"find me", "order-42", "t", name)
    found = mq.admin.find(topic=name, key="order-42")
    assert [x.body for x in found] == [b"find me"]
    with pytest.raises(InvalidMessageError, match="not a RayMQ message id"):
        mq.admin.find("nope")


def test_bad_input_is_rejected_clearly(mq, name):
    mq.create_topic(name, queues=1)
    p = mq.producer("p")
    big = mq.config.max_message_bytes + 1
    with pytest.raises(InvalidMessageError, match="exceeds the maximum"):
        p.send(Message(name, b"x" * big))
    with pytest.raises(InvalidMessageError, match="non-empty"):
        p.send(Message("", b"x"))
    with pytest.raises(InvalidMessageError, match="invalid topic name"):
        p.send(Message("bad/topic", b"x"))
    with pytest.raises(UnknownTopicError, match="does not exist"):
        p.send(Message(f"{name}-missing", b"x"))
    for reserved in ("%RETRY%g", "%DLQ%g", "RMQ_SYS_TRANS_HALF_TOPIC", "SCHEDULE_TOPIC_XXXX"):
        with pytest.raises(ReservedNameError, match="reserved"):
            p.send(Message(reserved, b"x"))
    with pytest.raises(ReservedNameError, match="reserved system properties"):
        p.send(Message(name, b"x", properties={"DELAY": "3"}))
    with pytest.raises(InvalidMessageError, match="delay_level"):
        p.send(Message(name, b"x", delay_level=99))
    with pytest.raises(ReservedNameError):
        mq.create_topic("%DLQ%x")
    c = mq.consumer(f"g{name}", [name])
    c.seek(name, 0, 5)  # past the end of an empty queue
    with pytest.raises(OffsetOutOfRangeError, match="holds offsets 0..0"):
        c.commit()
    c.seek(name, 0, 0)
    c.close()
    # and nothing was stored by any of it
    assert mq.admin.status()["shards"][mq.routes_for({name})[name][0]]["info"]["queues"][f"{name}/0"] == 0
    p.close()


def test_connect_again_reuses_the_running_actors(mq):
    from raymq import connect
    before = [rpc.call(mq.shard_handle(i).ping) for i in range(mq.num_shards)]
    again = connect(num_shards=5)  # the running cluster's config wins
    assert again.num_shards == mq.num_shards
    assert [rpc.call(again.shard_handle(i).ping)["pid"] for i in range(again.num_shards)] == \
        [b["pid"] for b in before]
    assert make_msg_id(1, 255) == "000100000000000000FF"


def test_ordered_mode_handles_each_queue_in_order_and_retries_in_place(mq, name):
    mq.create_topic(name, queues=2)
    p = mq.producer("p")
    p.send_batch([Message(name, f"{k}:{i}".encode(), key=f"key{k}")
                  for i in range(20) for k in range(3)])
    handled = defaultdict(list)
    failed_once = set()

    def handler(m):
        key, i = m.body.decode().split(":")
        if i == "5" and key not in failed_once:
            failed_once.add(key)
            raise RuntimeError("first attempt fails")
        handled[key].append(int(i))
    c = mq.consumer(f"g{name}", [name], ordered=True)
    t = threading.Thread(daemon=True, target=c.run, args=(handler,), kwargs={"idle_s": 0.2})
    t.start()
    wait_for(lambda: sum(len(v) for v in handled.values()) >= 60, what="all handled")
    c.stop()
    t.join()
    assert {k: v for k, v in handled.items()} == {str(k): list(range(20)) for k in range(3)}
    assert failed_once == {"0", "1", "2"}
    assert mq.admin.dlq_list(f"g{name}") == []
    c.close()
    p.close()


def test_ordered_queue_moves_only_after_its_old_owner_finished_its_batch(mq, name):
    mq.create_topic(name, queues=2)
    group = f"g{name}"
    keys = keys_for_queues(2)
    p = mq.producer("p")
    lock, clock, events = threading.Lock(), [0], []  # (who, queue, offset, started, ended)

    def handler_of(who):
        def handler(m):
            with lock:
                clock[0] += 1
                started = clock[0]
            time.sleep(0.02)  # a handler's work
            with lock:
                clock[0] += 1
                events.append((who, m.source_queue, m.source_offset, started, clock[0]))
        return handler
    feeding, fed = threading.Event(), [0]

    def feed():  # both queues keep getting work until a queue has changed hands
        while not feeding.is_set():
            p.send_batch([Message(name, f"{fed[0]}".encode(), key=k) for k in keys])
            fed[0] += 1
            feeding.wait(0.03)
    feeder = threading.Thread(daemon=True, target=feed)
    feeder.start()

    def handed_over():  # a queue a worked on, then b
        with lock:
            return [q for q in (0, 1) if any(e[:2] == ("a", q) for e in events)
                    and sum(1 for e in events if e[:2] == ("b", q)) >= 3]
    try:
        a = mq.consumer(group, [name], ordered=True)
        ta = threading.Thread(daemon=True, target=a.run, args=(handler_of("a"),),
                              kwargs={"idle_s": 0.2, "batch": 8})
        ta.start()
        wait_for(lambda: len(events) >= 3, what="the first consumer at work")
        b = mq.consumer(group, [name], ordered=True)  # one of the two queues moves to it
        tb = threading.Thread(daemon=True, target=b.run, args=(handler_of("b"),),
                              kwargs={"idle_s": 0.2, "batch": 8})
        tb.start()
        [moved] = wait_for(handed_over, what="a queue a worked on handled by b")
    finally:
        feeding.set()
    feeder.join()
    wait_for(lambda: len({(q, o) for _w, q, o, _s, _e in events}) >= 2 * fed[0],
             what="all handled")
    for c, t in ((a, ta), (b, tb)):
        c.stop()
        t.join()
    assert [q for q in b.assignment() if q[0] == name] == [(name, moved)]
    assert [q for q in a.assignment() if q[0] == name] == [(name, 1 - moved)]
    for queue in (0, 1):
        mine = sorted((s, e, o, w) for w, q, o, s, e in events if q == queue)
        # every offset once, in order, each begun after the one before ended -- across
        # the hand-over too (a's batch done before b began)
        assert [o for _s, _e, o, _w in mine] == list(range(fed[0])), f"queue {queue}"
        for (_s1, end1, o1, _w1), (start2, _e2, o2, _w2) in zip(mine, mine[1:]):
            assert start2 > end1, f"queue {queue}: offset {o2} began before {o1} was done"
    owners = [w for _s, _e, _o, w in sorted((s, e, o, w) for w, q, o, s, e in events
                                              if q == moved)]
    assert owners == sorted(owners) and owners[0] == "a" and owners[-1] == "b"  # a, then b
    a.close()
    b.close()
    p.close()


class _Unreachable:
    """A controller this consumer cannot reach (a network partition, as it sees it)."""

    def heartbeat(self, *_args):
        from raymq.storage.errors import BrokerUnavailableError
        raise BrokerUnavailableError("controller unreachable (injected partition)")

    def leave(self, *_args):
        self.heartbeat()


class _Partitioned:
    """The consumer's view of the cluster during the partition: all but the controller."""

    def __init__(self, mq, controller):
        self._mq, self.controller = mq, controller

    def __getattr__(self, name):
        return getattr(self._mq, name)


@pytest.mark.slow
def test_consumer_cut_off_from_the_controller_gives_up_its_queues_without_committing(mq, name):
    mq.create_topic(name, queues=2)
    p = mq.producer("p")
    p.send_batch([Message(name, f"{i}".encode()) for i in range(20)])
    a = mq.consumer(f"g{name}", [name])

    def owned(c):
        return [q for q in c.assignment() if q[0] == name]
    assert len(owned(a)) == 2
    first = []
    while len(first) < 5:
        first += a.poll(5 - len(first), 5.0)  # consumed, not committed
    assert len(first) == 5
    unreachable = ray.remote(_Unreachable).remote()
    a._mq = _Partitioned(mq, unreachable)
    # within a session a's heartbeats fail; it gives its queues up itself
    wait_for(lambda: not a.assignment(), 30, "the partitioned consumer giving up its queues")
    assert a.poll(100, 0.2) == []
    a.commit()  # nothing to commit for: it owns nothing
    b = mq.consumer(f"g{name}", [name])
    wait_for(lambda: len(owned(b)) == 2, 30, "the queues moving to the other member")
    got = read_to_end(b, mq, [name])
    assert sorted(int(m.body) for m in got) == list(range(20))  # nothing lost, nothing twice
    b.commit()
    a._mq = mq  # the partition heals: a rejoins from the committed offsets, sees nothing again
    wait_for(lambda: len(owned(a)) == 1, 30, "a rejoining with one of the two queues")
    assert read_to_end(a, mq, [name], queues=owned(a)) == []
    a.close()
    b.close()
    p.close()
    ray.kill(unreachable)


def test_a_position_past_the_end_comes_back_and_commits_nothing_skipped(mq, name):
    mq.create_topic(name, queues=1)
    p = mq.producer("p")
    p.send_batch([Message(name, f"{i}".encode()) for i in range(5)])
    c = mq.consumer(f"g{name}", [name])
    wait_for(lambda: (name, 0) in c.assignment(), what="the queue assigned")
    c.seek(name, 0, 50)  # past the end: the shard answers with the end (5)
    polled = []
    wait_for(lambda: polled.extend(c.poll(10, 0.2)) or c._queues[(name, 0)].fetch == 5,
             what="the position back at the end")
    assert polled == [] and c._queues[(name, 0)].position == 5
    p.send_batch([Message(name, f"{i}".encode()) for i in range(5, 100)])
    got, deadline = [], time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        got = c.poll(10, 5.0)  # fewer than the 45 between the end and the seek
    assert [m.source_offset for m in got] == list(range(5, 5 + len(got)))
    c.commit()
    shard = mq.routes_for({name})[name][0]
    committed = mq.transport.call(shard, "get_offsets", f"g{name}", [(name, 0)], timeout_s=30)
    assert committed[(name, 0)] == 5 + len(got)  # not the 50 it was moved to
    c.close()
    p.close()


def test_latest_start_is_kept_for_the_next_owner_of_the_queue(mq, name):
    mq.create_topic(name, queues=1)
    group = f"g{name}"
    p = mq.producer("p")
    p.send_batch([Message(name, b"old") for _ in range(5)])  # before the group existed
    a = mq.consumer(group, [name], start_from="latest")
    wait_for(lambda: (name, 0) in a.assignment(), what="the queue assigned")
    p.send_batch([Message(name, f"new-{i}".encode()) for i in range(3)])
    a.close()  # left without polling: nothing of its own to commit
    b = mq.consumer(group, [name], start_from="latest")
    got = drain(b, 3, timeout_s=20)
    assert [m.body for m in got] == [b"new-0", b"new-1", b"new-2"]  # from a's start on
    b.close()
    p.close()


def test_a_topic_grows_and_its_consumers_and_new_producers_use_the_new_queues(mq, name):
    """``alter_topic(queues=)`` (``raymq topic alter --queues``, Kafka's CreatePartitions):
    a topic only grows; a consumer made before reads the new queues from its next
    heartbeat; every message stays where it was."""
    from raymq import Message
    from raymq.storage.errors import InvalidMessageError
    mq.create_topic(name, 2)
    p = mq.producer()
    p.send_batch([Message(name, b"before %d" % i, key=str(i)) for i in range(20)])
    c = mq.consumer(name + "g", [name])
    first = read_to_end(c, mq, [name])
    info = mq.alter_topic(name, queues=5)
    assert info["queues"] == 5 and info["routes"][:2] == mq.describe_topic(name)["routes"][:2]
    with pytest.raises(InvalidMessageError, match="never shrinks"):
        mq.alter_topic(name, queues=3)
    p.send_batch([Message(name, b"after %d" % i, key=str(i)) for i in range(50)])
    later = read_to_end(c, mq, [name])
    c.close()
    p.close()
    assert sorted(m.body for m in first) == sorted(b"before %d" % i for i in range(20))
    assert sorted(m.body for m in later) == sorted(b"after %d" % i for i in range(50))
    assert {m.queue_id for m in later} == {0, 1, 2, 3, 4}  # (keys spread over all five)
