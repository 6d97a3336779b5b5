"""``raymq.jobs.read_committed`` on the session cluster (no Spark): the dataset holds what
a read_committed consumer sees of the same range, after committed and aborted
Kafka-style transactions, RocketMQ-style commits and rollbacks, and plain sends; its
offsets are where that range ends."""
from __future__ import annotations

import pytest

from raymq import LocalTransactionState as S
from raymq import Message, TransactionListener
from raymq.jobs.read_committed import job_transactional_id, read_committed
from raymq.jobs.schema import MESSAGE_SCHEMA
from tests.kafka_tx.test_kafka_transactions import read_all, topics_on_both_shards

pytestmark = pytest.mark.ray


class Decided(TransactionListener):
    def execute_local_transaction(self, msg, arg):
        return arg

    def check_local_transaction(self, msg):
        return S.ROLLBACK_MESSAGE


def dataset_rows(batch) -> list[dict]:
    rows = []
    for t in batch.dataset.iter_batches(batch_format="pyarrow", batch_size=None):
        assert t.schema == MESSAGE_SCHEMA
        rows += t.to_pylist()
    return rows


def mixed_history(mq, name):
    topics = topics_on_both_shards(mq, name, 2)
    kp = mq.transactional_producer(f"p{name}")
    with kp.transaction():
        kp.send_batch([Message(t, f"kafka-commit-{t}".encode(), key="a") for t in topics])
    kp.begin()
    kp.send_batch([Message(t, f"kafka-abort-{t}".encode(), key="a") for t in topics])
    kp.abort()
    tp = mq.transaction_producer(f"r{name}", Decided())
    tp.send_in_transaction(Message(topics[0], b"rocket-commit", properties={"k": "v"}),
                           S.COMMIT_MESSAGE)
    tp.send_in_transaction(Message(topics[1], b"rocket-rollback"), S.ROLLBACK_MESSAGE)
    mq.producer().send_batch([Message(t, f"plain-{t}".encode(), tags="x") for t in topics])
    kp.close()
    tp.close()
    return topics


def test_the_dataset_is_what_a_read_committed_consumer_sees(mq, name):
    topics = mixed_history(mq, name)
    batch = read_committed(mq, topics, start="earliest")
    rows = dataset_rows(batch)
    seen = read_all(mq, f"g{name}", topics)
    assert sorted((r["msg_id"], r["topic"], r["queue_id"], r["queue_offset"], r["body"])
                  for r in rows) == \
        sorted((m.msg_id, m.topic, m.queue_id, m.queue_offset, m.body) for m in seen)
    assert sorted(r["body"] for r in rows) == sorted(
        [f"kafka-commit-{t}".encode() for t in topics] + [f"plain-{t}".encode() for t in topics]
        + [b"rocket-commit"])
    [rocket] = [r for r in rows if r["body"] == b"rocket-commit"]
    assert dict(rocket["properties"])["k"] == "v" and rocket["transaction_id"]
    ends = {q: max(r["queue_offset"] + 1 for r in rows if (r["topic"], r["queue_id"]) == q)
            for q in {(r["topic"], r["queue_id"]) for r in rows}}
    assert all(batch.end_offsets[q] >= e for q, e in ends.items())  # (markers after them)
    # the blocks' metadata came with them from the read tasks: as Ray Data measures it
    import ray
    theirs = ray.data.from_arrow_refs(batch._refs)
    assert batch.dataset.count() == theirs.count() == len(rows)
    assert batch.dataset.schema() == theirs.schema()
    assert batch.dataset.size_bytes() == theirs.size_bytes() > 0


def test_a_group_reads_from_its_committed_offsets_and_fences_the_job_before(mq, name):
    topics = topics_on_both_shards(mq, name, 1)
    mq.producer().send_batch([Message(topics[0], b"%d" % i) for i in range(6)])
    group = f"job{name}"
    zombie = mq.transactional_producer(job_transactional_id(group))
    first = read_committed(mq, topics, group)
    assert sorted(r["body"] for r in dataset_rows(first)) == [b"%d" % i for i in range(6)]
    assert first.start_offsets == {q: 0 for q in first.end_offsets}
    with pytest.raises(Exception, match="PRODUCER_FENCED|fenced"):
        zombie.begin()
        zombie.send(Message(topics[0], b"late"))
    with first.producer.transaction():  # what write_transactionally does with the results
        first.producer.send_offsets(first.end_offsets, group=group)
    again = read_committed(mq, topics, group)
    assert again.empty and dataset_rows(again) == []
    mq.producer().send(Message(topics[0], b"new"))
    assert [r["body"] for r in dataset_rows(read_committed(mq, topics, group))] == [b"new"]


def test_a_queue_s_range_is_read_in_blocks_of_bounded_size(mq, name):
    """Issue 25 (8): a large range is not one block (one object, one IPC copy): blocks of
    at most ``max_block_rows`` messages, the same rows in the same order."""
    mq.create_topic(name, queues=1)
    mq.producer().send_batch([Message(name, b"%03d" % i) for i in range(50)])
    kp = mq.transactional_producer(f"p{name}")
    kp.begin()
    kp.send_batch([Message(name, b"aborted")] * 5)  # inside a block: filtered there
    kp.abort()
    mq.producer().send_batch([Message(name, b"%03d" % i) for i in range(50, 60)])
    whole = read_committed(mq, [name], start="earliest")
    split = read_committed(mq, [name], start="earliest", max_block_rows=7)
    assert len(whole._refs) == 1 and len(split._refs) == -(-whole.end_offsets[(name, 0)] // 7)
    assert [r["body"] for r in dataset_rows(split)] == [b"%03d" % i for i in range(60)]
    assert [r["queue_offset"] for r in dataset_rows(split)] == \
        [r["queue_offset"] for r in dataset_rows(whole)]
    with pytest.raises(Exception, match="max_block_rows"):
        read_committed(mq, [name], start="earliest", max_block_rows=0)
    kp.close()
