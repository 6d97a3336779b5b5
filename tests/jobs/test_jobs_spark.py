"""Committed message datasets in Spark (issue 14), through RayDP inside the session's Ray
cluster: one Spark session (one small executor) for every test here, marked ``spark``."""
from __future__ import annotations

import pytest

from raymq.jobs import read_committed, spark_session
from raymq.jobs.spark_session import java_major
from tests.jobs.test_jobs_read import dataset_rows, mixed_history

pytestmark = [pytest.mark.ray, pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def spark(mq):
    with spark_session(mq, num_executors=1, executor_cores=1, executor_memory="1g") as s:
        yield s


def test_the_spark_dataframe_holds_the_committed_messages_with_every_column(mq, name, spark):
    topics = mixed_history(mq, name)
    batch = read_committed(mq, topics, start="earliest")
    want = dataset_rows(batch)
    df = batch.dataset.to_spark(spark)  # the hand-off: Spark's executors read the blocks
    assert df.count() == len(want) == 5
    assert df.columns == ["topic", "queue_id", "queue_offset", "msg_id", "key", "tags",
                          "properties", "body", "born_ms", "store_ms", "transaction_id"]
    got = sorted((r.msg_id, r.topic, r.queue_id, r.queue_offset, bytes(r.body), r.key, r.tags,
                  dict(r.properties or {}), r.born_ms, r.store_ms, r.transaction_id)
                 for r in df.collect())
    assert got == sorted((w["msg_id"], w["topic"], w["queue_id"], w["queue_offset"], w["body"],
                          w["key"], w["tags"], dict(w["properties"] or []), w["born_ms"],
                          w["store_ms"], w["transaction_id"]) for w in want)
    by_topic = {r["topic"]: r["count"] for r in df.groupBy("topic").count().collect()}
    assert by_topic == {topics[0]: 3, topics[1]: 2}


def test_java_versions_are_read_as_java_prints_them():
    assert java_major('openjdk version "17.0.15" 2025-04-15') == 17
    assert java_major('java version "1.8.0_392"') == 8
    assert java_major('openjdk version "21" 2023-09-19') == 21
    assert java_major("no java here") == 0


def run_job(mq, spark, name, *, killed_before_commit=False) -> int:
    """A small job: every ``src`` message's body upper-cased to ``out``, with the input
    offsets in the same transaction.  ``killed_before_commit``: the process dies after
    writing every result, before its commit (nothing after that runs)."""
    from pyspark.sql import functions as F

    from raymq.jobs import write_transactionally
    batch = read_committed(mq, [f"src{name}"], group=f"job{name}")
    if batch.empty:
        return 0
    out = batch.dataset.to_spark(spark).select(F.upper(F.col("body").cast("string")).alias("body"))
    kp = batch.producer
    if killed_before_commit:
        class Killed(BaseException):
            pass

        def die(*_a, **_k):
            raise Killed()
        kp.send_offsets = die   # the last step before the commit ...
        kp.abort = lambda: None  # ... and a dead process aborts nothing
        with pytest.raises(Killed):
            write_transactionally(mq, out, topic=f"out{name}", group=f"job{name}",
                                  offsets=batch.end_offsets)
        return -1
    return write_transactionally(mq, out, topic=f"out{name}", group=f"job{name}",
                                 offsets=batch.end_offsets)


def test_a_job_killed_before_its_commit_and_run_again_outputs_each_input_once(mq, name, spark):
    from raymq import Message
    from tests.kafka_tx.test_kafka_transactions import read_all
    mq.create_topic(f"src{name}", queues=2)
    mq.create_topic(f"out{name}", queues=2)
    mq.producer().send_batch([Message(f"src{name}", b"m%02d" % i) for i in range(30)])
    assert run_job(mq, spark, name, killed_before_commit=True) == -1
    uncommitted = read_all(mq, f"peek{name}", [f"out{name}"], "read_uncommitted")
    assert len(uncommitted) == 30  # the dead run wrote every result ...
    assert read_all(mq, f"c1{name}", [f"out{name}"]) == []  # ... none committed
    assert run_job(mq, spark, name) == 30  # the rerun fences it (aborted) and does it all
    assert run_job(mq, spark, name) == 0  # nothing new: nothing written
    mq.producer().send(Message(f"src{name}", b"late"))
    assert run_job(mq, spark, name) == 1
    got = read_all(mq, f"c2{name}", [f"out{name}"])
    assert sorted(m.body for m in got) == sorted([b"M%02d" % i for i in range(30)] + [b"LATE"])


def test_order_income_per_minute_equals_a_plain_recomputation_over_runs(mq, name, spark):
    """Orders over three minutes and three shops, in two runs, among aborted Kafka-style
    orders, rolled-back RocketMQ-style orders and a body that is no order: the income
    messages sum to exactly what plain Python computes from the committed orders."""
    import json

    from raymq import LocalTransactionState as S
    from raymq import Message
    from raymq.jobs.order_income import income_totals, run_once
    from tests.jobs.test_jobs_read import Decided
    from tests.kafka_tx.test_kafka_transactions import read_all
    src, dst, group = f"orders{name}", f"income{name}", f"income-job{name}"
    mq.create_topic(src, queues=2)
    mq.create_topic(dst, queues=2)
    base = 1_700_000_000_000 - 1_700_000_000_000 % 60_000

    def order(i):
        return {"order_id": f"o{i}", "amount": 10 + i % 7, "currency": ["EUR", "USD", "JPY"][i % 3],
                "ts_ms": base + (i % 3) * 60_000 + i}
    committed = [order(i) for i in range(40)]
    p = mq.producer()
    p.send_batch([Message(src, json.dumps(o).encode()) for o in committed[:25]])
    p.send(Message(src, b"not an order"))
    kp = mq.transactional_producer(f"k{name}")
    kp.begin()
    kp.send(Message(src, json.dumps(order(99)).encode()))
    kp.abort()
    tp = mq.transaction_producer(f"r{name}", Decided())
    tp.send_in_transaction(Message(src, json.dumps(order(98)).encode()), S.ROLLBACK_MESSAGE)
    assert run_once(mq, spark, source=src, target=dst, group=group)["orders_read"] >= 26
    p.send_batch([Message(src, json.dumps(o).encode()) for o in committed[25:]])
    assert run_once(mq, spark, source=src, target=dst, group=group)["messages"] > 0
    assert run_once(mq, spark, source=src, target=dst, group=group)["messages"] == 0
    want = {}
    for o in committed:
        t = want.setdefault((o["ts_ms"] // 60_000 * 60_000, o["currency"]),
                            {"income": 0, "orders": 0})
        t["income"] += o["amount"]
        t["orders"] += 1
    assert income_totals(read_all(mq, f"check{name}", [dst])) == want
    kp.close()
    tp.close()


def test_raymq_job_order_income_runs_once_from_the_command_line(mq, name, spark, capsys):
    import json

    from raymq import Message
    from raymq.tools.cli import main
    from tests.kafka_tx.test_kafka_transactions import read_all
    mq.create_topic(f"o{name}", queues=1)
    mq.create_topic(f"i{name}", queues=1)
    mq.producer().send_batch([Message(f"o{name}", json.dumps(
        {"amount": a, "shop": "s1", "ts_ms": 120_000}).encode()) for a in (5, 7)])
    assert main(["job", "order-income", "--once", "--source", f"o{name}", "--target",
                 f"i{name}", "--group", f"g{name}"]) == 0
    assert "2 orders read, 1 income messages written" in capsys.readouterr().err
    [m] = read_all(mq, f"c{name}", [f"i{name}"])
    assert json.loads(m.body) == {"minute": 120_000, "shop": "s1", "income": 12, "orders": 2}


def test_no_java_is_one_line_naming_the_fix(monkeypatch):
    from raymq import JavaMissingError
    from raymq.jobs import check_java
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(JavaMissingError) as err:
        check_java()
    assert "openjdk-17" in str(err.value) and "\n" not in str(err.value)
