"""Where one request's time goes (a debug switch, off by default): the code stamps the
steps a request passes -- the client's call, its encoding and hand-off to the socket, the
shard reading and decoding it, the store's put, the fsync it waits for or does, the
reply, the client reading it and the caller waking -- with ``time.monotonic_ns()``, which
is one clock for every process of a machine, so a client and a shard on it can put their
stamps in one line.

Stamps belong to the thread that serves the request (a shard's connection thread; the
caller's own thread for a synchronous send, ``Producer.send``): ``start`` begins a
request's list, ``mark`` adds a step, ``take`` ends it.  Off, each call is one test of a
module flag.  ``raymq bench`` turns it on for the runs it reports steps of
(``produce.sync_b1_steps``, ``txmsg.p1_steps``); shards turn it on with
``BrokerShard.debug_step_times``.
"""
from __future__ import annotations

import threading
import time

#: Whether stamps are taken in this process.
enabled = False
_local = threading.local()


def enable(on: bool = True) -> None:
    global enabled
    enabled = bool(on)
    if not enabled:
        _local.marks = None


def start(step: str) -> None:
    """Begin this thread's request with its first step."""
    if enabled:
        _local.marks = [(step, time.monotonic_ns())]


def mark(step: str) -> None:
    """This thread's request reached ``step`` (nothing when none was started)."""
    if enabled:
        marks = getattr(_local, "marks", None)
        if marks is not None:
            marks.append((step, time.monotonic_ns()))


def take() -> list[tuple[str, int]] | None:
    """This thread's stamps, ending its request (None: none started)."""
    if not enabled:
        return None
    marks = getattr(_local, "marks", None)
    _local.marks = None
    return marks


def durations(marks: list[tuple[str, int]]) -> dict[str, float]:
    """Each step's time in microseconds: from the stamp before it (in time order) to its
    own, named by the step it reached."""
    marks = sorted(marks, key=lambda m: m[1])
    return {name: (t - before) / 1000.0
            for (_prev, before), (name, t) in zip(marks, marks[1:])}
