"""A Kafka ListOffsets of the latest offset answers what a consumer may read from, as
Kafka does: the last stable offset for ``read_committed`` (isolation level 1: not past a
transaction still open), the high watermark otherwise; a Fetch past a partition's end
(a position taken before a failover cut unconfirmed records back) answers
OFFSET_OUT_OF_RANGE, so the client resets instead of waiting there for good.

Pure: the listener's ``KafkaApis`` over one in-process shard (``test_fetch_partitions``).
"""
from __future__ import annotations

from kafka.protocol.consumer import ListOffsetsRequest

from raymq.storage import RecordBatch
from raymq.wire.apis import KafkaApis
from tests.helpers import open_shard
from tests.wire.test_fetch_partitions import OFFSET_OUT_OF_RANGE, _fetch, _InProcessMQ

_Topic = ListOffsetsRequest.ListOffsetsTopic
_Part = _Topic.ListOffsetsPartition


class _MQ(_InProcessMQ):
    def call(self, shard, method, *args, timeout_s):
        return getattr(self.shard, method)(*args)


def _latest(apis, isolation: int, timestamp: int = -1) -> tuple[int, int]:
    request = ListOffsetsRequest(version=4, replica_id=-1, isolation_level=isolation,
                                 topics=[_Topic(name="t", partitions=[_Part(
                                     partition_index=0, current_leader_epoch=-1,
                                     timestamp=timestamp)])])
    [topic] = apis.handle(request).topics
    [part] = topic.partitions
    return part.error_code, part.offset


def test_the_latest_offset_of_read_committed_is_not_past_an_open_transaction(tmp_path):
    sh = open_shard(tmp_path, [("t", 0)])
    try:
        sh.send(RecordBatch("t", 0, [b"%d" % i for i in range(5)]))
        sh.ktx_register(7, 0, [("t", 0)])
        sh.ktx_send(RecordBatch("t", 0, [b"open-1", b"open-2", b"open-3"]), 7, 0, 1)
        apis = KafkaApis(_MQ(sh, "t", 1), "localhost", 0)
        assert _latest(apis, isolation=1) == (0, 5)   # the open transaction's first offset
        assert _latest(apis, isolation=0) == (0, 8)
        assert _latest(apis, isolation=1, timestamp=-2) == (0, 0)
        sh.ktx_end(7, 1, "COMMIT")
        assert _latest(apis, isolation=1) == (0, 9)   # its records and marker, stable now
    finally:
        sh.close()


def test_a_fetch_past_the_end_is_out_of_range(tmp_path):
    sh = open_shard(tmp_path, [("t", 0)])
    try:
        sh.send(RecordBatch("t", 0, [b"a", b"b"]))
        apis = KafkaApis(_MQ(sh, "t", 1), "localhost", 0)
        assert _fetch(apis, {0: 12})[0].error_code == OFFSET_OUT_OF_RANGE
        at_end = _fetch(apis, {0: 2})[0]
        assert at_end.error_code == 0 and at_end.high_watermark == 2
    finally:
        sh.close()


def test_a_fetch_caught_up_to_what_the_replicas_confirmed_reports_that_as_its_marks(tmp_path):
    """A replicated shard's readers see up to what its in-sync replicas confirmed (the
    high watermark); a Fetch there reported the leader's own end as high watermark and
    last stable offset, records not acknowledged (and a failover may take back)."""
    sh = open_shard(tmp_path, [("t", 0)])
    try:
        put = sh.send(RecordBatch("t", 0, [b"%d" % i for i in range(5)]))
        sh.reads.confirmed = lambda: put.phys[3]   # (the replicas hold the first 3)
        apis = KafkaApis(_MQ(sh, "t", 1), "localhost", 0)
        got = _fetch(apis, {0: 0})[0]
        assert (got.high_watermark, got.last_stable_offset) == (3, 3)
        for at in (3, 5):  # (at the confirmed end; at the leader's own, past it)
            got = _fetch(apis, {0: at})[0]
            assert got.error_code == 0 and got.records == b""
            assert (got.high_watermark, got.last_stable_offset) == (3, 3), at
        assert _latest(apis, isolation=0) == (0, 3)
    finally:
        sh.close()


def test_the_high_watermark_is_the_confirmed_end_however_far_the_replicas_lag(tmp_path):
    """The confirmed end was looked for among the newest 4096 records only: with more
    unconfirmed (a follower far behind), the high watermark said 4096 records back from
    the end -- past what the replicas hold."""
    sh = open_shard(tmp_path, [("t", 0)])
    try:
        put = sh.send(RecordBatch("t", 0, [b"%d" % i for i in range(10_000)]))
        apis = KafkaApis(_MQ(sh, "t", 1), "localhost", 0)
        for held in (9_999, 5_000, 100, 0):
            sh.reads.confirmed = lambda held=held: put.phys[held]
            assert _latest(apis, isolation=0) == (0, held), held
            assert _fetch(apis, {0: held})[0].high_watermark == held
    finally:
        sh.close()
