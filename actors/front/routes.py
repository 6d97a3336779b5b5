"""Which (topic, queue) pairs a shard serves: its routes, refreshed from the controller.

A send to a queue the shard does not know refetches once (a new topic), then refuses; a
read or an offset of a queue clients may not read is refused (``check_readable``).
"""
from __future__ import annotations

import threading
from typing import Callable, Iterable

from raymq.actors.front.admission import readable_topic
from raymq.actors.protocol import RETRY_PREFIX, retry_topic
from raymq.storage.errors import OffsetOutOfRangeError, ReservedNameError, UnknownTopicError


class RouteTable:
    def __init__(self, shard: int, fetch: Callable[[int], list] | None):
        self.shard = shard
        self._fetch = fetch
        self._routes: set[tuple[str, int]] = set()
        self._lock = threading.Lock()

    def set(self, routes: Iterable[tuple[str, int]]) -> None:
        with self._lock:
            self._routes = {(t, int(q)) for t, q in routes}

    def refresh(self) -> None:
        if self._fetch is not None:
            self.set(self._fetch(self.shard))

    def sorted(self) -> list[tuple[str, int]]:
        with self._lock:
            return sorted(self._routes)

    def check(self, keys: set[tuple[str, int]]) -> None:
        """Raise ``UnknownTopicError`` unless every queue is served here (after one refresh)."""
        with self._lock:
            missing = keys - self._routes
        if missing and self._fetch is not None:
            self.refresh()
            with self._lock:
                missing = keys - self._routes
        if missing:
            topic, qid = sorted(missing)[0]
            raise UnknownTopicError(f"queue {topic}/{qid} is not served by shard-{self.shard} "
                                    "(unknown topic, or a stale route: refresh and retry)")

    def check_readable(self, queues: set, group: str | None) -> None:
        """Refuse unless every queue is a client's to read (user topics, and the retry
        topic of the consumer's own ``group``; RayMQ's other topics have operator calls)
        and served here."""
        for topic, qid in queues:
            if not readable_topic(topic):
                raise ReservedNameError(f"topic {topic!r} is RayMQ's own: clients do not "
                                        "read it (operators: raymq half|dlq)")
            if topic.startswith(RETRY_PREFIX) and topic != retry_topic(group or ""):
                raise ReservedNameError(f"topic {topic!r} is the retry topic of group "
                                        f"{topic[len(RETRY_PREFIX):]!r}: only that group's "
                                        f"consumers read it or commit its offsets")
            if isinstance(qid, bool) or not isinstance(qid, int) or qid < 0:
                raise OffsetOutOfRangeError(f"invalid queue id {qid!r} for {topic}")
        self.check(queues)
