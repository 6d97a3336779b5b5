"""The shard's front: a request's checks and one-line errors (``requests``), admission
of topics and queues (``admission``), the records diverted to the system topics
(``diversion``), reads -- long-poll pulls, look-ups, the confirmed offset (``reads``) --
and the queues a shard serves (``routes``).
"""
