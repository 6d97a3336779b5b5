"""Kafka transactional producers through the listener (issue 36), with librdkafka
(confluent-kafka) as applications run it: a consume-transform-produce loop with
``send_offsets_to_transaction``, aborted transactions never read by ``read_committed``
consumers, a zombie fenced by a newer instance, and consumers that move past RayMQ's
own transaction markers."""
from __future__ import annotations

import pytest

from tests.helpers import wait_for

pytestmark = pytest.mark.ray


def _producer(boot: str, tid: str):
    from confluent_kafka import Producer
    p = Producer({"bootstrap.servers": boot, "transactional.id": tid, "linger.ms": 5,
                  "transaction.timeout.ms": 60_000})
    p.init_transactions(30)
    return p


def _copy_topics(mq, name: str, bodies: list[bytes]) -> tuple[str, str, str]:
    """A copy loop's input topic holding ``bodies`` (spread by key over its 2 partitions),
    its output topic and its group's name."""
    from raymq import Message
    src, dst, group = name + "-in", name + "-out", name + "-copy"
    mq.create_topic(src, 2)
    mq.create_topic(dst, 2)
    p = mq.producer()
    p.send_batch([Message(src, body, key=str(i)) for i, body in enumerate(bodies)])
    p.close()
    return src, dst, group


def _read_all(boot: str, topic: str, partitions: int, isolation: str, want: int) -> list:
    """Every record of ``topic`` a consumer of ``isolation`` reads from the start (waits
    until it read ``want`` and reached the end)."""
    from confluent_kafka import Consumer, TopicPartition
    c = Consumer({"bootstrap.servers": boot, "group.id": topic + "-reader-" + isolation,
                  "isolation.level": isolation, "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", "enable.partition.eof": True})
    c.assign([TopicPartition(topic, q, 0) for q in range(partitions)])
    got, eof = [], set()

    def done():
        m = c.poll(0.5)
        if m is not None:
            if m.error() is None:
                got.append(m)
                eof.discard(m.partition())
            elif m.error().code() == -191:  # (_PARTITION_EOF: at the end of that partition)
                eof.add(m.partition())
            else:
                raise AssertionError(m.error())
        return len(got) >= want and len(eof) == partitions
    try:
        wait_for(done, timeout_s=60, what=f"{want} records read {isolation}")
    finally:
        c.close()
    return got


def test_committed_transactions_are_read_and_aborted_ones_never_by_read_committed(
        mq, name, listener):
    boot = "%s:%d" % listener.address
    mq.create_topic(name, 2)
    p = _producer(boot, name + "-tx")
    for k, commit in enumerate([True, False, True, False]):
        p.begin_transaction()
        for i in range(10):
            p.produce(name, value=b"t%d-%d" % (k, i), key=b"%d" % i, partition=i % 2)
        p.flush(30)
        (p.commit_transaction if commit else p.abort_transaction)(30)
    committed = _read_all(boot, name, 2, "read_committed", 20)
    assert sorted(m.value() for m in committed) == sorted(
        b"t%d-%d" % (k, i) for k in (0, 2) for i in range(10))
    everything = _read_all(boot, name, 2, "read_uncommitted", 40)
    assert len(everything) == 40  # (the aborted ones too, and no marker as a record)
    # and the SDK's read_committed consumers see the same
    from tests.client.test_cluster import read_to_end
    c = mq.consumer(name + "-sdk", [name])
    assert sorted(m.body for m in read_to_end(c, mq, [name])) == sorted(
        m.value() for m in committed)
    c.close()


def test_a_fetch_reports_the_high_watermark_past_an_open_transaction_and_stops_at_the_lso(
        mq, name, listener):
    """Fetch's marks: a read_committed consumer stops at the last stable offset (before an
    open transaction) while the high watermark counts the open transaction's records; the
    log start is the queue's."""
    from confluent_kafka import Consumer, TopicPartition
    boot = "%s:%d" % listener.address
    mq.create_topic(name, 1)
    from raymq import Message
    p = mq.producer()
    p.send_batch([Message(name, b"plain %d" % i) for i in range(5)])
    p.close()
    tx = _producer(boot, name + "-tx")
    tx.begin_transaction()
    for i in range(3):
        tx.produce(name, value=b"open %d" % i, partition=0)
    tx.flush(30)  # (written, not committed)
    c = Consumer({"bootstrap.servers": boot, "group.id": name + "-rc",
                  "isolation.level": "read_committed", "enable.auto.commit": False,
                  "auto.offset.reset": "earliest", "enable.partition.eof": True})
    c.assign([TopicPartition(name, 0, 0)])
    got = []
    try:
        def at_lso():
            m = c.poll(0.5)
            if m is not None and m.error() is None:
                got.append(m.value())
            return m is not None and m.error() is not None and m.error().code() == -191
        wait_for(at_lso, timeout_s=60, what="the read_committed consumer at the LSO")
        low, high = c.get_watermark_offsets(TopicPartition(name, 0), cached=True)
        assert got == [b"plain %d" % i for i in range(5)]
        assert (low, high) == (0, 8)  # (the open transaction's 3 records counted)
        assert c.position([TopicPartition(name, 0)])[0].offset == 5
    finally:
        c.close()
        tx.abort_transaction(30)


