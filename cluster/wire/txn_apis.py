"""What the Kafka transaction APIs answer: InitProducerId of a transactional id,
AddPartitionsToTxn, AddOffsetsToTxn, TxnOffsetCommit, EndTxn, and a Produce's
transactional batches -- over RayMQ's Kafka-style transactions, through the listener's
sessions (``raymq.wire.transactions``).  A mixin of ``KafkaApis``: pure Python over an
``mq``.
"""
from __future__ import annotations

from kafka.protocol.producer.transaction import (AddOffsetsToTxnResponse,
                                                 AddPartitionsToTxnResponse, EndTxnResponse,
                                                 InitProducerIdResponse,
                                                 TxnOffsetCommitResponse)

from raymq.storage import RecordBatch
from raymq.wire.frames import NONE, UNKNOWN_TOPIC_OR_PARTITION, shard_of
from raymq.wire.transactions import (INVALID_PRODUCER_EPOCH, INVALID_PRODUCER_ID_MAPPING,
                                     INVALID_TXN_STATE, OUT_OF_ORDER_SEQUENCE, PRODUCER_FENCED,
                                     Transactions, TxnRefused, kafka_sequence, stored_sequence)

_AddTopic = AddPartitionsToTxnResponse.AddPartitionsToTxnTopicResult
_AddPart = _AddTopic.AddPartitionsToTxnPartitionResult
_OffTopic = TxnOffsetCommitResponse.TxnOffsetCommitResponseTopic
_OffPart = _OffTopic.TxnOffsetCommitResponsePartition


def _fenced(code: int, version: int, since: int) -> int:
    """PRODUCER_FENCED is answered from the version that knows it (KIP-588); before it,
    INVALID_PRODUCER_EPOCH, as Kafka does."""
    return INVALID_PRODUCER_EPOCH if code == PRODUCER_FENCED and version < since else code


