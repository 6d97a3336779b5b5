"""Kafka clients against the listener in front of the session cluster (issue 36): a real
client (kafka-python, none of ours) bootstraps, negotiates the API versions and sees
the cluster's user topics with their queues as partitions -- system, retry and
dead-letter topics not listed."""
from __future__ import annotations

import pytest

from tests.helpers import wait_for

pytestmark = pytest.mark.ray


def test_a_kafka_client_bootstraps_and_sees_the_topics_as_raymq_has_them(mq, name, listener):
    from kafka import KafkaConsumer
    mq.create_topic(name, 3)
    mq.ensure_group_topics(name + "g")  # (a retry and a dead-letter topic: never listed)
    consumer = KafkaConsumer(bootstrap_servers="%s:%d" % listener.address,
                             request_timeout_ms=20_000)
    try:
        topics = wait_for(lambda: name in (t := consumer.topics()) and t,
                          what="the topic in the client's metadata")
        assert not any(t.startswith(("RMQ_SYS_", "%RETRY%", "%DLQ%")) for t in topics)
        assert consumer.partitions_for_topic(name) == {0, 1, 2}
        assert not consumer.partitions_for_topic(name + "nope")  # (unknown: none)
    finally:
        consumer.close()


def test_messages_go_both_ways_with_keys_headers_and_timestamps(mq, name, listener):
    """kafka-python produces through the listener and the SDK reads it; the SDK produces
    and kafka-python reads it from the partition's start (binary keys and repeated headers
    both ways: the storage format's own); ListOffsets answers the log start, the end and
    an offset by time."""
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from raymq import Message
    from tests.client.test_cluster import read_to_end
    mq.create_topic(name, 2)
    boot = "%s:%d" % listener.address
    producer = KafkaProducer(bootstrap_servers=boot, acks="all", enable_idempotence=False,
                             linger_ms=5)
    sent = []
    for i in range(20):
        sent.append(producer.send(name, value=b"kafka %d" % i, partition=i % 2,
                                  key=b"k%d" % i if i % 3 else b"\xff\xfe%d" % i,
                                  headers=[("h", b"%d" % i), ("h", b""), ("x", b"\x00")],
                                  timestamp_ms=1_700_000_000_000 + i))
    producer.flush()
    metas = [f.get(timeout=30) for f in sent]
    assert sorted(m.offset for m in metas if m.partition == 0) == list(range(10))
    producer.close()

    c = mq.consumer(name + "g", [name])
    got = {m.body: m for m in read_to_end(c, mq, [name])}
    c.close()
    assert sorted(got) == sorted(b"kafka %d" % i for i in range(20))
    m = got[b"kafka 1"]
    assert m.key == "k1" and m.born_ms == 1_700_000_000_001
    assert m.headers == [("h", b"1"), ("h", b""), ("x", b"\x00")]
    assert got[b"kafka 0"].key == b"\xff\xfe0" and not got[b"kafka 0"].properties

    p = mq.producer()
    p.send_batch([Message(name, b"sdk %d" % i, key=f"s{i}") for i in range(9)])
    p.send(Message(name, b"sdk 9", key=b"\x00\xffbin",
                   headers=[("trace", b"\x01\x02"), ("trace", None), ("ü", b"")]))
    p.close()
    consumer = KafkaConsumer(bootstrap_servers=boot, enable_auto_commit=False,
                             request_timeout_ms=20_000)
    try:
        tps = [TopicPartition(name, 0), TopicPartition(name, 1)]
        consumer.assign(tps)
        consumer.seek_to_beginning()
        ends = consumer.end_offsets(tps)
        assert consumer.beginning_offsets(tps) == {tp: 0 for tp in tps}
        assert sum(ends.values()) == 30
        seen = []

        def drained():
            for recs in consumer.poll(timeout_ms=500).values():
                seen.extend(recs)
            return all(consumer.position(tp) >= ends[tp] for tp in tps)
        wait_for(drained, what="kafka-python reading both partitions to their ends")
        by_value = {r.value: r for r in seen}
        assert len(seen) == 30 and len(by_value) == 30
        r = by_value[b"kafka 1"]
        assert (r.key, r.timestamp) == (b"k1", 1_700_000_000_001)
        assert list(r.headers) == [("h", b"1"), ("h", b""), ("x", b"\x00")]
        assert by_value[b"kafka 0"].key == b"\xff\xfe0"           # a binary key, as sent
        assert by_value[b"sdk 3"].key == b"s3" and list(by_value[b"sdk 3"].headers) == []
        assert by_value[b"sdk 9"].key == b"\x00\xffbin"
        assert list(by_value[b"sdk 9"].headers) == [("trace", b"\x01\x02"), ("trace", None),
                                                    ("ü", b"")]
        assert all(by_value[b"kafka %d" % i].offset == metas[i].offset for i in range(20))
        # offsets by time: the first message stored at or after a time (store times)
        later = consumer.offsets_for_times({tps[0]: 4_000_000_000_000})
        assert later[tps[0]] is None                              # nothing that recent
    finally:
        consumer.close()


