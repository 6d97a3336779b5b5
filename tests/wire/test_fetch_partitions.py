"""A Kafka Fetch answers OFFSET_OUT_OF_RANGE per partition, as Kafka does: a partition whose
fetch offset aged out (below its queue's log start) takes the error alone, and the other
partitions read from the same shard get their records in the same response.

Pure: the listener's ``KafkaApis`` over one in-process shard (no Ray), through a transport
that calls the shard directly.  The log start moves as the retention tests move it: old
segments deleted by age on a manual clock.
"""
from __future__ import annotations

import pytest
from kafka.protocol.consumer import FetchRequest
from kafka.record import MemoryRecords

from raymq.storage import RecordBatch
from raymq.storage.clock import ManualClock
from raymq.wire.apis import KafkaApis
from tests.helpers import Answered, open_shard

HOUR = 3600_000
MB = 1 << 20
SEG = 9 * MB  # the smallest segment a cluster allows
OFFSET_OUT_OF_RANGE = 1

_Topic = FetchRequest.FetchTopic
_Part = _Topic.FetchPartition


class _InProcessMQ:
    """What ``KafkaApis`` asks of ``mq`` for a Fetch: every queue of ``topic`` on shard 0,
    each call to it answered by ``shard`` itself."""

    def __init__(self, shard, topic: str, queues: int):
        self.shard, self.topic, self.queues = shard, topic, queues
        self.transport = self
        self.pulls: list[list] = []

    def routes_for(self, topics):
        return {t: [0] * self.queues for t in topics if t == self.topic}

    def begin(self, shard, method, args, *, timeout_s):
        if method == "pull":
            self.pulls.append([(t, q) for t, q, _o, _n in args[0]])
        return Answered(getattr(self.shard, method), args)


def _bulk(sh, qid: int, mb: int) -> None:
    for i in range(mb * 4):
        sh.send(RecordBatch("t", qid, [b"%08d" % i + bytes(256 * 1024 - 8)]))


@pytest.fixture
def aged(tmp_path):
    """A shard of topic ``t``: queue 0's first records aged out (log start > 3), queue 1
    holding 3 records, queue 2 empty."""
    clock = ManualClock(1_700_000_000_000)
    sh = open_shard(tmp_path, [("t", 0), ("t", 1), ("t", 2)], clock=clock,
                    segment_size_bytes=SEG, retention_ms=HOUR)
    try:
        _bulk(sh, 0, 20)
        clock.advance(2 * HOUR)
        _bulk(sh, 0, 2)  # (the segment written now stays: queue 1's records with it)
        sh.send(RecordBatch("t", 1, [b"a", b"b", b"c"]))
        assert sh.janitor.run_once().count >= 1
        assert sh.store.retention.log_start("t", 0) > 3
        assert sh.store.retention.log_start("t", 1) == 0
        yield sh
    finally:
        sh.close()


def _fetch(apis, offsets: dict[int, int]) -> dict[int, object]:
    """A Fetch of topic ``t`` (partition -> fetch offset): partition -> its answer."""
    request = FetchRequest(
        version=11, replica_id=-1, max_wait_ms=0, min_bytes=1, max_bytes=64 * MB,
        isolation_level=0, session_id=0, session_epoch=-1, forgotten_topics_data=[],
        rack_id="", topics=[_Topic(topic="t", partitions=[
            _Part(partition=p, fetch_offset=o, partition_max_bytes=MB)
            for p, o in offsets.items()])])
    response = apis.handle(request)
    [topic] = response.responses
    return {p.partition_index: p for p in topic.partitions}


def _records(part) -> list[tuple[int, bytes]]:
    batches = list(iter(MemoryRecords(part.records).next_batch, None))
    return [(r.offset, r.value) for b in batches for r in b]


def test_a_partition_below_its_log_start_takes_out_of_range_alone(aged):
    """Partition 0's offset aged out; partitions 1 and 2 of the same shard (one pull)
    answer with no error: 1 with its records, both with their marks."""
    mq = _InProcessMQ(aged, "t", 3)
    got = _fetch(KafkaApis(mq, "localhost", 0), {0: 3, 1: 0, 2: 0})
    assert got[0].error_code == OFFSET_OUT_OF_RANGE
    assert (got[0].high_watermark, got[0].log_start_offset) == (-1, -1)  # (as Kafka's)
    assert got[0].records == b""
    assert got[1].error_code == 0
    assert _records(got[1]) == [(0, b"a"), (1, b"b"), (2, b"c")]
    assert (got[1].high_watermark, got[1].last_stable_offset,
            got[1].log_start_offset) == (3, 3, 0)
    assert got[2].error_code == 0 and got[2].records == b""
    assert (got[2].high_watermark, got[2].log_start_offset) == (0, 0)
    assert mq.pulls[0] == [("t", 0), ("t", 1), ("t", 2)]  # (one pull for the shard first)


def test_a_fetch_with_no_partition_out_of_range_is_one_pull_and_reads_them_all(aged):
    """At or above the log start every partition reads, in the one pull of its shard."""
    mq = _InProcessMQ(aged, "t", 3)
    start = aged.store.retention.log_start("t", 0)
    got = _fetch(KafkaApis(mq, "localhost", 0), {0: start, 1: 1, 2: 0})
    assert [got[p].error_code for p in range(3)] == [0, 0, 0]
    assert _records(got[0])[0][0] == start and got[0].log_start_offset == start
    assert _records(got[1]) == [(1, b"b"), (2, b"c")]
    assert len(mq.pulls) == 1


def test_every_partition_out_of_range_answers_out_of_range(aged):
    """A negative offset is out of range too; a lone partition below its log start as
    well."""
    mq = _InProcessMQ(aged, "t", 3)
    got = _fetch(KafkaApis(mq, "localhost", 0), {0: 0, 1: -5, 2: 0})
    assert [got[p].error_code for p in range(3)] == [OFFSET_OUT_OF_RANGE] * 2 + [0]
    got = _fetch(KafkaApis(mq, "localhost", 0), {0: 1})
    assert got[0].error_code == OFFSET_OUT_OF_RANGE
