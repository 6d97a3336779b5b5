"""What each Kafka API answers, from the cluster as the SDK sees it (``mq``).

A topic is a topic, a partition is a queue.  One listener is one broker to a Kafka
client: it leads every partition (it forwards to the shards), so a client sends all
its requests to it.  System, retry and dead-letter topics are not listed.  Pure
Python over an ``mq`` (the SDK's ``RayMQ`` or anything with its ``topics()``).
"""
from __future__ import annotations

from kafka.protocol.metadata import ApiVersionsResponse, MetadataResponse

from raymq.actors.protocol import is_system_topic
from raymq.wire.frames import NONE, UNKNOWN_TOPIC_OR_PARTITION, UNSUPPORTED_VERSION, \
    api_versions_table

#: The cluster id Metadata answers (one RayMQ behind a listener).
CLUSTER_ID = "raymq"

_Topic = MetadataResponse.MetadataResponseTopic
_Partition = _Topic.MetadataResponsePartition
_Broker = MetadataResponse.MetadataResponseBroker


class KafkaApis:
    """The answers of one listener, advertised as broker ``node_id`` at
    ``host:port``."""

    def __init__(self, mq, host: str, port: int, node_id: int = 0):
        self.mq = mq
        self.host, self.port, self.node_id = host, port, node_id

    def handle(self, request):
        """The response to ``request`` (a decoded request of a served API)."""
        return getattr(self, f"_{type(request).__name__}")(request)

    # ---------------------------------------------------------- ApiVersions
    def _ApiVersionsRequest(self, request):
        return api_versions_response(request.API_VERSION, NONE)

    # ------------------------------------------------------------- Metadata
    def _MetadataRequest(self, request):
        v = request.API_VERSION
        listed = {name: t for name, t in self.mq.topics().items() if not is_system_topic(name)}
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

