"""Test faults a shard can be told to inject (``BrokerShard.set_fault``), as objects.

A fault never changes the path under test.  ``crash_at:POINT[:N]`` arms one of the
storage engine's crash points (``raymq.storage.faults``) in the shard's process: it
dies inside the production code there (e.g. in the one put of a commit, between its
frames).  The reply of a send asks its ``Faults`` for the status it answers with;
``NO_FAULTS`` (the default) leaves it as it is.
"""
from __future__ import annotations

from raymq.storage import faults as storage_faults
from raymq.storage.errors import InvalidMessageError, RayMQError
from raymq.storage.store import PutStatus


class Faults:
    """No fault: every hook lets the shard go on as it would."""

    name: str | None = None

    def send_status(self, status: PutStatus) -> PutStatus:
        """The status a send is answered with."""
        return status

    def ktx_stored(self) -> None:
        """Called once a transactional write is stored, before it is answered."""


class FlushDiskTimeout(Faults):
    """Answer sends FLUSH_DISK_TIMEOUT (stored, not known durable), as a disk too slow
    for ``flush_timeout_ms`` does."""

    name = "flush_disk_timeout"

    def send_status(self, status: PutStatus) -> PutStatus:
        return PutStatus.FLUSH_DISK_TIMEOUT


class KtxReplyLost(Faults):
    """Store a transactional write, then answer it with an error (not retriable): its
    producer cannot know it was stored, as when the answer is lost for good."""

    name = "ktx_reply_lost"

    def ktx_stored(self) -> None:
        raise RayMQError("the answer to this transactional write was lost (test fault "
                         "ktx_reply_lost)")


NO_FAULTS = Faults()
_BY_NAME = {f.name: f for f in (FlushDiskTimeout, KtxReplyLost)}
CRASH_AT = "crash_at:"


def faults_named(name: str | None) -> Faults:
    """The faults of ``set_fault(name)``; a ``crash_at:`` name arms the crash point
    (``InvalidMessageError`` for an unknown one) and leaves replies as they are."""
    storage_faults.arm(None)
    if name is None:
        return NO_FAULTS
    if name.startswith(CRASH_AT):
        try:
            storage_faults.arm(name[len(CRASH_AT):])
        except ValueError as err:
            raise InvalidMessageError(str(err)) from None
        return NO_FAULTS
    if name not in _BY_NAME:
        raise InvalidMessageError(f"unknown fault {name!r}: one of {sorted(_BY_NAME)} or "
                                  f"{CRASH_AT}POINT[:N] ({', '.join(storage_faults.CRASH_POINTS)})")
    return _BY_NAME[name]()
