"""Which (topic, queue) pairs a shard serves: its routes, refreshed from the controller.

A send to a queue the shard does not know refetches once (a new topic), then refuses.
"""
from __future__ import annotations

import threading
from typing import Callable, Iterable

from raymq.storage.errors import UnknownTopicError


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