class TxnApis:
    """(mixed into ``KafkaApis``: it has ``mq``, ``txns``, ``_routes`` and ``_code``)"""

    txns: Transactions

    def _init_transactional(self, request):
        v = request.API_VERSION
        code, pid, epoch = NONE, -1, -1
        try:
            s = self.txns.init(request.transactional_id, request.transaction_timeout_ms,
                               getattr(request, "producer_id", -1),
                               getattr(request, "producer_epoch", -1))
            pid, epoch = s.kafka_pid, s.kafka_epoch
        except Exception as err:
            code = _fenced(self._code(err), v, 4)
        return InitProducerIdResponse(version=v, throttle_time_ms=0, error_code=code,
                                      producer_id=pid, producer_epoch=epoch)

    def _AddPartitionsToTxnRequest(self, request):
        """Each partition registered in the open transaction (its shard holds a write to
        it only once registered: RayMQ's coordinator registers it there first)."""
        v = request.API_VERSION
        asked = [(t.name, q) for t in request.v3_and_below_topics for q in t.partitions]
        codes: dict = {}
        try:
            s = self.txns.session(request.v3_and_below_transactional_id,
                                  request.v3_and_below_producer_id,
                                  request.v3_and_below_producer_epoch)
            queues = set()
            for topic, q in asked:
                shard = shard_of(self._routes(topic), q)
                if shard is None:
                    codes[(topic, q)] = UNKNOWN_TOPIC_OR_PARTITION
                else:
                    queues.add((shard, topic, q))
            with s.lock:
                if codes:  # (Kafka: one unknown partition fails the others with 49's kin)
                    codes.update({(t, q): 110 for _s, t, q in queues})  # OPERATION_NOT_ATTEMPTED
                else:
                    self.txns.add_queues(s, queues)
        except Exception as err:
            code = _fenced(self._code(err), v, 2)
            codes = {key: code for key in asked}
        by_topic: dict = {}
        for topic, q in asked:
            by_topic.setdefault(topic, []).append(_AddPart(
                partition_index=q, partition_error_code=codes.get((topic, q), NONE)))
        return AddPartitionsToTxnResponse(
            version=v, throttle_time_ms=0, error_code=NONE, results_by_transaction=[],
            results_by_topic_v3_and_below=[_AddTopic(name=t, results_by_partition=ps)
                                           for t, ps in by_topic.items()])

    def _AddOffsetsToTxnRequest(self, request):
        """The group's offsets will be part of the transaction (TxnOffsetCommit names
        them; their shards register the group then)."""
        v = request.API_VERSION
        code = NONE
        try:
            self.txns.session(request.transactional_id, request.producer_id,
                              request.producer_epoch)
        except Exception as err:
            code = _fenced(self._code(err), v, 2)
        return AddOffsetsToTxnResponse(version=v, throttle_time_ms=0, error_code=code)

    def _TxnOffsetCommitRequest(self, request):
        """A transaction's offsets of a group; from v3 its generation and member are
        checked as an OffsetCommit's (KIP-447: a zombie of an older generation is refused
        and aborts, as with Kafka), unless it names neither (a producer outside the group
        protocol)."""
        v = request.API_VERSION
        generation, member = getattr(request, "generation_id", -1), \
            getattr(request, "member_id", "")
        fenced = self.groups.check_commit(request.group_id, generation, member,
                                          transactional=True) \
            if generation >= 0 or member else NONE
        asked, by_shard, codes = [], {}, {}
        for t in request.topics:
            routes = self._routes(t.name)
            for p in t.partitions:
                asked.append((t.name, p.partition_index))
                shard = shard_of(routes, p.partition_index)
                if shard is None:
                    codes[(t.name, p.partition_index)] = UNKNOWN_TOPIC_OR_PARTITION
                else:
                    by_shard.setdefault(shard, {})[(t.name, p.partition_index)] = \
                        p.committed_offset
        try:
            if fenced:
                raise TxnRefused(fenced, f"group {request.group_id}: generation "
                                         f"{generation} member {member!r}")
            s = self.txns.session(request.transactional_id, request.producer_id,
                                  request.producer_epoch)
            with s.lock:
                if s.unknown is not None:
                    raise TxnRefused(INVALID_TXN_STATE, s.unknown)
                if by_shard:
                    self.txns.commit_offsets(s, request.group_id, by_shard)
        except Exception as err:
            code = _fenced(self._code(err), v, 3)
            codes.update({key: code for key in asked if key not in codes})
        by_topic: dict = {}
        for topic, q in asked:
            by_topic.setdefault(topic, []).append(_OffPart(
                partition_index=q, error_code=codes.get((topic, q), NONE)))
        return TxnOffsetCommitResponse(version=v, throttle_time_ms=0, topics=[
            _OffTopic(name=t, partitions=ps) for t, ps in by_topic.items()])

    def _EndTxnRequest(self, request):
        """Commit or abort: RayMQ's coordinator writes the markers in every queue and
        group of the transaction; an abort of a session this listener does not hold
        (it restarted) aborts whatever the transactional id had open."""
        v = request.API_VERSION
        code = NONE
        try:
            try:
                s = self.txns.session(request.transactional_id, request.producer_id,
                                      request.producer_epoch)
            except TxnRefused as refused:
                if refused.code != INVALID_PRODUCER_ID_MAPPING or request.committed:
                    raise
                self.txns.adopt_and_abort(request.transactional_id, request.producer_id,
                                          request.producer_epoch)
            else:
                with s.lock:
                    self.txns.end(s, bool(request.committed))
        except Exception as err:
            code = _fenced(self._code(err), v, 2)
        return EndTxnResponse(version=v, throttle_time_ms=0, error_code=code,
                              producer_id=request.producer_id,
                              producer_epoch=request.producer_epoch)

    # -------------------------------------------------------------- Produce
    def _produce_transactional(self, writer, parts: list) -> list:
        """A Produce's transactional partitions [(topic, partition, shard, batch, base
        sequence, count)], one write per shard: ``(topic, partition, code, base offset)``
        each."""
        try:
            s = self.txns.of_producer(writer.id, writer.epoch)
        except TxnRefused as refused:
            code = INVALID_PRODUCER_EPOCH if refused.code == PRODUCER_FENCED else refused.code
            return [(t, q, code, -1) for t, q, *_rest in parts]
        out, writes = [], {}
        with s.lock:
            for topic, q, shard, batch, base, count in parts:
                try:
                    if (shard, topic, q) not in s.queues:
                        raise TxnRefused(INVALID_TXN_STATE, f"{topic}/{q} is not in the "
                                                            f"transaction")
                    if s.unknown is not None:
                        raise TxnRefused(OUT_OF_ORDER_SEQUENCE, s.unknown)
                    stored = kafka_sequence(s, topic, q, base, count)
                    if stored is not None:
                        out.append((topic, q, NONE, stored))
                    else:
                        writes.setdefault(shard, []).append((topic, q, batch, base, count))
                except TxnRefused as refused:
                    out.append((topic, q, refused.code, -1))
            calls = []
            for shard, ws in writes.items():
                seq, call = self.txns.begin_write(s, shard, RecordBatch.concat(
                    [b for _t, _q, b, _b, _c in ws]))
                calls.append((shard, ws, seq, call))
            for shard, ws, seq, call in calls:
                try:
                    offsets = call.result().queue_offsets
                    self.txns.wrote(s, shard, seq)
                except Exception as err:
                    self.txns.failed(s, err)
                    out.extend((t, q, self._code(err), -1) for t, q, *_r in ws)
                    continue
                at = 0
                for topic, q, batch, base, count in ws:
                    stored_sequence(s, topic, q, base, count, offsets[at])
                    out.append((topic, q, NONE, offsets[at]))
                    at += len(batch)
        return out

