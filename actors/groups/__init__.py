"""Consumer groups: membership and queue leases (``membership``), committed offsets and
lag, kept as records of the shard's log (``offsets``), retries and dead letters
(``dead_letters``).
"""
