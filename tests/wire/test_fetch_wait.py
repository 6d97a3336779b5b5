"""A Kafka Fetch of partitions on several shards waits for data up to its max_wait_ms, as
one of a single shard does (a long poll): it was answered at once, empty, so a consumer
with partitions on two shards sent Fetch after Fetch without pause (thousands a second,
a core burnt between it, the listener and the shards).  Data arriving on any of the
shards meanwhile is answered without waiting out the rest.  Pure: the listener's
``KafkaApis`` over two in-process shards."""
from __future__ import annotations

import threading
import time

import pytest
from kafka.protocol.consumer import FetchRequest

from raymq.storage import RecordBatch
from raymq.wire.apis import KafkaApis
from tests.helpers import Answered, open_shard
from tests.wire.test_fetch_partitions import _records

MB = 1 << 20
_Topic = FetchRequest.FetchTopic
_Part = _Topic.FetchPartition


class _TwoShards:
    """Partition p of topic ``t`` on shard p; each call answered by that shard itself."""

    def __init__(self, shards):
        self.shards, self.transport, self.pulls = shards, self, 0

    def routes_for(self, topics):
        return {t: [0, 1] for t in topics if t == "t"}

    def begin(self, shard, method, args, *, timeout_s):
        self.pulls += method == "pull"
        return Answered(getattr(self.shards[shard], method), args)


@pytest.fixture
def two(tmp_path):
    shards = [open_shard(tmp_path / str(i), [("t", i)]) for i in (0, 1)]
    yield shards
    for sh in shards:
        sh.close()


def _fetch(apis, max_wait_ms: int):
    request = FetchRequest(
        version=11, replica_id=-1, max_wait_ms=max_wait_ms, min_bytes=1, max_bytes=64 * MB,
        isolation_level=0, session_id=0, session_epoch=-1, forgotten_topics_data=[],
        rack_id="", topics=[_Topic(topic="t", partitions=[
            _Part(partition=p, fetch_offset=0, partition_max_bytes=MB) for p in (0, 1)])])
    [topic] = apis.handle(request).responses
    return {p.partition_index: p for p in topic.partitions}


def test_a_fetch_over_two_shards_waits_for_data_then_answers_it_at_once(two):
    mq = _TwoShards(two)
    apis = KafkaApis(mq, "localhost", 0)
    t0 = time.monotonic()
    got = _fetch(apis, 400)
    waited = time.monotonic() - t0
    assert [got[p].records for p in (0, 1)] == [b"", b""]
    assert waited >= 0.35 and mq.pulls <= 60, (waited, mq.pulls)  # a wait, not a spin
    threading.Timer(0.1, lambda: two[1].send(RecordBatch("t", 1, [b"late"]))).start()
    t0 = time.monotonic()
    got = _fetch(apis, 5000)
    took = time.monotonic() - t0  # (the listener waits 500 ms at most)
    assert _records(got[1]) == [(0, b"late")] and took < 0.45, took
