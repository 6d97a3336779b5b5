"""RocketMQ-style transactions (half messages): the half index and transaction ends
(``halves``), the pure rules of half states and check planning (``logic``), the op and
copy records' codecs (``records``), one check-back round on a shard (``checkback``),
the checker worker that runs rounds over shards (``checker``) and the producer-group
registry it asks (``registry``).
"""
