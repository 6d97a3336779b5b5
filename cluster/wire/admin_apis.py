"""What the Kafka describe and list APIs answer (an admin client's view of RayMQ):
DescribeCluster, DescribeConfigs (a topic's retention), ListGroups and DescribeGroups
(the listener's Kafka groups, and the SDK's groups as protocol type ``raymq``),
ListTransactions and DescribeTransactions (RayMQ's coordinators), DescribeProducers (the
open transactions of each partition, with where each began: what Kafka's tools look for
in a hanging transaction), OffsetDelete (a
group's committed offsets forgotten, in RayMQ's offsets store).  A mixin of
``KafkaApis``: pure Python over an ``mq``.
"""
from __future__ import annotations

import logging

from kafka.protocol.admin.cluster import DescribeClusterResponse
from kafka.protocol.admin.configs import DescribeConfigsResponse
from kafka.protocol.admin.groups import DescribeGroupsResponse, ListGroupsResponse
from kafka.protocol.admin.transactions import (DescribeProducersResponse,
                                               DescribeTransactionsResponse,
                                               ListTransactionsResponse)
from kafka.protocol.consumer.group import OffsetDeleteResponse

from raymq.actors.protocol import is_system_topic
from raymq.wire.frames import CLUSTER_ID, NONE, UNKNOWN_TOPIC_OR_PARTITION, shard_of

log = logging.getLogger("raymq.kafka")

TRANSACTIONAL_ID_NOT_FOUND = 105
GROUP_SUBSCRIBED_TO_TOPIC = 86
#: DescribeConfigs' resource types.
TOPIC, BROKER = 2, 4
#: The protocol type the SDK's own groups are listed with.
SDK_GROUPS = "raymq"
#: Kafka's names of the transaction states (RayMQ's are the same, upper case).
_TXN_STATES = {"EMPTY": "Empty", "ONGOING": "Ongoing", "PREPARE_COMMIT": "PrepareCommit",
               "PREPARE_ABORT": "PrepareAbort", "COMPLETE_COMMIT": "CompleteCommit",
               "COMPLETE_ABORT": "CompleteAbort", "DEAD": "Dead"}
_Config = DescribeConfigsResponse.DescribeConfigsResult.DescribeConfigsResourceResult
_Described = DescribeGroupsResponse.DescribedGroup
_Member = _Described.DescribedGroupMember


