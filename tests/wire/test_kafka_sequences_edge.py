"""A Kafka producer's sequences at their edges, as the listener answers them: a batch that is
neither the next one nor an exact resend of one of the last stored is refused with
OUT_OF_ORDER_SEQUENCE_NUMBER (45) and stored nowhere -- never answered as written -- and a
transactional producer's sequences wrap past 2^31 - 1 as an idempotent one's do.  Pure: the
listener's answers (``KafkaApis``) over one shard opened in the test's process (no Ray, no
sockets)."""
from __future__ import annotations

import pytest
from kafka.protocol.producer import ProduceRequest
from kafka.record import MemoryRecordsBuilder

from raymq.wire.apis import KafkaApis
from raymq.wire.records import Producer
from raymq.wire.sequences import OUT_OF_ORDER, Sequences
from raymq.wire.transactions import (OUT_OF_ORDER_SEQUENCE, Session, TxnRefused,
                                     kafka_sequence, stored_sequence)
from tests.helpers import Answered, open_shard

TOP = (1 << 31) - 1  # (Kafka's last sequence; 0 comes next)
_Data = ProduceRequest.TopicProduceData
_PartData = _Data.PartitionProduceData


class _Transport:
    """The listener's calls to shard 0, made on ``target``."""

    def __init__(self, target):
        self.target = target

    def call(self, _shard, method, *args, timeout_s=None):
        return getattr(self.target, method)(*args)

    def begin(self, _shard, method, args, timeout_s=None):
        return Answered(getattr(self.target, method), args)


class _Mq:
    """What the listener's Produce path asks of the SDK: topic ``t`` of one queue, on
    shard 0."""

    def __init__(self, target):
        self.transport = _Transport(target)

    @staticmethod
    def routes_for(topics):
        return {t: [0] for t in topics}


def _records(pid: int, base_seq: int, n: int, *, transactional: bool = False) -> bytes:
    b = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 20,
                             transactional=transactional, producer_id=pid, producer_epoch=0,
                             base_sequence=base_seq)
    for i in range(n):
        b.append(1, None, b"seq %d" % ((base_seq + i) % (TOP + 1)))
    b.close()
    return bytes(b.buffer())


def _produce(apis: KafkaApis, data: bytes) -> tuple[int, int]:
    """(error code, base offset) of a Produce of ``data`` to partition 0 of ``t``."""
    req = ProduceRequest(transactional_id=None, acks=-1, timeout_ms=30_000, topic_data=[
        _Data(name="t", partition_data=[_PartData(index=0, records=data)])])
    req.API_VERSION = 9
    [part] = apis.handle(req).responses[0].partition_responses
    return part.error_code, part.base_offset


@pytest.fixture
def shard(tmp_path):
    sh = open_shard(tmp_path, [("t", 0)])
    yield sh
    sh.close()


def _bodies(sh) -> list[bytes]:
    return [m.body for m in sh.store.read_queue("t", 0, 0, 100)]


def test_a_batch_behind_that_was_never_stored_is_refused_not_answered_as_written(shard):
    """The brief's case: a producer unknown here starts at sequence 5 (any first sequence
    is taken); its earlier batch 0..4, which failed and was never stored, comes again.  It
    is no resend of a stored batch: 45, stored nowhere (it was NONE, base offset -1, the
    records lost).  An exact resend of the stored batch is still its first offset."""
    apis = KafkaApis(_Mq(shard), "localhost", 9092)
    assert _produce(apis, _records(9, 5, 5)) == (0, 0)
    assert _produce(apis, _records(9, 0, 5)) == (45, -1)
    assert _produce(apis, _records(9, 5, 5)) == (0, 0)  # (the exact resend)
    assert _bodies(shard) == [b"seq %d" % i for i in range(5, 10)]


def test_a_batch_overlapping_the_next_sequence_or_inside_a_stored_one_is_refused(shard):
    """Kafka answers a resend only for an exact (first, last) match of a stored batch: a
    batch starting inside one (3..4 of 0..4), or reaching past the next expected sequence
    from behind (3..7), is refused, not stored again in part nor answered as written."""
    apis = KafkaApis(_Mq(shard), "localhost", 9092)
    assert _produce(apis, _records(9, 0, 5)) == (0, 0)
    assert _produce(apis, _records(9, 3, 2)) == (45, -1)  # (the end of 0..4)
    assert _produce(apis, _records(9, 3, 5)) == (45, -1)  # (3..7: 3, 4 stored already)
    assert _produce(apis, _records(9, 5, 2)) == (0, 5)
    assert _produce(apis, _records(9, 0, 5)) == (0, 0)  # (an earlier batch, resent)
    assert _bodies(shard) == [b"seq %d" % i for i in range(7)]


def test_a_batch_behind_a_listener_that_forgot_its_producer_is_refused_too(shard):
    """The listener restarted: it learns where the producer is from the shard, and a batch
    behind that the shard never stored is still refused, an exact resend still answered."""
    assert _produce(KafkaApis(_Mq(shard), "localhost", 9092), _records(9, 5, 5)) == (0, 0)
    assert _produce(KafkaApis(_Mq(shard), "localhost", 9092), _records(9, 0, 5)) == (45, -1)
    assert _produce(KafkaApis(_Mq(shard), "localhost", 9092), _records(9, 5, 5)) == (0, 0)
    assert _bodies(shard) == [b"seq %d" % i for i in range(5, 10)]


