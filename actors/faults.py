"""Test faults a shard can be told to inject (``BrokerShard.set_fault``), as objects.

The send path asks its ``Faults`` at two fixed points instead of branching on
names; ``NO_FAULTS`` (the default) does nothing at either.
"""
from __future__ import annotations

import os
from typing import Callable

from raymq.storage.errors import InvalidMessageError
from raymq.storage.records import Record
from raymq.storage.store import PutStatus


class Faults:
    """No fault: every hook lets the shard go on as it would."""

    name: str | None = None
    #: whether a send's riding transaction ends go in a put of their own after the
    #: batch's (so that a fault can strike between the two)
    splits_ends = False

    def before_resolution_write(self, real: list[Record],
                                write_real: Callable[[list[Record]], object]) -> None:
        """Called before a put of transaction resolutions (``real``: their real messages)."""

    def send_status(self, status: PutStatus) -> PutStatus:
        """The status a send is answered with."""
        return status


class CrashBetweenRealAndOp(Faults):
    """Exit the process after a commit's real messages, before its op records."""

    name = "crash_between_real_and_op"
    splits_ends = True

    def before_resolution_write(self, real, write_real) -> None:
        if real:
            write_real(real)
            os._exit(17)  # the op write never happens


class FlushDiskTimeout(Faults):
    """Answer sends FLUSH_DISK_TIMEOUT (stored, not known durable), as a disk too slow
    for ``flush_timeout_ms`` does."""

    name = "flush_disk_timeout"
    splits_ends = True

    def send_status(self, status: PutStatus) -> PutStatus:
        return PutStatus.FLUSH_DISK_TIMEOUT


NO_FAULTS = Faults()
_BY_NAME = {f.name: f for f in (CrashBetweenRealAndOp, FlushDiskTimeout)}


def faults_named(name: str | None) -> Faults:
    if name is None:
        return NO_FAULTS
    if name not in _BY_NAME:
        raise InvalidMessageError(f"unknown fault {name!r}: one of {sorted(_BY_NAME)}")
    return _BY_NAME[name]()
