"""RayMetrics: the shards' and clients' counters, gauges and histograms, handed to
``ray.util.metrics`` (Ray's Prometheus endpoint and dashboard show them).

Names are prefixed ``raymq_``.  Recording never raises: a metric that cannot
be recorded is logged at debug level and skipped.  Counters are summed in
the process and reach Ray at most ``FLUSH_S`` late (a Ray counter update
costs ~30 us, and the hot paths count every request).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from raymq.storage.clock import Clock, SystemClock

log = logging.getLogger("raymq.metrics")

#: Longest a counter increment waits in the process before it is handed to Ray.
FLUSH_S = 1.0


class RayMetrics:
    """``ray.util.metrics`` behind the shard's metrics interface (Prometheus / dashboard)."""

    def __init__(self, *, clock: Clock | None = None, **default_tags):
        from ray.util import metrics
        self._m = metrics
        self._tags = default_tags
        self._monotonic_ms = (clock or SystemClock()).monotonic_ms
        self._made: dict[str, object] = {}
        self._lock = threading.Lock()
        self._counts: dict[tuple, float] = {}
        self._next_flush_ms = 0.0  # the first increment goes at once

    def _get(self, kind: str, name: str, tag_keys: tuple[str, ...]):
        metric = self._made.get(name)
        if metric is None:
            full = f"raymq_{name}"
            keys = tuple(sorted(set(tag_keys) | set(self._tags)))
            if kind == "counter":
                metric = self._m.Counter(full, description=name, tag_keys=keys)
            elif kind == "gauge":
                metric = self._m.Gauge(full, description=name, tag_keys=keys)
            else:
                metric = self._m.Histogram(full, description=name, tag_keys=keys,
                                           boundaries=[1, 5, 10, 50, 100, 500, 1000, 5000])
            self._made[name] = metric
        return metric

    def _record(self, kind: str, name: str, value: float, tags: dict) -> None:
        try:
            metric = self._get(kind, name, tuple(tags))
            full = {**self._tags, **{k: str(v) for k, v in tags.items()}}
            if kind == "counter":
                if value > 0:
                    metric.inc(value, tags=full)
            elif kind == "gauge":
                metric.set(value, tags=full)
            else:
                metric.observe(value, tags=full)
        except Exception as err:  # metrics must never break the broker
            log.debug("metric %s not recorded: %s", name, err)

    def inc(self, name, value=1.0, **tags):
        key = (name, tuple(tags.items()))
        with self._lock:
            self._counts[key] = self._counts.get(key, 0.0) + float(value)
            due = self._monotonic_ms() >= self._next_flush_ms
        if due:
            self.flush()

    def flush(self) -> None:
        """Hand the counters summed so far to Ray."""
        with self._lock:
            counts, self._counts = self._counts, {}
            self._next_flush_ms = self._monotonic_ms() + FLUSH_S * 1000
        for (name, tags), value in counts.items():
            self._record("counter", name, value, dict(tags))

    def set(self, name, value, **tags):
        self._record("gauge", name, float(value), tags)

    def observe(self, name, value, **tags):
        self._record("histogram", name, float(value), tags)


#: Seconds between two reports of a shard's gauges.
GAUGES_EVERY_S = 5.0


class GaugeReporter:
    """A thread setting ``gauges()`` -- (name, value, tags) -- into ``metrics`` every
    ``every_s`` seconds (and flushing its counters); a failing round is logged at debug
    level and the next one tries again."""

    def __init__(self, metrics: RayMetrics, gauges: Callable[[], list],
                 every_s: float = GAUGES_EVERY_S):
        self.metrics, self.gauges, self.every_s = metrics, gauges, every_s
        #: the last value of each gauge reported without tags (name -> value)
        self.last: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="raymq-gauges")

    def start(self) -> "GaugeReporter":
        """Report at once, then every ``every_s`` -- from the thread: an actor's start
        does not wait for the first round (a walk of the shard's files among others)."""
        self._thread.start()
        return self

    def report(self) -> None:
        for name, value, tags in self.gauges():
            self.metrics.set(name, value, **tags)
            if not tags:
                self.last[name] = value
        self.metrics.flush()

    def _loop(self) -> None:
        while True:
            try:
                self.report()
            except Exception as err:  # noqa: BLE001 -- metrics never break the broker
                log.debug("gauges not reported: %s", err)
            if self._stop.wait(self.every_s):
                return

    def stop(self) -> None:
        self._stop.set()
