"""Kafka's frames: a 4-byte size, a request header, a body -- decoded and encoded with
kafka-python's classes generated from Kafka's JSON message schemas.  Pure: no sockets,
no Ray.

``decode_request`` gives the request (its header attached) or raises ``BadFrame``
(the connection is closed: Kafka answers a request it cannot parse by closing it);
``encode_response`` frames a response (built at its request's version) with the
request's correlation id; what every API's answer shares (error codes, the cluster id,
a partition's shard: ``shard_of``) is here too.
Only the APIs and versions in ``SERVED`` are decoded -- the same table ApiVersions
advertises, so a client never uses an API this listener does not serve.
"""
from __future__ import annotations

import struct

from kafka.protocol.admin.cluster import DescribeClusterRequest
from kafka.protocol.admin.configs import DescribeConfigsRequest
from kafka.protocol.admin.groups import DescribeGroupsRequest, ListGroupsRequest
from kafka.protocol.admin.topics import (CreatePartitionsRequest, CreateTopicsRequest,
                                         DeleteTopicsRequest)
from kafka.protocol.admin.transactions import (DescribeProducersRequest,
                                               DescribeTransactionsRequest,
                                               ListTransactionsRequest)
from kafka.protocol.consumer import FetchRequest, ListOffsetsRequest
from kafka.protocol.consumer.group import (HeartbeatRequest, JoinGroupRequest, LeaveGroupRequest,
                                           OffsetCommitRequest, OffsetDeleteRequest,
                                           OffsetFetchRequest, SyncGroupRequest)
from kafka.protocol.metadata import ApiVersionsRequest, FindCoordinatorRequest, MetadataRequest
from kafka.protocol.producer import ProduceRequest
from kafka.protocol.producer.transaction import (AddOffsetsToTxnRequest,
                                                 AddPartitionsToTxnRequest, EndTxnRequest,
                                                 InitProducerIdRequest, TxnOffsetCommitRequest)

#: The largest request frame taken (a bigger one closes its connection).
MAX_FRAME_BYTES = 100 << 20

#: API key -> (request class, least version, greatest version) served.
SERVED = {
    ApiVersionsRequest.API_KEY: (ApiVersionsRequest, 0, 3),
    MetadataRequest.API_KEY: (MetadataRequest, 0, 12),
    ProduceRequest.API_KEY: (ProduceRequest, 3, 12),     # (13+ name topics by id)
    FetchRequest.API_KEY: (FetchRequest, 4, 12),
    ListOffsetsRequest.API_KEY: (ListOffsetsRequest, 1, 7),
    FindCoordinatorRequest.API_KEY: (FindCoordinatorRequest, 0, 4),
    JoinGroupRequest.API_KEY: (JoinGroupRequest, 0, 7),
    SyncGroupRequest.API_KEY: (SyncGroupRequest, 0, 5),
    HeartbeatRequest.API_KEY: (HeartbeatRequest, 0, 4),
    LeaveGroupRequest.API_KEY: (LeaveGroupRequest, 0, 4),
    OffsetCommitRequest.API_KEY: (OffsetCommitRequest, 2, 8),
    OffsetFetchRequest.API_KEY: (OffsetFetchRequest, 1, 7),
    OffsetDeleteRequest.API_KEY: (OffsetDeleteRequest, 0, 0),
    InitProducerIdRequest.API_KEY: (InitProducerIdRequest, 0, 4),
    AddPartitionsToTxnRequest.API_KEY: (AddPartitionsToTxnRequest, 0, 3),  # (4+: brokers')
    AddOffsetsToTxnRequest.API_KEY: (AddOffsetsToTxnRequest, 0, 3),
    EndTxnRequest.API_KEY: (EndTxnRequest, 0, 4),    # (5+: an epoch a transaction, KIP-890)
    TxnOffsetCommitRequest.API_KEY: (TxnOffsetCommitRequest, 0, 3),
    CreateTopicsRequest.API_KEY: (CreateTopicsRequest, 2, 6),     # (7+ answer topic ids)
    DeleteTopicsRequest.API_KEY: (DeleteTopicsRequest, 1, 5),     # (6+ name them by id)
    CreatePartitionsRequest.API_KEY: (CreatePartitionsRequest, 0, 3),
    DescribeClusterRequest.API_KEY: (DescribeClusterRequest, 0, 1),
    DescribeConfigsRequest.API_KEY: (DescribeConfigsRequest, 1, 4),
    ListGroupsRequest.API_KEY: (ListGroupsRequest, 0, 4),    # (5+: group types, KIP-848)
    DescribeGroupsRequest.API_KEY: (DescribeGroupsRequest, 0, 5),
    ListTransactionsRequest.API_KEY: (ListTransactionsRequest, 0, 1),
    DescribeTransactionsRequest.API_KEY: (DescribeTransactionsRequest, 0, 0),
    DescribeProducersRequest.API_KEY: (DescribeProducersRequest, 0, 0),
}

