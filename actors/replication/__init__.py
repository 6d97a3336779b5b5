"""Replication of a shard's (or a transaction coordinator's) log over a group of replicas:
RocketMQ 5's controller mode with Kafka's rules.

It owns, each in a module of its own: what the controller says of a group and what a
replica keeps of it (``assignment``); a replica and its role (``replica``); the leader's
side -- acknowledgements and the fetches it serves (``leader``); the follower's side --
copying, cutting by leader epoch (``follower``); the in-sync rules and the confirmed
offset (``in_sync``); the controller's side -- versions, eligibility, the one election,
recovery from the replicas' records (``groups``); and what a leader ships beside its log,
each component naming its own parts (``parts``).  A client reaches a replica through
the data channel (``raymq.actors.channel``); a replica serves the shard
(``raymq.actors.shard``) over its store (``raymq.storage``): forward only.
"""