class AdminApis:
    """(mixed into ``KafkaApis``: it has ``mq``, ``groups``, ``txns``, ``host``, ``port``
    and ``node_id``)"""

    def _DescribeClusterRequest(self, request):
        B = DescribeClusterResponse.DescribeClusterBroker
        return DescribeClusterResponse(
            version=request.API_VERSION, throttle_time_ms=0, error_code=NONE,
            error_message=None, endpoint_type=1, cluster_id=CLUSTER_ID,
            controller_id=self.node_id, brokers=[B(broker_id=self.node_id, host=self.host,
                                                   port=self.port, rack=None)])

    def _DescribeConfigsRequest(self, request):
        """A topic's retention as Kafka names it (-1: none); a broker has no config to
        describe here (RayMQ's settings are ``raymq status``'s)."""
        v, out = request.API_VERSION, []
        R = DescribeConfigsResponse.DescribeConfigsResult
        for res in request.resources:
            code, message, configs = NONE, None, []
            if res.resource_type == TOPIC:
                t = None if is_system_topic(res.resource_name) else \
                    self.mq.topics().get(res.resource_name)
                if t is None:
                    code, message = UNKNOWN_TOPIC_OR_PARTITION, "no such topic"
                else:
                    values = {"retention.ms": t.get("retention_ms"),
                              "retention.bytes": t.get("retention_bytes"),
                              "cleanup.policy": "delete"}
                    configs = [_Config(name=k, value=None if val is None else str(val),
                                       read_only=k == "cleanup.policy", config_source=1,
                                       is_default=False, is_sensitive=False, synonyms=[],
                                       config_type=0, documentation=None)
                               for k, val in values.items()
                               if res.configuration_keys is None
                               or k in res.configuration_keys]
            elif res.resource_type != BROKER:
                code, message = 42, f"resource type {res.resource_type} is not described"
            out.append(R(error_code=code, error_message=message,
                         resource_type=res.resource_type, resource_name=res.resource_name,
                         configs=configs))
        return DescribeConfigsResponse(version=v, throttle_time_ms=0, results=out)

    def _ListGroupsRequest(self, request):
        v = request.API_VERSION
        states = set(getattr(request, "states_filter", None) or [])
        listed = [(g, kind, state) for g, kind, state in self.groups.listed()]
        listed += [(g, SDK_GROUPS, "Stable") for g in self._sdk_groups()]
        G = ListGroupsResponse.ListedGroup
        return ListGroupsResponse(version=v, throttle_time_ms=0, error_code=NONE, groups=[
            G(group_id=g, protocol_type=kind or "", group_state=state, group_type="classic")
            for g, kind, state in sorted(listed) if not states or state in states])

    def _DescribeGroupsRequest(self, request):
        v, out = request.API_VERSION, []
        sdk = self._sdk_groups()
        for group in request.groups:
            d = self.groups.describe(group)
            if d is not None:
                members = [_Member(member_id=mid, group_instance_id=None, client_id=mid,
                                   client_host="", member_metadata=meta,
                                   member_assignment=assignment)
                           for mid, meta, assignment in self.groups.members_of(group)]
                out.append(_Described(error_code=NONE, error_message=None, group_id=group,
                                      group_state=d["state"],
                                      protocol_type=d["protocol_type"] or "",
                                      protocol_data=d["protocol"] or "", members=members))
            elif group in sdk:
                out.append(_Described(error_code=NONE, error_message=None, group_id=group,
                                      group_state="Stable", protocol_type=SDK_GROUPS,
                                      protocol_data="", members=[
                                          _Member(member_id=m, group_instance_id=None,
                                                  client_id=m, client_host="",
                                                  member_metadata=b"", member_assignment=b"")
                                          for m in sdk[group]]))
            else:  # (Kafka: a group nobody has is "Dead", not an error)
                out.append(_Described(error_code=NONE, error_message=None, group_id=group,
                                      group_state="Dead", protocol_type="", protocol_data="",
                                      members=[]))
        return DescribeGroupsResponse(version=v, throttle_time_ms=0, groups=out)

    def _OffsetDeleteRequest(self, request):
        """A group's committed offsets of the partitions named forgotten, one delete per
        shard; refused (GROUP_SUBSCRIBED_TO_TOPIC) while the group has members -- the
        Kafka group's or the SDK's -- as they would commit again."""
        group = request.group_id
        d = self.groups.describe(group)
        busy = bool(d and d["members"]) or bool(self._sdk_groups().get(group))
        codes, by_shard = {}, {}
        for t in request.topics:
            routes = self._routes(t.name)
            for p in t.partitions:
                key = (t.name, p.partition_index)
                shard = shard_of(routes, p.partition_index)
                if busy:
                    codes[key] = GROUP_SUBSCRIBED_TO_TOPIC
                elif shard is None:
                    codes[key] = UNKNOWN_TOPIC_OR_PARTITION
                else:
                    by_shard.setdefault(shard, []).append(key)
        for shard, queues in by_shard.items():
            try:
                self.mq.transport.call(shard, "delete_offsets", group, queues, timeout_s=30)
                code = NONE
            except Exception as err:
                code = self._code(err)
            codes.update(dict.fromkeys(queues, code))
        T = OffsetDeleteResponse.OffsetDeleteResponseTopic
        by_topic: dict = {}
        for (topic, q), code in codes.items():
            by_topic.setdefault(topic, []).append(
                T.OffsetDeleteResponsePartition(partition_index=q, error_code=code))
        return OffsetDeleteResponse(version=request.API_VERSION, error_code=NONE,
                                    throttle_time_ms=0, topics=[
                                        T(name=k, partitions=ps) for k, ps in by_topic.items()])

    def _DescribeProducersRequest(self, request):
        """Per partition, the producers with a transaction open in it and the offset it
        began at (RayMQ's shards hold that; an idempotent producer's sequences are not
        kept per partition there: not listed)."""
        T = DescribeProducersResponse.TopicResponse
        P = T.PartitionResponse
        open_txns: dict = {}
        for held in self.mq.admin.tx_hanging():
            topic, q = held["queue"].rsplit("/", 1)  # ("TOPIC/QUEUE")
            open_txns.setdefault((topic, int(q)), []).append(held)
        out = []
        for t in request.topics:
            routes = self._routes(t.name)
            parts = []
            for q in t.partition_indexes:
                if shard_of(routes, q) is None:
                    parts.append(P(partition_index=q, error_code=UNKNOWN_TOPIC_OR_PARTITION,
                                   error_message="no such partition", active_producers=[]))
                    continue
                active = []
                for held in open_txns.get((t.name, q), []):
                    pid, epoch = self._kafka_ids(held)
                    active.append(P.ProducerState(
                        producer_id=pid, producer_epoch=epoch, last_sequence=-1,
                        last_timestamp=-1, coordinator_epoch=-1,
                        current_txn_start_offset=held["lso"]))
                parts.append(P(partition_index=q, error_code=NONE, error_message=None,
                               active_producers=active))
            out.append(T(name=t.name, partitions=parts))
        return DescribeProducersResponse(version=request.API_VERSION, throttle_time_ms=0,
                                         topics=out)

    def _sdk_groups(self) -> dict[str, list[str]]:
        try:
            groups = self.mq.control.call("groups", timeout_s=30)
        except Exception as err:  # (the controller away: Kafka's groups only)
            log.info("kafka listener: the SDK's groups not known: %s", err)
            return {}
        return {g: sorted(d.get("members") or []) for g, d in groups.items()}

    def _kafka_ids(self, t: dict) -> tuple[int, int]:
        """The producer id and epoch a Kafka client knows a transactional id by (its
        session here), else RayMQ's own."""
        s = self.txns.known(t["transactional_id"])
        return (s.kafka_pid, s.kafka_epoch) if s is not None else \
            (t["producer_id"], t["epoch"] % 32767)

    def _ListTransactionsRequest(self, request):
        states = set(request.state_filters or [])
        pids = set(request.producer_id_filters or [])
        min_ms = getattr(request, "duration_filter", -1)
        T = ListTransactionsResponse.TransactionState
        out = []
        for t in self.mq.admin.tx_list():
            state = _TXN_STATES.get(t["state"], t["state"])
            if (states and state not in states) or (pids and t["producer_id"] not in pids) \
                    or (min_ms >= 0 and (t["age_ms"] or 0) < min_ms):
                continue
            pid, _epoch = self._kafka_ids(t)
            out.append(T(transactional_id=t["transactional_id"], producer_id=pid,
                         transaction_state=state))
        return ListTransactionsResponse(version=request.API_VERSION, throttle_time_ms=0,
                                        error_code=NONE, unknown_state_filters=sorted(
                                            states - set(_TXN_STATES.values())),
                                        transaction_states=out)

    def _DescribeTransactionsRequest(self, request):
        S = DescribeTransactionsResponse.TransactionState
        out = []
        for tid in request.transactional_ids:
            try:
                t = self.mq.admin.tx_describe(tid)
            except Exception as err:
                log.info("kafka listener: describing %r: %s", tid, err)
                out.append(S(error_code=TRANSACTIONAL_ID_NOT_FOUND, transactional_id=tid,
                             transaction_state="", transaction_timeout_ms=0,
                             transaction_start_time_ms=-1, producer_id=-1, producer_epoch=-1,
                             topics=[]))
                continue
            pid, epoch = self._kafka_ids(t)
            by_topic: dict = {}
            for _shard, topic, q in t["queues"]:
                by_topic.setdefault(topic, []).append(q)
            out.append(S(error_code=NONE, transactional_id=tid,
                         transaction_state=_TXN_STATES.get(t["state"], t["state"]),
                         transaction_timeout_ms=t["timeout_ms"],
                         transaction_start_time_ms=-1, producer_id=pid,
                         producer_epoch=epoch, topics=[
                             S.TopicData(topic=k, partitions=sorted(ps))
                             for k, ps in sorted(by_topic.items())]))
        return DescribeTransactionsResponse(version=request.API_VERSION, throttle_time_ms=0,
                                            transaction_states=out)