def test_a_kafka_consumer_group_shares_the_partitions_and_resumes_from_its_commits(
        mq, name, listener):
    """Two kafka-python members (each polling in a thread of its own, as applications do)
    split the partitions, every message is handled by exactly one; their commits go to
    RayMQ's offsets store, and a new member resumes from them."""
    import threading
    from kafka import KafkaConsumer
    from raymq import Message
    mq.create_topic(name, 4)
    p = mq.producer()
    p.send_batch([Message(name, b"m%02d" % i) for i in range(40)])
    boot, group = "%s:%d" % listener.address, name + "g"

    def member():
        return KafkaConsumer(name, group_id=group, bootstrap_servers=boot,
                             auto_offset_reset="earliest", enable_auto_commit=False,
                             session_timeout_ms=6000, heartbeat_interval_ms=300,
                             request_timeout_ms=20_000)
    a, b = member(), member()
    got: dict = {a: [], b: []}
    stop = threading.Event()

    def run(c):
        while not stop.is_set():
            for recs in c.poll(timeout_ms=1000).values():
                got[c].extend(r.value for r in recs)
    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in (a, b)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(got[a]) + len(got[b]) >= 40 and a.assignment() and
                 b.assignment(), timeout_s=60, what="two members reading the topic")
        stop.set()
        for t in threads:
            t.join()
        owned_a, owned_b = {tp.partition for tp in a.assignment()}, \
            {tp.partition for tp in b.assignment()}
        assert owned_a | owned_b == {0, 1, 2, 3} and not owned_a & owned_b
        assert sorted(got[a] + got[b]) == [b"m%02d" % i for i in range(40)]  # each once
        a.commit()
        b.commit()
        committed = mq.admin.reset_offsets(group, name, to="latest", dry_run=True)
        # (in RayMQ's offsets store, where `raymq group` shows them: each at its end)
        assert sum(after for _b, after in committed.values()) == 40
        assert all(before == after for before, after in committed.values()), committed
    finally:
        stop.set()
        a.close()
        b.close()
    p.send_batch([Message(name, b"late %d" % i) for i in range(5)])
    p.close()
    c = member()
    later = []
    try:
        wait_for(lambda: later.extend(r.value for recs in c.poll(timeout_ms=1000).values()
                                      for r in recs) or len(later) >= 5,
                 timeout_s=60, what="a new member resuming from the commits")
        assert sorted(later) == [b"late %d" % i for i in range(5)]  # nothing before them
    finally:
        c.close()