#: Kafka's error codes used here (``kafka.errors`` names them).
NONE, UNKNOWN_TOPIC_OR_PARTITION, UNSUPPORTED_VERSION = 0, 3, 35
#: The cluster id Metadata and DescribeCluster answer (one RayMQ behind a listener).
CLUSTER_ID = "raymq"

_KEY_VERSION = struct.Struct(">hh")
_SIZE = struct.Struct(">i")


class BadFrame(Exception):
    """A frame this listener cannot take: its connection is closed (and only it)."""


class UnsupportedVersion(Exception):
    """An ApiVersions request of a version not served: answered at version 0 with
    UNSUPPORTED_VERSION and the versions served, as Kafka does."""

    def __init__(self, correlation_id: int):
        super().__init__(correlation_id)
        self.correlation_id = correlation_id


def frame_size(head: bytes, max_bytes: int = MAX_FRAME_BYTES) -> int:
    """The size a frame's first four bytes announce; ``BadFrame`` when it is not a
    size this listener takes."""
    (size,) = _SIZE.unpack(head)
    if not 8 <= size <= max_bytes:
        raise BadFrame(f"frame of {size} bytes (this listener takes 8..{max_bytes})")
    return size


def decode_request(payload: bytes):
    """The request in ``payload`` (a frame without its size), its header attached."""
    if len(payload) < 8:
        raise BadFrame(f"a request of {len(payload)} bytes is shorter than its header")
    key, version = _KEY_VERSION.unpack_from(payload)
    served = SERVED.get(key)
    if served is None:
        raise BadFrame(f"API key {key} is not served")
    cls, low, high = served
    if not low <= version <= high:
        if key == ApiVersionsRequest.API_KEY:  # (its answer says which versions are)
            raise UnsupportedVersion(struct.unpack_from(">i", payload, 4)[0])
        raise BadFrame(f"{cls.__name__} v{version} is not served ({low}..{high})")
    try:
        return cls.decode(bytes(payload), version=version, header=True)
    except Exception as err:  # (whatever a malformed body decodes into)
        raise BadFrame(f"{cls.__name__} v{version} does not parse: "
                       f"{type(err).__name__}: {err}") from None


def encode_response(response, correlation_id: int) -> bytes:
    """``response`` (built at its request's version) framed with ``correlation_id``."""
    response.with_header(correlation_id=correlation_id)
    return bytes(response.encode(header=True, framed=True))


def api_versions_table() -> list[tuple[int, int, int]]:
    """``(api key, least, greatest version)`` of every API served (what ApiVersions
    advertises)."""
    return [(key, low, high) for key, (_cls, low, high) in sorted(SERVED.items())]


def shard_of(routes: list[int] | None, index: int) -> int | None:
    """The shard of a topic's partition ``index`` (``routes``: its queues' shards; None:
    no such topic), None when the topic has no such partition."""
    if routes is None or not 0 <= index < len(routes):
        return None
    return routes[index]
