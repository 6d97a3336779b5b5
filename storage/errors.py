"""The one error hierarchy of RayMQ.
Owns every error class, with its stable ``code`` and ``retriable`` flag.

Every error has a stable ``code`` and a ``retriable`` flag: the SDK retries
retriable errors with back-off and surfaces the others at once.  Expected
outcomes (a flush that timed out, a duplicate send) are values, not errors.
"""
from __future__ import annotations


class RayMQError(Exception):
    """Base of every RayMQ error."""

    code = "RAYMQ_ERROR"
    retriable = False

    def __init__(self, *args):
        # one line, always: a name or value quoted from a request may hold a line break
        if args and isinstance(args[0], str) and ("\n" in args[0] or "\r" in args[0]):
            args = (args[0].replace("\r", "\\r").replace("\n", "\\n"),) + args[1:]
        super().__init__(*args)

    def __reduce__(self):  # keep the message when pickled across Ray calls
        return (self.__class__, self.args)


class ConfigError(RayMQError, ValueError):
    code = "CONFIG_INVALID"


class StorageError(RayMQError):
    code = "STORAGE_ERROR"


class CorruptLogError(StorageError):
    """A record in the middle of a file failed its checks; nothing was skipped."""

    code = "CORRUPT_LOG"


class MessageTooLargeError(RayMQError, ValueError):
    code = "MESSAGE_TOO_LARGE"


class InvalidMessageError(RayMQError, ValueError):
    code = "MESSAGE_INVALID"


class UnknownTopicError(RayMQError, LookupError):
    code = "TOPIC_NOT_EXIST"


class TopicExistsError(RayMQError):
    code = "TOPIC_EXISTS"


class ReservedNameError(InvalidMessageError):
    """A reserved system topic or system property used by an application."""

    code = "RESERVED_NAME"


class OffsetOutOfRangeError(RayMQError, ValueError):
    code = "OFFSET_OUT_OF_RANGE"


class DiskFullError(RayMQError, OSError):
    """A shard refuses writes: its data directory's filesystem is fuller than
    ``disk_full_ratio``.  Retriable: writes resume by themselves once retention (or the
    operator) frees space; reads, consumption and offset commits go on meanwhile."""

    code = "DISK_FULL"
    retriable = True


class BrokerUnavailableError(RayMQError):
    """The actor serving a request is gone or restarting; retrying later can succeed."""

    code = "BROKER_UNAVAILABLE"
    retriable = True


class ControllerRecoveringError(BrokerUnavailableError):
    """The controller lost its files (or is new) and is taking its topics and groups back
    from the replicas' records: asked again in a moment, it answers."""

    code = "CONTROLLER_RECOVERING"


class RequestTimeoutError(RayMQError, TimeoutError):
    code = "REQUEST_TIMEOUT"
    retriable = True


class QuotaExceededError(RayMQError):
    """A documented quota (``max_topics``, ``max_groups``) would be passed; nothing was
    created.  Not retriable until something is removed or the quota raised."""

    code = "QUOTA_EXCEEDED"


class AlreadyDeliveredError(RayMQError):
    """A scheduled message cannot be cancelled: it was already delivered to its queue."""

    code = "ALREADY_DELIVERED"


class NotScheduledError(InvalidMessageError):
    """``cancel_scheduled`` was given the id of a message that is not waiting for a
    deliver time (not a timer or delay-level message)."""

    code = "NOT_SCHEDULED"


# -- Kafka-style transactions


class ProducerFencedError(RayMQError):
    """A newer instance of this transactional id started (its epoch is higher): this one
    may not send, send offsets or commit any more; its open transaction was aborted."""

    code = "PRODUCER_FENCED"


class TransactionAbortedError(RayMQError):
    """The transaction was aborted (its timeout passed, an operator aborted it, or a
    newer producer instance fenced it) before it could commit; nothing of it is visible."""

    code = "TRANSACTION_ABORTED"


class TransactionAbortableError(RayMQError):
    """A write of the open transaction failed after it was sent, so whether its shard
    stored it is unknown: the transaction can only be aborted (Kafka's abortable error).
    ``commit`` aborts it and raises ``TransactionAbortedError``; ``abort`` ends it."""

    code = "TRANSACTION_ABORTABLE"


class InvalidTxnStateError(RayMQError):
    """A transaction call out of order (e.g. a commit with no transaction begun, a write to
    a queue not registered in the ongoing transaction)."""

    code = "INVALID_TXN_STATE"


class ConcurrentTransactionsError(RayMQError):
    """The previous transaction of this producer is still being completed; retry shortly."""

    code = "CONCURRENT_TRANSACTIONS"
    retriable = True


class OutOfOrderSequenceError(RayMQError):
    """A transactional write skipped a sequence number (an earlier write is missing)."""

    code = "OUT_OF_ORDER_SEQUENCE"


class NotEnoughReplicasError(RayMQError):
    """Fewer replicas of a shard are in sync than ``min_insync_replicas``: nothing is
    acknowledged until enough are (retriable)."""

    code = "NOT_ENOUGH_REPLICAS"
    retriable = True


class NotLeaderError(RayMQError):
    """A request carried a leader epoch that is not the group's current one (a deposed
    leader, or a client with stale routes: ask the controller again)."""

    code = "NOT_LEADER"
    retriable = True


# -- the cluster: connecting, deploying, the data channel


class NotDeployedError(RayMQError):
    """RayMQ is not deployed, or only partly, in the Ray cluster this process joined:
    ``raymq up`` deploys it (nothing else does, but ``connect()`` on an embedded Ray)."""

    code = "NOT_DEPLOYED"


class ConfigMismatchError(RayMQError, ValueError):
    """Settings asked of ``raymq up`` differ from those the running RayMQ has; nothing
    was changed."""

    code = "CONFIG_MISMATCH"


class RayUnreachableError(RayMQError, ConnectionError):
    """No Ray cluster answers where this process was told (or found) to join one, or none
    was found.  Not retriable: the message says what to fix."""

    code = "RAY_UNREACHABLE"


class RayAuthError(RayMQError, ConnectionError):
    """A Ray cluster answers but refuses this process: token authentication is on at one
    end only, or the tokens differ.  Not retriable: the message says what to fix."""

    code = "RAY_AUTH"


class ProtocolVersionError(RayMQError):
    """The two ends of a data channel speak different protocol versions (different
    RayMQ releases); retrying does not help, upgrading the older side does."""

    code = "PROTOCOL_VERSION_MISMATCH"
    retriable = False


class ChannelRefusedError(RayMQError):
    """The endpoint refused a request: a method not on the channel, a pickle naming a
    class a request may not build, a frame over the size limit, a pull over its caps.
    Retrying the same request does not help."""

    code = "CHANNEL_REFUSED"
    retriable = False


class ChannelTLSError(RayMQError):
    """Ray's TLS is on (``RAY_USE_TLS``) but its certificates cannot be loaded here."""

    code = "CHANNEL_TLS"
    retriable = False


# -- pipelines


class JavaMissingError(RayMQError):
    """Spark needs Java 17 (or newer) on this machine's PATH."""

    code = "JAVA_MISSING"
