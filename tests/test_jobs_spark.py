"""Committed message datasets in Spark (issue 14), through RayDP inside the session's Ray
cluster: one Spark session (one small executor) for every test here, marked ``spark``."""
from __future__ import annotations

import pytest

from raymq.jobs import read_committed, spark_session
from raymq.jobs.spark_session import java_major
from tests.test_jobs_read import dataset_rows, mixed_history

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
