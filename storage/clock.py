"""Injected time.  Logic never calls ``time.time()`` itself.
Owns the ``Clock`` protocol, the system clock and the manual clock of tests.
"""
from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int:
        """Wall-clock milliseconds since the epoch."""

    def monotonic_ms(self) -> float:
        """Milliseconds of a clock that never goes back (for timeouts)."""


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic_ms(self) -> float:
        return time.monotonic() * 1000.0


class ManualClock:
    """A clock tests move by hand (Kafka's ``MockTime``)."""

    def __init__(self, start_ms: int = 1_700_000_000_000):
        self._now = int(start_ms)
        self._wall_step = 0  # the wall clock's steps (an operator, NTP); monotonic has none
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        return self._now + self._wall_step

    def step_wall(self, ms: int) -> int:
        """Step the wall clock alone (back when ``ms`` < 0), as an operator or NTP does:
        ``monotonic_ms`` does not move."""
        with self._lock:
            self._wall_step += int(ms)
            return self.now_ms()

    def monotonic_ms(self) -> float:
        return float(self._now)

    def advance(self, ms: int) -> int:
        if ms < 0:
            raise ValueError("a clock does not go back")
        with self._lock:
            self._now += int(ms)
            return self.now_ms()
