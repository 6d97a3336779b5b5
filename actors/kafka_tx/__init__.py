"""Kafka-style transactions: the state machine and metadata (``state``), the
coordinator's transaction log and snapshot (``log``), the coordinator itself -- producer
ids, epochs, two-phase commit, timeouts (``coordinator``), the one-round commit
(``fast_commit``), and a shard's side -- registration, markers, LSO, the aborted index,
offsets in a transaction (``shard_side``).
"""
