"""RayMQ's client side: ``connect()`` and the public names users rely on."""
from cluster.config import ClusterConfig
from cluster.message import Message, MessageExt, SendResult, SendStatus

__all__ = ["connect", "Message", "MessageExt", "SendResult", "SendStatus", "ClusterConfig",
           "TransactionListener", "LocalTransactionState"]


def __getattr__(name):  # Ray-dependent names load on first use
    if name == "connect":
        from cluster.client import connect
        return connect
    if name in ("TransactionListener", "LocalTransactionState"):
        from cluster import transaction
        return getattr(transaction, name)
    raise AttributeError(name)