def test_librdkafka_produces_and_a_group_of_it_consumes_with_keys_headers_and_times(
        mq, name, listener):
    """confluent-kafka (librdkafka, the client most Kafka applications use) through the
    listener: a producer with its defaults, a group consumer subscribing."""
    from confluent_kafka import Consumer, Producer
    mq.create_topic(name, 2)
    boot = "%s:%d" % listener.address
    p = Producer({"bootstrap.servers": boot, "linger.ms": 5})
    for i in range(30):
        p.produce(name, value=b"v%d" % i, key=b"k%d" % i, headers=[("h", b"%d" % i)],
                  partition=i % 2, timestamp=1_700_000_000_000 + i)
    assert p.flush(30) == 0
    c = Consumer({"bootstrap.servers": boot, "group.id": name + "g",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe([name])
    got = []
    try:
        def drained():
            m = c.poll(0.5)
            if m is not None:
                assert m.error() is None, m.error()
                got.append(m)
            return len(got) >= 30
        wait_for(drained, timeout_s=60, what="librdkafka's group consumer reading 30")
        by_value = {m.value(): m for m in got}
        assert sorted(by_value) == sorted(b"v%d" % i for i in range(30)) and len(got) == 30
        m = by_value[b"v7"]
        assert (m.key(), m.headers(), m.partition()) == (b"k7", [("h", b"7")], 1)
        assert m.timestamp() == (1, 1_700_000_000_007)  # (CreateTime, as sent)
        assert sorted(x.offset() for x in got if x.partition() == 0) == list(range(15))
        c.commit(asynchronous=False)
    finally:
        c.close()
    committed = mq.admin.reset_offsets(name + "g", name, to="latest", dry_run=True)
    assert all(before == after == 15 for before, after in committed.values())


def test_an_idempotent_producer_stores_a_resent_batch_once_and_refuses_a_gap(
        mq, name, listener):
    """librdkafka with ``enable.idempotence`` (the Java client's default) produces in order;
    a batch sent twice (a resend after a lost answer) is stored once and answered with
    the first offsets; a batch past a gap is refused with OUT_OF_ORDER_SEQUENCE_NUMBER."""
    import socket
    from confluent_kafka import Producer
    mq.create_topic(name, 1)
    boot = "%s:%d" % listener.address
    p = Producer({"bootstrap.servers": boot, "enable.idempotence": True, "linger.ms": 2})
    for i in range(200):
        p.produce(name, value=b"%03d" % i, partition=0)
    assert p.flush(30) == 0
    with socket.create_connection(listener.address) as s:
        produce = _raw_idempotent_producer(s, name)
        first = produce(0, 3)
        assert first == (0, 200)
        assert produce(0, 3) == first                 # the same batch again: stored once
        assert produce(5, 2)[0] == 45                 # past a gap (3, 4 never came)
        assert produce(3, 2) == (0, 203)
    bodies = _stored(mq, name)
    assert bodies == [b"%03d" % i for i in range(200)] + [b"raw %d" % i for i in range(5)]


def _raw_idempotent_producer(s, topic: str):
    """``produce(base_seq, n)`` -> (error code, base offset): an idempotent producer's
    batch of ``n`` records to partition 0 of ``topic``, acks=all, over connection ``s``
    (records ``b"raw <sequence>"``)."""
    from kafka.protocol.producer import ProduceRequest
    from kafka.protocol.producer.transaction import InitProducerIdRequest
    from kafka.record import MemoryRecordsBuilder
    from tests.wire.test_frames import ask
    init = ask(s, InitProducerIdRequest(transactional_id=None, transaction_timeout_ms=60_000,
                                        producer_id=-1, producer_epoch=-1), 4)
    assert init.error_code == 0 and init.producer_id > 0
    pid = init.producer_id

    def records(base_seq: int, n: int) -> bytes:
        b = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 20,
                                 producer_id=pid, producer_epoch=0, base_sequence=base_seq)
        for i in range(n):
            b.append(1, None, b"raw %d" % (base_seq + i))
        b.close()
        return bytes(b.buffer())

    def produce(base_seq: int, n: int):
        req = ProduceRequest(transactional_id=None, acks=-1, timeout_ms=30_000,
                             topic_data=[ProduceRequest.TopicProduceData(
                                 name=topic, partition_data=[
                                     ProduceRequest.TopicProduceData.PartitionProduceData(
                                         index=0, records=records(base_seq, n))])])
        [part] = ask(s, req, 9).responses[0].partition_responses
        return part.error_code, part.base_offset
    return produce


def _stored(mq, topic: str) -> list[bytes]:
    """Every body of partition 0 of ``topic``, open transactions' too."""
    return [m.body for m in mq.shard(mq.routes_for({topic})[topic][0]).call(
        "pull", [(topic, 0, 0, 1000)], 0, None, None, "read_uncommitted", timeout_s=30)[0][2]
        .messages()]


def test_a_write_not_known_durable_or_replicated_is_no_success_to_a_kafka_client(
        mq, name, listener):
    """acks=all: a write the shard stored without knowing it durable (FLUSH_DISK_TIMEOUT,
    here the shard's test fault) or held by its in-sync replicas (FLUSH_SLAVE_TIMEOUT) in
    time is answered REQUEST_TIMED_OUT -- retriable, as Kafka answers a write its in-sync
    replicas did not copy in time -- never as written; the idempotent resend is stored
    once and answered with the first write's offset once it is durable."""
    import socket
    from raymq import rpc
    mq.create_topic(name, 1)
    handle = mq.shard_handle(mq.routes_for({name})[name][0])
    with socket.create_connection(listener.address) as s:
        produce = _raw_idempotent_producer(s, name)
        rpc.call(handle.set_fault, "flush_disk_timeout", timeout_s=30)
        try:
            assert produce(0, 2) == (7, -1)  # REQUEST_TIMED_OUT: stored, not known durable
        finally:
            rpc.call(handle.set_fault, None, timeout_s=30)
        assert produce(0, 2) == (0, 0)  # the client's resend: the first write's offset
        assert produce(2, 1) == (0, 2)
    assert _stored(mq, name) == [b"raw 0", b"raw 1", b"raw 2"]


def test_topics_are_created_and_deleted_through_kafkas_admin_client(mq, name, listener):
    from confluent_kafka.admin import AdminClient, NewTopic
    admin = AdminClient({"bootstrap.servers": "%s:%d" % listener.address})
    made = admin.create_topics([
        NewTopic(name, 3, config={"retention.ms": "3600000",
                                  "message.timestamp.type": "CreateTime"}),
        NewTopic(name + "x", 2, config={"cleanup.policy": "compact"}),
        NewTopic(name + "y", 2, config={"message.timestamp.type": "LogAppendTime"})])
    made[name].result(30)
    with pytest.raises(Exception, match="configs not served: cleanup.policy"):
        made[name + "x"].result(30)
    with pytest.raises(Exception, match="configs not served: message.timestamp.type"):
        made[name + "y"].result(30)
    again = admin.create_topics([NewTopic(name, 3)])
    with pytest.raises(Exception, match="TOPIC_ALREADY_EXISTS"):
        again[name].result(30)
    info = mq.describe_topic(name)
    assert len(info["routes"]) == 3 and info["retention_ms"] == 3600_000
    from confluent_kafka import Consumer, Producer, TopicPartition
    from confluent_kafka.admin import NewPartitions
    admin.create_partitions([NewPartitions(name, 5)])[name].result(30)  # (it grows)
    with pytest.raises(Exception, match="INVALID_PARTITIONS"):
        admin.create_partitions([NewPartitions(name, 4)])[name].result(30)
    assert mq.describe_topic(name)["queues"] == 5
    p = Producer({"bootstrap.servers": "%s:%d" % listener.address})
    p.produce(name, value=b"in a new partition", partition=4)
    assert p.flush(30) == 0
    c = Consumer({"bootstrap.servers": "%s:%d" % listener.address, "group.id": name})
    c.assign([TopicPartition(name, 4, 0)])
    assert wait_for(lambda: c.poll(0.5), what="the new partition read").value() == \
        b"in a new partition"
    c.close()
    admin.delete_topics([name])[name].result(30)
    wait_for(lambda: name not in mq.topics(), what="the topic deleted")
    gone = admin.delete_topics([name])
    with pytest.raises(Exception, match="UNKNOWN_TOPIC"):
        gone[name].result(30)


def test_a_group_name_live_in_the_sdk_is_refused_to_kafka_consumers_in_one_line(
        mq, name, listener):
    from confluent_kafka import Consumer
    mq.create_topic(name, 1)
    sdk = mq.consumer(name + "g", [name])
    sdk.poll(1, 0.5)  # (a live member of the SDK's group)
    c = Consumer({"bootstrap.servers": "%s:%d" % listener.address, "group.id": name + "g"})
    try:
        c.subscribe([name])
        errors = []
        wait_for(lambda: (m := c.poll(0.5)) is not None and m.error() and
                 errors.append(m.error()) or errors or None,
                 timeout_s=30, what="the Kafka consumer told the name is taken")
        assert "INCONSISTENT_GROUP_PROTOCOL" in str(errors[0])
    finally:
        c.close()
        sdk.close()


@pytest.mark.slow
def test_a_cooperative_sticky_group_rebalances_as_members_join_and_leave(mq, name, listener):
    """Three librdkafka members with the cooperative-sticky assignor (incremental
    rebalances over the classic protocol): a third joins, the first leaves; every message
    is handled once (each member commits what it handled), and the partitions are always
    split between the members present."""
    import threading
    from confluent_kafka import Consumer
    from raymq import Message
    mq.create_topic(name, 4)
    boot, group = "%s:%d" % listener.address, name + "-coop"
    p = mq.producer()
    handled: list = []
    lock = threading.Lock()

    class Member:
        def __init__(self):
            self.c = Consumer({"bootstrap.servers": boot, "group.id": group,
                               "partition.assignment.strategy": "cooperative-sticky",
                               "auto.offset.reset": "earliest", "enable.auto.commit": False,
                               "session.timeout.ms": 6000, "heartbeat.interval.ms": 300})
            self.c.subscribe([name])
            self.stop = threading.Event()
            self.owned: set = set()
            self.t = threading.Thread(target=self.run, daemon=True)
            self.t.start()

        def run(self):
            while not self.stop.is_set():
                m = self.c.poll(0.2)
                self.owned = {tp.partition for tp in self.c.assignment()}
                if m is None or m.error() is not None:
                    continue
                with lock:
                    handled.append(m.value())
                self.c.commit(m, asynchronous=False)
            self.c.close()  # (leaves the group)

        def leave(self):
            self.stop.set()
            self.t.join(30)

    def wave(k: int, members: list) -> None:
        p.send_batch([Message(name, b"w%d-%02d" % (k, i), key=str(i)) for i in range(40)])
        wait_for(lambda: sum(v.startswith(b"w%d-" % k) for v in handled) >= 40 and
                 set().union(*(m.owned for m in members)) == {0, 1, 2, 3} and
                 sum(len(m.owned) for m in members) == 4 and all(m.owned for m in members),
                 timeout_s=90, what=f"wave {k} handled, the partitions split")

    a, b = Member(), Member()
    try:
        wave(0, [a, b])
        c = Member()
        wave(1, [a, b, c])
        a.leave()
        wave(2, [b, c])
    finally:
        for m in (a, b, c):
            m.leave()
        p.close()
    assert sorted(handled) == sorted(b"w%d-%02d" % (k, i) for k in range(3) for i in range(40))
    committed = mq.admin.reset_offsets(group, name, to="latest", dry_run=True)
    assert all(before == after for before, after in committed.values()), committed


@pytest.mark.slow
def test_ray_data_reads_a_topic_through_the_listener_and_writes_one(mq, name, listener):
    """``ray.data.read_kafka`` over a RayMQ topic (its read tasks on the cluster's workers)
    and ``Dataset.write_kafka`` into another, which the SDK reads."""
    import json
    import ray
    from raymq import Message
    from tests.client.test_cluster import read_to_end
    boot = "%s:%d" % listener.address
    mq.create_topic(name, 2)
    mq.create_topic(name + "-out", 2)
    p = mq.producer()
    p.send_batch([Message(name, b"row %d" % i, key=f"k{i}") for i in range(50)])
    p.close()
    ds = ray.data.read_kafka(name, bootstrap_servers=boot)
    rows = ds.take_all()
    assert sorted(r["value"] for r in rows) == sorted(b"row %d" % i for i in range(50))
    assert {r["key"] for r in rows} == {b"k%d" % i for i in range(50)}
    assert {r["partition"] for r in rows} == {0, 1} and all(r["topic"] == name for r in rows)
    ray.data.from_items([{"n": i} for i in range(20)]).write_kafka(name + "-out", boot)
    c = mq.consumer(name + "-g", [name + "-out"])
    got = read_to_end(c, mq, [name + "-out"])
    c.close()
    assert sorted(json.loads(m.body)["n"] for m in got) == list(range(20))


def test_a_groups_offsets_are_deleted_through_the_admin_client_once_it_has_no_member(
        mq, name, listener):
    """OffsetDelete: refused while the group has members (they would commit again), done
    once it has none: the next reader starts as a new group's would."""
    from kafka import TopicPartition
    from kafka.admin import KafkaAdminClient
    from raymq import Message
    mq.create_topic(name, 2)
    p = mq.producer()
    p.send_batch([Message(name, b"m%d" % i, key=str(i)) for i in range(10)])
    p.close()
    from tests.client.test_cluster import read_to_end
    c = mq.consumer(name + "g", [name])
    read_to_end(c, mq, [name])
    c.commit()
    tps = [TopicPartition(name, 0), TopicPartition(name, 1)]
    ka = KafkaAdminClient(bootstrap_servers="%s:%d" % listener.address,
                          request_timeout_ms=30_000)
    try:
        busy = ka.delete_group_offsets(name + "g", tps)
        assert {e.__name__ for e in busy.values()} == {"GroupSubscribedToTopicError"}
        c.close()
        wait_for(lambda: not mq.control.call("groups", timeout_s=30).get(name + "g", {})
                 .get("members"), what="the group empty")
        done = ka.delete_group_offsets(name + "g", tps[:1])
        assert {e.__name__ for e in done.values()} == {"NoError"}
    finally:
        ka.close()
    left = mq.admin.reset_offsets(name + "g", name, to="latest", dry_run=True)
    assert left[(name, 0)][0] == -1 and left[(name, 1)][0] > 0