def test_a_copy_loop_with_its_offsets_in_the_transaction_outputs_each_input_once(
        mq, name, listener):
    """Consume, transform, produce, with the input's offsets sent to the transaction;
    the loop's producer is replaced in the middle (a new instance with the id: the open
    transaction of the one before is aborted, its late writes fenced)."""
    from confluent_kafka import Consumer, KafkaException
    boot = "%s:%d" % listener.address
    src, dst, group = _copy_topics(mq, name, [b"in %d" % i for i in range(60)])

    def run(tid: str, limit: int, finish: bool = True):
        p = _producer(boot, tid)
        c = Consumer({"bootstrap.servers": boot, "group.id": group,
                      "isolation.level": "read_committed", "enable.auto.commit": False,
                      "auto.offset.reset": "earliest"})
        c.subscribe([src])
        copied = 0
        p.begin_transaction()
        while copied < limit:
            m = c.poll(0.5)
            if m is None or m.error() is not None:
                continue
            p.produce(dst, value=m.value().replace(b"in", b"out"), partition=m.partition())
            copied += 1
            if copied % 7 == 0 or copied == limit:
                p.flush(30)
                if not finish and copied == limit:
                    return p, c  # (a transaction left open: the zombie)
                p.send_offsets_to_transaction(c.position(c.assignment()),
                                              c.consumer_group_metadata(), 30)
                p.commit_transaction(30)
                p.begin_transaction()
        p.abort_transaction(30)
        c.close()
        return p, None

    zombie, zc = run(name + "-loop", 25, finish=False)  # 21 committed, 4 left open
    zc.close()
    fresh, _ = run(name + "-loop", 39)  # fences the zombie, copies the rest
    with pytest.raises(KafkaException) as fenced:  # (its late write: refused, fatal)
        zombie.produce(dst, value=b"zombie", partition=0)
        zombie.flush(10)
        zombie.commit_transaction(30)
    assert fenced.value.args[0].fatal() and "fenced" in str(fenced.value)
    out = _read_all(boot, dst, 2, "read_committed", 60)
    assert sorted(m.value() for m in out) == sorted(b"out %d" % i for i in range(60))
    committed = mq.admin.reset_offsets(group, src, to="latest", dry_run=True)
    assert all(before == after for before, after in committed.values()), committed
    assert sum(after for _before, after in committed.values()) == 60
    del fresh


def test_a_plain_kafka_consumer_moves_past_the_markers_of_sdk_transactions(mq, name, listener):
    """RayMQ's transaction markers take queue offsets (as Kafka's do): a Kafka consumer
    reading past one is given a control batch there, never stuck before it."""
    from raymq import Message
    boot = "%s:%d" % listener.address
    mq.create_topic(name, 1)
    kp = mq.transactional_producer(name + "-sdk-tx")
    with kp.transaction():
        kp.send_batch([Message(name, b"c%d" % i) for i in range(3)])
    with pytest.raises(RuntimeError):
        with kp.transaction():
            kp.send(Message(name, b"aborted"))
            raise RuntimeError("abort it")
    kp.close()
    for isolation, want in (("read_committed", 3), ("read_uncommitted", 4)):
        got = _read_all(boot, name, 1, isolation, want)
        assert len(got) == want
        assert [m.value() for m in got][:3] == [b"c0", b"c1", b"c2"]
    p = mq.producer()
    p.send(Message(name, b"after"))
    p.close()
    got = _read_all(boot, name, 1, "read_committed", 4)
    assert [m.value() for m in got] == [b"c0", b"c1", b"c2", b"after"]


