"""RayMQ: ``from raymq import connect, Message, ...`` -- the client SDK and its public names.

This package (the card's ``cluster/`` folder) is the client layer; the broker is
``raymq.actors``, the storage engine ``raymq.storage``, the pipelines ``raymq.jobs``.
"""
from raymq.actors.config import ClusterConfig
from raymq.message import Message, MessageExt, SendResult, SendStatus
from raymq.storage.errors import (AlreadyDeliveredError, BrokerUnavailableError, ChannelRefusedError,
                                  ChannelTLSError, ControllerRecoveringError, ConcurrentTransactionsError, ConfigError,
                                  ConfigMismatchError, CorruptLogError, InvalidMessageError,
                                  InvalidTxnStateError, JavaMissingError, MessageTooLargeError,
                                  NotEnoughReplicasError, NotLeaderError,
                                  OutOfOrderSequenceError, ProducerFencedError,
                                  TransactionAbortedError, TransactionAbortableError,
                                  NotDeployedError, NotScheduledError, OffsetOutOfRangeError,
                                  DiskFullError,
                                  ProtocolVersionError, QuotaExceededError, RayAuthError,
                                  RayMQError, RayUnreachableError, RequestTimeoutError,
                                  ReservedNameError, StorageError, TopicExistsError,
                                  UnknownTopicError)

__all__ = ["connect", "Message", "MessageExt", "SendResult", "SendStatus", "ClusterConfig",
           "TransactionListener", "LocalTransactionState",
           "RayMQError", "ConfigError", "StorageError", "CorruptLogError", "MessageTooLargeError",
           "InvalidMessageError", "UnknownTopicError", "TopicExistsError", "ReservedNameError",
           "OffsetOutOfRangeError", "DiskFullError", "BrokerUnavailableError",
           "RequestTimeoutError",
           "NotDeployedError", "ConfigMismatchError", "RayUnreachableError", "RayAuthError",
           "ProtocolVersionError", "ChannelRefusedError", "ChannelTLSError",
           "QuotaExceededError", "ProducerFencedError", "TransactionAbortedError",
           "TransactionAbortableError", "InvalidTxnStateError", "ConcurrentTransactionsError", "OutOfOrderSequenceError",
           "JavaMissingError", "AlreadyDeliveredError", "NotScheduledError",
           "NotEnoughReplicasError", "NotLeaderError", "ControllerRecoveringError"]


def __getattr__(name):  # Ray-dependent names load on first use
    if name == "connect":
        from raymq.client import connect
        return connect
    if name in ("TransactionListener", "LocalTransactionState"):
        from raymq import transaction_producer
        return getattr(transaction_producer, name)
    raise AttributeError(name)
