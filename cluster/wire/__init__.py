"""Kafka clients reach RayMQ (issue 36): a Kafka wire-protocol listener.

The listener is a client of the cluster like the SDK (it sits above the data channel:
client -> channel -> replica -> shard -> store), speaking Kafka's protocol on one side
and the SDK's calls on the other.  ``frames``: the frames and their encoding (Kafka's
own message schemas, through kafka-python's generated protocol classes -- no
hand-written codec); ``apis``: what each API answers; ``listener``: the sockets.
"""
