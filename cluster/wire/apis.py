"""What each Kafka API answers, from the cluster as the SDK sees it (``mq``).

A topic is a topic, a partition is a queue.  One listener is one broker to a Kafka
client: it leads every partition (it forwards to the shards), so a client sends all
its requests to it.  System, retry and dead-letter topics are not listed.  Pure
Python over an ``mq`` (the SDK's ``RayMQ`` or anything with its ``topics()``).
"""
from __future__ import annotations

import logging
import time

from kafka.protocol.consumer import FetchResponse, ListOffsetsResponse
from kafka.protocol.consumer.group import (HeartbeatResponse, JoinGroupResponse,
                                           LeaveGroupResponse, OffsetCommitResponse,
                                           OffsetFetchResponse, SyncGroupResponse)
from kafka.protocol.admin.topics import (CreatePartitionsResponse, CreateTopicsResponse,
                                         DeleteTopicsResponse)
from kafka.protocol.metadata import ApiVersionsResponse, FindCoordinatorResponse, MetadataResponse
from kafka.protocol.producer import ProduceResponse
from kafka.protocol.producer.transaction import InitProducerIdResponse

from raymq.actors.protocol import is_system_topic
from raymq.storage.errors import (BrokerUnavailableError, DiskFullError, InvalidMessageError,
                                  MessageTooLargeError,
                                  NotEnoughReplicasError, NotLeaderError, OffsetOutOfRangeError,
                                  QuotaExceededError, ReservedNameError, RequestTimeoutError,
                                  TopicExistsError, UnknownTopicError)
from raymq.wire.admin_apis import AdminApis
from raymq.wire.groups import ClassicGroups
from raymq.wire.frames import (CLUSTER_ID, NONE, UNKNOWN_TOPIC_OR_PARTITION,
                               UNSUPPORTED_VERSION, api_versions_table, shard_of)
from raymq.wire.records import BadRecords, control_batch, from_spans, to_batch
from raymq.wire.sequences import OUT_OF_ORDER, Sequences, new_producer_id
from raymq.wire.transactions import TXN_ERRORS, Transactions, TxnRefused
from raymq.wire.txn_apis import TxnApis

#: Kafka's error codes for RayMQ's errors (a client retries the retriable ones).
ERROR_CODES = TXN_ERRORS + (
               (BadRecords, 2),                 # CORRUPT_MESSAGE
               (TopicExistsError, 36),          # TOPIC_ALREADY_EXISTS
               (ReservedNameError, 17),         # INVALID_TOPIC_EXCEPTION
               (QuotaExceededError, 89),        # THROTTLING_QUOTA_EXCEEDED
               (OffsetOutOfRangeError, 1),      # OFFSET_OUT_OF_RANGE
               (UnknownTopicError, 3),          # UNKNOWN_TOPIC_OR_PARTITION
               (NotLeaderError, 6),             # NOT_LEADER_OR_FOLLOWER
               (BrokerUnavailableError, 6),
               (RequestTimeoutError, 7),        # REQUEST_TIMED_OUT
               (NotEnoughReplicasError, 19),    # NOT_ENOUGH_REPLICAS
               (DiskFullError, 56),             # KAFKA_STORAGE_ERROR
               (MessageTooLargeError, 10),      # MESSAGE_TOO_LARGE
               (InvalidMessageError, 87))       # INVALID_RECORD
UNKNOWN_SERVER_ERROR = -1
#: Most messages one partition of a Fetch carries.
FETCH_MAX_MESSAGES = 5000
#: How often a Fetch over several shards asks them again while none has data: first
#: after 10 ms, then twice as long each time, at most 80 ms (~10 rounds a 500 ms wait).
FETCH_POLL_S = (0.01, 0.08)

log = logging.getLogger("raymq.kafka")


_Topic = MetadataResponse.MetadataResponseTopic
_Partition = _Topic.MetadataResponsePartition
_Broker = MetadataResponse.MetadataResponseBroker
_ProduceTopic = ProduceResponse.TopicProduceResponse
_ProducePart = _ProduceTopic.PartitionProduceResponse
_FetchTopic = FetchResponse.FetchableTopicResponse
_FetchPart = _FetchTopic.PartitionData
_OffsetsTopic = ListOffsetsResponse.ListOffsetsTopicResponse
_OffsetsPart = _OffsetsTopic.ListOffsetsPartitionResponse


