"""The client's clock: the storage ``Clock`` (``now_ms``, ``monotonic_ms``) plus what a
waiting client needs, monotonic seconds and a sleep, so tests can drive the SDK's time.

``connect(clock=...)`` hands one to every producer, consumer and transaction
producer it makes (default: ``SystemClientClock``).  Hot paths bind its methods
once (``self._monotonic_s = clock.monotonic_s``): the system clock's are
``time``'s own functions, no Python call in between.
"""
from __future__ import annotations

import time
from typing import Protocol

from raymq.storage.clock import Clock, ManualClock, SystemClock


class ClientClock(Clock, Protocol):
    def monotonic_s(self) -> float:
        """Seconds of a clock that never goes back (for deadlines and leases)."""

    def sleep_s(self, duration_s: float) -> None:
        """Wait ``duration_s`` seconds (back-offs); a manual clock advances instead."""


class SystemClientClock(SystemClock):
    """The machine's clocks."""

    monotonic_s = staticmethod(time.monotonic)
    sleep_s = staticmethod(time.sleep)


class ManualClientClock(ManualClock):
    """A client clock tests move by hand; ``sleep_s`` advances it (Kafka's ``MockTime``)."""

    def monotonic_s(self) -> float:
        return self.monotonic_ms() / 1000.0

    def sleep_s(self, duration_s: float) -> None:
        self.advance(round(max(0.0, duration_s) * 1000))


class _FromClock:
    """A storage ``Clock`` given where a client clock is wanted: seconds from its
    milliseconds; a sleep advances it if it can be advanced, else waits for real."""

    def __init__(self, clock: Clock):
        self._clock = clock
        self.now_ms = clock.now_ms
        self.monotonic_ms = clock.monotonic_ms

    def monotonic_s(self) -> float:
        return self._clock.monotonic_ms() / 1000.0

    def sleep_s(self, duration_s: float) -> None:
        advance = getattr(self._clock, "advance", None)
        if advance is None:
            time.sleep(duration_s)
        else:
            advance(round(max(0.0, duration_s) * 1000))


def client_clock(clock: Clock | None = None) -> ClientClock:
    """``clock`` as a client clock: the system's for None, itself if it is one."""
    if clock is None:
        return SystemClientClock()
    if hasattr(clock, "monotonic_s") and hasattr(clock, "sleep_s"):
        return clock
    return _FromClock(clock)
