"""What a broker component records metrics into: ``NullMetrics`` records nothing.

The deployed actors are given ``raymq.metrics.RayMetrics`` (Ray's Prometheus endpoint).
"""
from __future__ import annotations


class NullMetrics:
    def inc(self, name: str, value: float = 1.0, **tags) -> None:
        pass

    def set(self, name: str, value: float, **tags) -> None:
        pass

    def observe(self, name: str, value: float, **tags) -> None:
        pass

    def flush(self) -> None:
        pass