class KafkaApis(TxnApis, AdminApis):
    """The answers of one listener, advertised as broker ``node_id`` at
    ``host:port``."""

    def __init__(self, mq, host: str, port: int, node_id: int = 0,
                 groups: ClassicGroups | None = None):
        self.mq = mq
        self.host, self.port, self.node_id = host, port, node_id
        self.groups = groups or ClassicGroups()
        self.sequences = Sequences()
        self.txns = Transactions(mq)

    def handle(self, request):
        """The response to ``request`` (a decoded request of a served API)."""
        return getattr(self, f"_{type(request).__name__}")(request)

    @staticmethod
    def _code(err: BaseException) -> int:
        return err.code if isinstance(err, TxnRefused) else error_code(err)

    def _routes(self, topic: str) -> list[int] | None:
        """The shard of each queue of a user topic (None: no such topic)."""
        if is_system_topic(topic):
            return None
        try:
            return self.mq.routes_for({topic})[topic]
        except UnknownTopicError:
            return None

    # ---------------------------------------------------------- ApiVersions
    def _ApiVersionsRequest(self, request):
        return api_versions_response(request.API_VERSION, NONE)

    # ------------------------------------------------------------- Metadata
    def _MetadataRequest(self, request):
        v = request.API_VERSION
        listed = {name: t for name, t in self.mq.topics().items() if not is_system_topic(name)}
        self.mq.learn_routes({n: t["routes"] for n, t in listed.items()})  # (grown ones)
        every = request.topics is None or (v == 0 and not request.topics)  # (v0: [] is all)
        wanted = sorted(listed) if every else [t.name for t in request.topics]
        topics = []
        for name in wanted:
            t = listed.get(name)
            if t is None:
                topics.append(_Topic(error_code=UNKNOWN_TOPIC_OR_PARTITION, name=name,
                                     topic_id=None, is_internal=False, partitions=[]))
                continue
            me = [self.node_id]
            topics.append(_Topic(error_code=NONE, name=name, topic_id=None, is_internal=False,
                                 partitions=[_Partition(
                                     error_code=NONE, partition_index=q, leader_id=self.node_id,
                                     leader_epoch=0, replica_nodes=me, isr_nodes=me,
                                     offline_replicas=[])
                                     for q in range(len(t["routes"]))]))
        return MetadataResponse(
            version=v, throttle_time_ms=0, cluster_id=CLUSTER_ID, controller_id=self.node_id,
            brokers=[_Broker(node_id=self.node_id, host=self.host, port=self.port, rack=None)],
            topics=topics)


    # -------------------------------------------------------------- Produce
    def _ProduceRequest(self, request):
        """Each partition's records as one put of its queue (``acks`` 0 and 1: the leader's
        write; -1: every in-sync replica's, RayMQ's default); the puts of all partitions
        are sent at once over the shards' data channels, then awaited."""
        acks = "all" if request.acks == -1 else "leader"
        started = []  # (topic, partition, error code or None, call or None, pid, seq, count)
        transactional, writer = [], None
        for t in request.topic_data:
            routes = self._routes(t.name)
            for p in t.partition_data:
                try:
                    shard = shard_of(routes, p.index)
                    if shard is None:
                        raise UnknownTopicError(f"{t.name}/{p.index}")
                    batch, writer = to_batch(t.name, p.index, p.records)
                    if writer.transactional:  # (written below, in the producer's transaction)
                        transactional.append((t.name, p.index, shard, batch,
                                              writer.base_sequence, writer.count))
                        continue
                    pid, seq = self.sequences.check(
                        writer, t.name, p.index, lambda pid, s=shard: self.mq.transport.call(
                            s, "producer_sequences", [pid], timeout_s=30)[0])
                    if seq == OUT_OF_ORDER:  # (OUT_OF_ORDER_SEQUENCE_NUMBER: the client
                        started.append((t.name, p.index, 45, None, 0, 0, 0))  # resends in order)
                        continue
                    call = self.mq.transport.begin(shard, "send",
                                                   (batch, pid, seq, None, acks), timeout_s=30)
                    started.append((t.name, p.index, None, call, pid, seq, writer.count))
                except Exception as err:  # (each partition answers alone)
                    started.append((t.name, p.index, error_code(err), None, 0, 0, 0))
        answered = self._produce_transactional(writer, transactional) if transactional else []
        for name, index, code, call, pid, seq, count in started:
            base = -1
            if call is not None:
                try:
                    reply = call.result()
                    self.sequences.stored(pid, seq, count)
                    if reply.refused:
                        raise InvalidMessageError(str(reply.refused[0]))
                    if reply.duplicate and len(reply.queue_offsets) != count:
                        # (no stored put of these records: nothing stored, none to answer)
                        answered.append((name, index, 45, -1))
                        continue
                    if reply.status != "SEND_OK":  # (stored; a resend of its sequence
                        # waits again, and is answered with its offset once it is durable)
                        raise RequestTimeoutError(
                            f"{name}/{index}: stored, not known durable and replicated in "
                            f"time ({reply.status})")
                    code, base = NONE, reply.queue_offsets[0] if reply.queue_offsets else -1
                except Exception as err:
                    code = error_code(err)
            answered.append((name, index, code, base))
        topics: dict[str, list] = {}
        for name, index, code, base in answered:
            topics.setdefault(name, []).append(_ProducePart(
                index=index, error_code=code, base_offset=base, log_append_time_ms=-1,
                log_start_offset=-1, record_errors=[], error_message=None))
        return ProduceResponse(version=request.API_VERSION, throttle_time_ms=0, responses=[
            _ProduceTopic(name=n, partition_responses=ps) for n, ps in topics.items()])

    def _InitProducerIdRequest(self, request):
        """An idempotent producer's id: a new one (epoch 0), or the epoch after the one it
        had (KIP-360) -- a new id once the epochs run out (epoch 0 of the same id is the
        RayMQ producer of its first epoch 0: its batches would read as resends); a
        transactional id's from RayMQ's coordinator (``TxnApis._init_transactional``)."""
        v = request.API_VERSION
        if request.transactional_id is not None:
            return self._init_transactional(request)
        old = getattr(request, "producer_id", -1)
        epoch = getattr(request, "producer_epoch", -1) + 1
        if old is not None and old >= 0 and 0 < epoch < 32767:
            pid = old
        else:
            pid, epoch = new_producer_id(), 0
        return InitProducerIdResponse(version=v, throttle_time_ms=0, error_code=NONE,
                                      producer_id=pid, producer_epoch=epoch)

    # ----------------------------------------------------------------- admin
    def _CreateTopicsRequest(self, request):
        """A topic per entry: its partitions as queues (-1: the cluster's default), its
        ``retention.ms`` / ``retention.bytes`` configs as its retention,
        ``message.timestamp.type`` ``CreateTime`` (the only one kept); the others refused
        (INVALID_CONFIG)."""
        v, out = request.API_VERSION, []
        for t in request.topics:
            code, message, queues = NONE, None, t.num_partitions
            try:
                conf = {c.name: c.value for c in t.configs}
                if conf.get("message.timestamp.type") == "CreateTime":  # (what RayMQ keeps)
                    del conf["message.timestamp.type"]
                unknown = sorted(set(conf) - {"retention.ms", "retention.bytes"})
                if unknown:
                    code, message = 40, f"configs not served: {', '.join(unknown)}"
                elif t.assignments:
                    code, message = 39, "replica assignments are RayMQ's own (raymq up)"
                elif t.name in self.mq.topics():
                    raise TopicExistsError(f"topic {t.name!r} exists")
                elif not request.validate_only:
                    info = self.mq.create_topic(
                        t.name, None if t.num_partitions < 0 else t.num_partitions,
                        retention_ms=_int(conf.get("retention.ms")),
                        retention_bytes=_int(conf.get("retention.bytes")))
                    queues = len(info["routes"])
            except Exception as err:
                code, message = error_code(err), str(err)[:500]
                if code == UNKNOWN_SERVER_ERROR and isinstance(err, (ValueError, TypeError)):
                    code = 42  # INVALID_REQUEST
            out.append(CreateTopicsResponse.CreatableTopicResult(
                name=t.name, topic_id=None, error_code=code, error_message=message,
                topic_config_error_code=NONE, num_partitions=queues, replication_factor=-1,
                configs=[]))
        return CreateTopicsResponse(version=v, throttle_time_ms=0, topics=out)

    def _CreatePartitionsRequest(self, request):
        """A topic grown to ``count`` partitions (queues); fewer than it has is refused
        (INVALID_PARTITIONS), and so are replica assignments (RayMQ places them)."""
        out = []
        for t in request.topics:
            code, message = NONE, None
            try:
                routes = self._routes(t.name)
                if t.assignments:
                    code, message = 39, "replica assignments are RayMQ's own (raymq up)"
                elif routes is None:
                    raise UnknownTopicError(f"topic {t.name!r} does not exist")
                elif t.count <= len(routes):
                    code, message = 37, f"topic {t.name!r} has {len(routes)} partitions: " \
                                        f"it only grows"
                elif not request.validate_only:
                    self.mq.alter_topic(t.name, queues=t.count)
            except Exception as err:
                code, message = error_code(err), str(err)[:500]
            out.append(CreatePartitionsResponse.CreatePartitionsTopicResult(
                name=t.name, error_code=code, error_message=message))
        return CreatePartitionsResponse(version=request.API_VERSION, throttle_time_ms=0,
                                        results=out)

    def _DeleteTopicsRequest(self, request):
        out = []
        for name in request.topic_names:
            code, message = NONE, None
            try:
                if self._routes(name) is None:
                    raise UnknownTopicError(f"topic {name!r} does not exist")
                self.mq.delete_topic(name)
            except Exception as err:
                code, message = error_code(err), str(err)[:500]
            out.append(DeleteTopicsResponse.DeletableTopicResult(
                name=name, topic_id=None, error_code=code, error_message=message))
        return DeleteTopicsResponse(version=request.API_VERSION, throttle_time_ms=0,
                                    responses=out)

    # ---------------------------------------------------------------- Fetch
    def _FetchRequest(self, request):
        """Each partition read from its queue (one pull per shard; a long poll when the
        request names one shard, else the shards asked again while none has data), as a
        record batch made from the records as they lie in the log; with its high
        watermark, last stable offset (read_committed: where the read stops) and log
        start.  The aborted transactions list is empty: the shard leaves aborted records
        out of a read_committed read itself."""
        isolation = _isolation(request)
        asked, by_shard = {}, {}
        for t in request.topics:
            routes = self._routes(t.topic)
            for p in t.partitions:
                asked[(t.topic, p.partition)] = p.fetch_offset
                if (shard := shard_of(routes, p.partition)) is not None:
                    n = max(1, min(FETCH_MAX_MESSAGES, p.partition_max_bytes // 64))
                    by_shard.setdefault(shard, []).append(
                        (t.topic, p.partition, p.fetch_offset, n))
        wait = min(request.max_wait_ms, 500)
        got = self._fetch_pulls(by_shard, wait if len(by_shard) == 1 else 0, isolation)
        if len(by_shard) > 1:  # (no long poll over several shards: a short poll instead)
            got = self._fetch_polled(by_shard, isolation, got, wait)
        topics: dict[str, list] = {}
        now_ms = int(time.time() * 1000)
        for (topic, q), offset in asked.items():
            code, spans, next_offset, end, (hwm, log_start) = got.get(
                (topic, q), (UNKNOWN_TOPIC_OR_PARTITION, None, -1, -1, (-1, -1)))
            read = spans is not None and len(spans) > 0
            records = from_spans(spans) if read else b""
            if next_offset > (int(spans.queue_offsets[-1]) + 1 if read else offset):
                # what the read left out at the end (RayMQ's transaction markers, aborted
                # records): a control batch there moves the client's position past them
                records += control_batch(next_offset - 1, now_ms)
            topics.setdefault(topic, []).append(_FetchPart(
                partition_index=q, error_code=code, high_watermark=hwm,
                last_stable_offset=min(end, hwm), log_start_offset=log_start,
                aborted_transactions=[],
                preferred_read_replica=-1, records=records))
        return FetchResponse(version=request.API_VERSION, throttle_time_ms=0, error_code=NONE,
                             session_id=0, responses=[_FetchTopic(topic=t, partitions=ps)
                                                      for t, ps in topics.items()])

    def _fetch_pulls(self, by_shard: dict, wait: int, isolation: str) -> dict:
        """(topic, partition) -> (code, spans, next offset, end, (high watermark, log
        start)): one pull per shard.  A pull with one partition out of range (its offset
        aged out, or negative) fails whole; Kafka answers that error per partition, and a
        client resets each partition so answered, so such a shard's partitions are pulled
        again one by one (at once: the failed pull did not wait) -- only those out of
        range answer OFFSET_OUT_OF_RANGE, the others their records."""
        def begin(shard: int, reads: list, wait_ms: int):
            return self.mq.transport.begin(
                shard, "pull", (reads, wait_ms, None, None, isolation, "kafka", "error"),
                timeout_s=30)
        got: dict = {}
        calls = [(shard, reads, begin(shard, reads, wait))
                 for shard, reads in by_shard.items()]
        alone = []
        for shard, reads, call in calls:
            if not self._take_pull(got, reads, call):
                alone += [([r], begin(shard, [r], 0)) for r in reads]
        for reads, call in alone:
            self._take_pull(got, reads, call)
        return got

    def _fetch_polled(self, by_shard: dict, isolation: str, got: dict, wait_ms: int) -> dict:
        """``got`` when anything came (a record, an error, a read moved past markers);
        else the shards are asked again (``FETCH_POLL_S``) until something does or
        ``wait_ms`` ran out: a Fetch over several shards waits as a long poll of one does
        (answered at once, its consumer asked again at once, without end)."""
        deadline = time.monotonic() + wait_ms / 1000.0
        asked = {(t, p): o for reads in by_shard.values() for t, p, o, _n in reads}

        def idle(got: dict) -> bool:
            return all(code == NONE and (spans is None or not len(spans)) and
                       nxt == asked[key] for key, (code, spans, nxt, _e, _m) in got.items())
        pause = FETCH_POLL_S[0]  # (doubling: a few rounds a wait, quick ones first)
        while idle(got) and time.monotonic() + pause <= deadline:
            time.sleep(pause)
            pause = min(2 * pause, FETCH_POLL_S[1])
            got = self._fetch_pulls(by_shard, 0, isolation)
        return got

    @staticmethod
    def _take_pull(got: dict, reads: list, call) -> bool:
        """Puts a Fetch's pull of ``reads`` into ``got``: each partition with its answer,
        or with the pull's error.  False, nothing put: a pull of several partitions failed
        out of range, which may be one partition's alone (to pull each by itself)."""
        try:
            for topic, q, spans, next_offset, end, marks in call.result():
                got[(topic, q)] = (NONE, spans, next_offset, end, marks)
        except Exception as err:
            if isinstance(err, OffsetOutOfRangeError) and len(reads) > 1:
                return False
            for topic, q, _o, _n in reads:  # (the shard's error: all its partitions answer it)
                got[(topic, q)] = (error_code(err), None, -1, -1, (-1, -1))
        return True

    # ---------------------------------------------------------- ListOffsets
    def _ListOffsetsRequest(self, request):
        """-2: the log start, -1: the end a reader may read to (the high watermark; with
        ``read_committed``, v2 on, the last stable offset: Kafka's), else the first offset
        stored at or after the time (the end when none is: Kafka answers -1 there)."""
        isolation = _isolation(request)
        topics = []
        for t in request.topics:
            routes = self._routes(t.name)
            parts = []
            for p in t.partitions:
                code, offset = NONE, -1
                try:
                    shard = shard_of(routes, p.partition_index)
                    if shard is None:
                        raise UnknownTopicError(f"{t.name}/{p.partition_index}")
                    q = (t.name, p.partition_index)
                    ts = None if p.timestamp < 0 else p.timestamp
                    start, end, at = self.mq.transport.call(
                        shard, "queue_bounds", [q], None if ts is None else [ts], isolation,
                        timeout_s=30)[q]
                    offset = {-2: start, -1: end}.get(p.timestamp, -1 if at >= end else at)
                except Exception as err:
                    code = error_code(err)
                parts.append(_OffsetsPart(partition_index=p.partition_index, error_code=code,
                                          timestamp=-1, offset=offset, leader_epoch=-1))
            topics.append(_OffsetsTopic(name=t.name, partitions=parts))
        return ListOffsetsResponse(version=request.API_VERSION, throttle_time_ms=0,
                                   topics=topics)

    # ---------------------------------------------------------------- groups
    def _FindCoordinatorRequest(self, request):
        """This listener coordinates every group (and, later, transaction)."""
        v = request.API_VERSION
        if v >= 4:
            return FindCoordinatorResponse(version=v, throttle_time_ms=0, coordinators=[
                FindCoordinatorResponse.Coordinator(
                    key=k, node_id=self.node_id, host=self.host, port=self.port,
                    error_code=NONE, error_message=None) for k in request.coordinator_keys])
        return FindCoordinatorResponse(version=v, throttle_time_ms=0, error_code=NONE,
                                       error_message=None, node_id=self.node_id,
                                       host=self.host, port=self.port)

    def _JoinGroupRequest(self, request):
        v = request.API_VERSION
        sdk = self._sdk_members(request.group_id)
        if sdk:  # (one name, two group protocols: each would take the other's queues)
            log.warning("kafka listener: group %r refused: the SDK's consumers %s use that "
                        "name; a Kafka group needs a name of its own", request.group_id,
                        ", ".join(sdk[:5]))
            return JoinGroupResponse(
                version=v, throttle_time_ms=0, error_code=23, generation_id=-1,
                protocol_type=request.protocol_type, protocol_name="", leader="",
                skip_assignment=False, member_id=request.member_id, members=[])
        got = self.groups.join(
            request.group_id, request.member_id, request.protocol_type,
            [(p.name, p.metadata) for p in request.protocols], request.session_timeout_ms,
            request.rebalance_timeout_ms if v >= 1 else request.session_timeout_ms,
            client_id=(request.header.client_id or "member"), require_known_id=v >= 4)
        return JoinGroupResponse(
            version=v, throttle_time_ms=0, error_code=got.error, generation_id=got.generation,
            protocol_type=request.protocol_type, protocol_name=got.protocol or "",
            leader=got.leader, skip_assignment=False, member_id=got.member_id,
            members=[JoinGroupResponse.JoinGroupResponseMember(
                member_id=mid, group_instance_id=None, metadata=meta)
                for mid, meta in got.members])

    def _sdk_members(self, group: str) -> list[str]:
        """The SDK's live consumers of ``group`` (the cluster's membership)."""
        return self._sdk_groups().get(group, [])

    def _SyncGroupRequest(self, request):
        error, assignment = self.groups.sync(
            request.group_id, request.generation_id, request.member_id,
            {a.member_id: a.assignment for a in request.assignments})
        return SyncGroupResponse(version=request.API_VERSION, throttle_time_ms=0,
                                 error_code=error, protocol_type=request.protocol_type,
                                 protocol_name=request.protocol_name, assignment=assignment)

    def _HeartbeatRequest(self, request):
        return HeartbeatResponse(version=request.API_VERSION, throttle_time_ms=0,
                                 error_code=self.groups.heartbeat(
                                     request.group_id, request.generation_id,
                                     request.member_id))

    def _LeaveGroupRequest(self, request):
        v = request.API_VERSION
        ids = [request.member_id] if v < 3 else [m.member_id for m in request.members]
        errors = self.groups.leave(request.group_id, ids)
        return LeaveGroupResponse(
            version=v, throttle_time_ms=0, error_code=errors[0] if v < 3 else NONE,
            members=[LeaveGroupResponse.MemberResponse(member_id=mid, group_instance_id=None,
                                                       error_code=e)
                     for mid, e in zip(ids, errors)])

    def _OffsetCommitRequest(self, request):
        """Offsets go to RayMQ's offsets store (the group's name shared with the SDK's
        groups: ``raymq group`` shows them)."""
        error = self.groups.check_commit(request.group_id,
                                         request.generation_id_or_member_epoch,
                                         request.member_id)
        topics = []
        for t in request.topics:
            routes = self._routes(t.name)
            codes = {}
            by_shard: dict[int, dict] = {}
            for p in t.partitions:
                if error:
                    codes[p.partition_index] = error
                elif (shard := shard_of(routes, p.partition_index)) is None:
                    codes[p.partition_index] = UNKNOWN_TOPIC_OR_PARTITION
                else:
                    by_shard.setdefault(shard, {})[
                        (t.name, p.partition_index)] = p.committed_offset
            for shard, offsets in by_shard.items():
                try:
                    self.mq.transport.call(shard, "commit_offsets", request.group_id,
                                           offsets, timeout_s=30)
                    code = NONE
                except Exception as err:
                    code = error_code(err)
                codes.update({q: code for _t, q in offsets})
            topics.append(OffsetCommitResponse.OffsetCommitResponseTopic(
                name=t.name, partitions=[
                    OffsetCommitResponse.OffsetCommitResponseTopic.OffsetCommitResponsePartition(
                        partition_index=q, error_code=c) for q, c in codes.items()]))
        return OffsetCommitResponse(version=request.API_VERSION, throttle_time_ms=0,
                                    topics=topics)

    def _OffsetFetchRequest(self, request):
        """Committed offsets (-1: none); every partition of the group's topics when the
        request names none."""
        asked = [(t.name, list(t.partition_indexes)) for t in request.topics] \
            if request.topics is not None else []
        topics = []
        for name, indexes in asked:
            routes = self._routes(name)
            found: dict[int, tuple[int, int]] = {}
            by_shard: dict[int, list] = {}
            for q in indexes:
                if (shard := shard_of(routes, q)) is None:
                    found[q] = (-1, UNKNOWN_TOPIC_OR_PARTITION)
                else:
                    by_shard.setdefault(shard, []).append((name, q))
            for shard, queues in by_shard.items():
                try:
                    got = self.mq.transport.call(shard, "get_offsets", request.group_id,
                                                 queues, timeout_s=30)
                    found.update({q: (got[(t, q)], NONE) for t, q in queues})
                except Exception as err:
                    found.update({q: (-1, error_code(err)) for _t, q in queues})
            P = OffsetFetchResponse.OffsetFetchResponseTopic.OffsetFetchResponsePartition
            topics.append(OffsetFetchResponse.OffsetFetchResponseTopic(name=name, partitions=[
                P(partition_index=q, committed_offset=off, committed_leader_epoch=-1,
                  metadata="", error_code=code) for q, (off, code) in found.items()]))
        return OffsetFetchResponse(version=request.API_VERSION, throttle_time_ms=0,
                                   topics=topics, error_code=NONE)

def api_versions_response(version: int, error_code: int):
    """ApiVersions' answer at ``version``: the APIs and versions served."""
    return ApiVersionsResponse(
        version=version, error_code=error_code, throttle_time_ms=0,
        api_keys=[ApiVersionsResponse.ApiVersion(api_key=k, min_version=lo, max_version=hi)
                  for k, lo, hi in api_versions_table()])


def unsupported_api_versions():
    """ApiVersions asked at a version not served: version 0, UNSUPPORTED_VERSION, and the
    versions that are (the client asks again at one of them)."""
    return api_versions_response(0, UNSUPPORTED_VERSION)


def error_code(err: BaseException) -> int:
    """Kafka's error code for ``err``."""
    for kind, code in ERROR_CODES:
        if isinstance(err, kind):
            return code
    return UNKNOWN_SERVER_ERROR




def _isolation(request) -> str:
    """A Fetch's or ListOffsets' isolation level as a pull names it (level 1: read
    committed; ListOffsets before v2 has none: uncommitted)."""
    return "read_committed" if getattr(request, "isolation_level", 0) == 1 \
        else "read_uncommitted"


def _int(text: str | None) -> int | None:
    return None if text is None else int(text)