def test_sequences_refuse_a_batch_from_behind_that_reaches_past_the_expected_one():
    """(``Sequences`` alone) from behind, reaching past the next sequence: out of order,
    across the wrap too; an exact resend is still a put at or below the last one."""
    seqs = Sequences()
    pid, seq = seqs.check(Producer(9, 0, 0, 5), "t", 0)
    seqs.stored(pid, seq)
    assert seqs.check(Producer(9, 0, 3, 5), "t", 0)[1] == OUT_OF_ORDER
    assert seqs.check(Producer(9, 0, 0, 5), "t", 0) == (pid, seq)
    pid, seq = seqs.check(Producer(7, 0, TOP - 4, 5), "t", 0)  # (the last five)
    seqs.stored(pid, seq)
    assert seqs.check(Producer(7, 0, TOP - 1, 4), "t", 0)[1] == OUT_OF_ORDER  # (.., 0, 1)
    assert seqs.check(Producer(7, 0, 0, 2), "t", 0) == (pid, seq + 2)  # (in sequence)
    for base in range(5, 35, 5):  # (six more batches of five: 5..34)
        pid, seq = seqs.check(Producer(9, 0, base, 5), "t", 0)
        seqs.stored(pid, seq, 5)
    assert seqs.check(Producer(9, 0, 10, 5), "t", 0) == (pid, 15)  # (5 back: a resend)
    assert seqs.check(Producer(9, 0, 5, 5), "t", 0)[1] == OUT_OF_ORDER  # (6 back: Kafka's too)
    assert seqs.check(Producer(9, 0, 12, 3), "t", 0)[1] == OUT_OF_ORDER  # (inside 10..14)


# -------------------------------------------------------------- transactional
def _session() -> Session:
    return Session("tx", kafka_pid=9, kafka_epoch=0, pid=1, epoch=0, timeout_ms=None)


def test_a_transactional_producers_sequence_wraps_past_the_top_to_zero():
    """Kafka clients wrap a partition's sequence from 2^31 - 1 to 0, across transactions:
    the batch at 0 is the next one, to be written (it was DUPLICATE_SEQUENCE, 46, which the
    Java client takes for success: every later batch lost)."""
    s = _session()
    assert kafka_sequence(s, "t", 0, TOP - 4) is None  # (a first batch: any sequence)
    stored_sequence(s, "t", 0, TOP - 4, 5, 100)  # (TOP - 4 .. TOP)
    assert kafka_sequence(s, "t", 0, 0) is None
    stored_sequence(s, "t", 0, 0, 3, 105)
    assert kafka_sequence(s, "t", 0, 3) is None
    assert kafka_sequence(s, "t", 0, 0) == 105  # (a resend of 0..2: its offset)
    assert kafka_sequence(s, "t", 0, TOP - 4) == 100


def test_a_transactional_batch_behind_and_not_stored_is_out_of_order_never_a_duplicate():
    """Behind the expected sequence but no stored batch's start, or ahead: 45 (refused, the
    client resends in order), never 46 (a success to the Java client, the records lost)."""
    s = _session()
    stored_sequence(s, "t", 0, 5, 5, 0)  # (a first batch at 5: 5..9)
    for base in (0, 7, 12, TOP):
        with pytest.raises(TxnRefused) as refused:
            kafka_sequence(s, "t", 0, base)
        assert refused.value.code == OUT_OF_ORDER_SEQUENCE, base
    assert kafka_sequence(s, "t", 0, 5) == 0
    assert kafka_sequence(s, "t", 0, 10) is None


def test_a_transactional_resend_matches_a_stored_batchs_record_count_when_given():
    """With its record count, a resend is one of the last batches exactly (Kafka matches
    first and last sequence); another batch starting there is out of order."""
    s = _session()
    stored_sequence(s, "t", 0, 0, 5, 40)
    assert kafka_sequence(s, "t", 0, 0, 5) == 40
    with pytest.raises(TxnRefused) as refused:
        kafka_sequence(s, "t", 0, 0, 3)
    assert refused.value.code == OUT_OF_ORDER_SEQUENCE


def test_an_idempotent_producers_last_epoch_bump_gives_a_new_producer_id():
    """KIP-360's bump keeps the producer id while the epoch lasts; past 32,766 it wrapped
    to epoch 0 of the same id, which maps to the RayMQ producer of the first epoch 0: its
    new batches (sequence 0 again) read as resends and were dropped.  A new id now, as
    Kafka gives one."""
    from kafka.protocol.producer.transaction import InitProducerIdRequest
    from raymq.wire.apis import KafkaApis
    apis = KafkaApis(None, "localhost", 0)

    def init(pid: int, epoch: int):
        got = apis.handle(InitProducerIdRequest(version=4, transactional_id=None,
                                                transaction_timeout_ms=-1, producer_id=pid,
                                                producer_epoch=epoch))
        return got.error_code, got.producer_id, got.producer_epoch
    assert init(12345, 5) == (0, 12345, 6)
    code, pid, epoch = init(12345, 32766)
    assert code == 0 and pid not in (12345, -1) and epoch == 0


def test_a_record_over_the_largest_message_is_message_too_large(tmp_path):
    """A record over ``max_message_bytes`` is MESSAGE_TOO_LARGE (10), which clients know
    (the Java client splits a batch on it, and names the cause), not UNKNOWN_SERVER_ERROR
    (-1): nothing stored."""
    sh = open_shard(tmp_path, [("t", 0)], max_message_bytes=1024)
    try:
        b = MemoryRecordsBuilder(magic=2, compression_type=0, batch_size=1 << 20)
        b.append(1, None, bytes(4096))
        b.close()
        apis = KafkaApis(_Mq(sh), "localhost", 9092)
        assert _produce(apis, bytes(b.buffer()))[0] == 10
        assert _bodies(sh) == []
    finally:
        sh.close()