def test_an_admin_client_describes_the_cluster_topics_groups_and_transactions(
        mq, name, listener):
    """confluent-kafka's AdminClient: the cluster, a topic's retention, a Kafka group and
    its members; kafka-python's admin: every group (the SDK's too, as protocol type
    ``raymq``), the transactions RayMQ's coordinators hold, and a partition's producers
    with a transaction open in it."""
    from confluent_kafka import Consumer
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType
    from kafka.admin import KafkaAdminClient
    boot = "%s:%d" % listener.address
    mq.create_topic(name, 2, retention_ms=3_600_000)
    admin = AdminClient({"bootstrap.servers": boot})
    cluster = admin.describe_cluster(request_timeout=30).result(30)
    assert cluster.cluster_id == "raymq" and [n.port for n in cluster.nodes] == \
        [listener.address[1]]
    [future] = admin.describe_configs([ConfigResource(ResourceType.TOPIC, name)]).values()
    configs = future.result(30)
    assert configs["retention.ms"].value == "3600000"
    assert configs["retention.bytes"].value == "-1"
    ka = KafkaAdminClient(bootstrap_servers=boot, request_timeout_ms=30_000)
    c = Consumer({"bootstrap.servers": boot, "group.id": name + "-kafka",
                  "auto.offset.reset": "earliest"})
    c.subscribe([name])
    sdk = mq.consumer(name + "-sdk", [name])
    sdk.poll(1, 0.5)
    try:
        def both_listed():
            c.poll(0.2)
            groups = {g["group_id"]: g for g in ka.list_groups()}
            return name + "-kafka" in groups and name + "-sdk" in groups and groups
        groups = wait_for(both_listed, timeout_s=60, what="both groups listed")
        assert groups[name + "-kafka"]["protocol_type"] == "consumer"
        assert groups[name + "-sdk"]["protocol_type"] == "raymq"
        [described] = admin.describe_consumer_groups([name + "-kafka"]).values()
        group = described.result(30)
        assert len(group.members) == 1 and {tp.partition for tp in
                                            group.members[0].assignment.topic_partitions} \
            == {0, 1}
        [listed] = [g for g in admin.list_consumer_groups(request_timeout=30).result(30).valid
                    if g.group_id == name + "-kafka"]
        assert str(listed.state).endswith("STABLE")
    finally:
        c.close()
        sdk.close()
    p = _producer(boot, name + "-tx")
    p.begin_transaction()
    p.produce(name, value=b"open", partition=1)
    p.flush(30)
    try:
        listed = {t.transactional_id: t for rows in ka.list_transactions().values()
                  for t in rows}
        assert listed[name + "-tx"].state == "Ongoing"
        described = ka.describe_transactions([name + "-tx"])[name + "-tx"]
        assert described.state == "Ongoing" and described.producer_id == \
            listed[name + "-tx"].producer_id
        assert {(tp.topic, tp.partition) for tp in described.topic_partitions} == {(name, 1)}
        from kafka import TopicPartition
        producers = ka.describe_producers([TopicPartition(name, 0), TopicPartition(name, 1)])
        [active] = producers[TopicPartition(name, 1)].active_producers
        assert producers[TopicPartition(name, 0)].active_producers == []
        assert (active.producer_id, active.current_transaction_start_offset) == \
            (described.producer_id, 0)  # (what a hanging transaction is found by)
    finally:
        ka.close()
    p.abort_transaction(30)


def test_the_readmes_kafka_examples_run_as_shown(mq, name, listener):
    """The README's Kafka clients section: its producer/consumer and its transactional copy
    loop, run as written (the address and the topic names made this test's own)."""
    import contextlib
    import io
    import re
    from tests.client.test_cluster import read_to_end
    from tests.helpers import ROOT
    with open(f"{ROOT}/README.md") as f:
        readme = f.read()
    section = readme[readme.index("### Kafka clients"):readme.index("### The web console")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    mq.create_topic(name, 2)
    mq.create_topic(name + "-copy", 2)
    boot = "%s:%d" % listener.address
    out = io.StringIO()
    for code in blocks:
        code = code.replace("127.0.0.1:9092", boot).replace('"orders-copy"', f'"{name}-copy"') \
            .replace('"orders"', f'"{name}"').replace('"copier-1"', f'"{name}-copier"') \
            .replace('"billing"', f'"{name}-billing"').replace('"copier"', f'"{name}-copier"')
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})
    assert out.getvalue().strip() == "b'order-7' b'{\"total\": 42}' [('source', b'shop')]"
    c = mq.consumer(name + "-check", [name + "-copy"])
    copied = read_to_end(c, mq, [name + "-copy"])
    c.close()
    assert [(m.key, bytes(m.body)) for m in copied] == [("order-7", b'{"total": 42}')]


@pytest.mark.slow
def test_a_copy_loop_killed_at_random_points_outputs_each_input_exactly_once(
        mq, name, listener):
    """The transactional copy loop (a process of its own) SIGKILLed at random points, four
    times, then let run to the end: read_committed readers see every input once in the
    output, and nothing of the transactions the kills left open."""
    import random
    import subprocess
    import sys
    import threading
    import time
    from tests.helpers import ROOT
    boot = "%s:%d" % listener.address
    src, dst, group = _copy_topics(mq, name, [b"in %03d" % i for i in range(300)])
    rnd = random.Random(5)

    def start():
        proc = subprocess.Popen([sys.executable, "-m", "tests.kafka_copy_process", boot, src,
                                 dst, group, name + "-tid", "0.05"], cwd=ROOT,
                                stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        proc.lines = []
        threading.Thread(target=lambda: proc.lines.extend(iter(proc.stdout.readline, "")),
                         daemon=True).start()
        return proc

    def copied() -> int:
        done = mq.admin.reset_offsets(group, src, to="latest", dry_run=True)
        return sum(max(0, before) for before, _after in done.values())
    for _ in range(4):
        proc = start()
        wait_for(lambda: any(line.startswith("committed") for line in proc.lines),
                 timeout_s=60, what="a commit of the loop")
        time.sleep(rnd.uniform(0.0, 0.3))  # (then killed: mid-transaction, most often)
        proc.kill()
        proc.wait()
    assert 0 < copied() < 300  # (killed in the middle of the work)
    proc = start()
    try:
        wait_for(lambda: copied() == 300, timeout_s=120, what="every input copied")
    finally:
        proc.kill()
        proc.wait()
    out = _read_all(boot, dst, 2, "read_committed", 300)
    assert sorted(m.value() for m in out) == sorted(b"IN %03d" % i for i in range(300))
