"""Crash points: named places in the storage code where a test can kill the process.
Owns the list of points, the environment variable that arms one, and the kill itself.

Every fsync, rename and delete that matters for crash safety calls
``crash_point(name)`` just after (or, for ``*.before_*``, just before) it.  A
test runs the production code in a child process with ``RAYMQ_STORAGE_CRASH_AT``
set to ``NAME`` (or ``NAME:N``, the N-th time the point is reached); there the
process writes ``CRASH_MARKER NAME N`` to stderr and exits at once with
``CRASH_EXIT_CODE`` (``os._exit``: no ``finally``, no flush, no close -- like a
kill; what the process wrote is in the page cache, what it did not is not).
Unarmed (always in production) ``crash_point`` compares one global to None.
"""
from __future__ import annotations

import os

CRASH_ENV = "RAYMQ_STORAGE_CRASH_AT"
CRASH_EXIT_CODE = 86
CRASH_MARKER = "RAYMQ-STORAGE-CRASH-POINT"

#: Every point, with where it is.  ``tests/storage/test_storage_crashpoints.py`` kills a child at
#: each of them and checks that a source file names no point missing here.
CRASH_POINTS = {
    "put.partly_appended": "a put of several frames has some of them in the commit log",
    "put.appended": "a put's frames are in the commit log, not indexed yet",
    "put.indexed": "a put is written and indexed, the fsync that acknowledges it not begun",
    "log.fsync.after": "the commit log was fsynced (group commit), waiters not woken yet",
    "queue.created": "a new consume-queue file exists, its directory not fsynced yet",
    "segment.sealed": "a full segment was fsynced, the next one not created yet",
    "segment.created": "the next segment file exists, empty (no header yet)",
    "segment.header_synced": "the next segment's header is fsynced, its directory not yet",
    "checkpoint.queues_synced": "consume queues fsynced, the checkpoint file not written yet",
    "checkpoint.before_rename": "the new checkpoint is in its fsynced temp file, not renamed",
    "checkpoint.renamed": "the new checkpoint is renamed in place, its directory not fsynced",
    "cut.queues": "a replica's cut dropped its queues' entries past the cut, its "
                  "checkpoint not moved yet",
    "retention.deleted_one": "retention deleted one segment file of those it chose, the "
                             "log's directory not fsynced yet",
    "rebuild.marked": "a consume-queue rebuild is marked in the checkpoint, nothing deleted",
    "rebuild.deleting": "a rebuild deleted one consume-queue file of several",
    "rebuild.deleted": "a rebuild deleted every consume-queue file, none written again",
    "rebuild.reindexed": "a rebuild re-indexed the log, the checkpoint not rewritten yet",
    "recovery.put_cut": "recovery cut a put whose last frame is missing, not checkpointed",
    "coordinator.add_logged": "a coordinator logged a transaction's new queue (ONGOING), "
                              "not registered on its shard, not answered",
    "ktx.markers_durable": "a Kafka-style end's markers and end record are durable, the "
                           "group offsets committed with it not saved yet",
    "coordinator.one_phase_decided": "a one-shard Kafka-style transaction's shard committed "
                                     "(or aborted) it, the coordinator logged nothing of it",
    "ktx.batch_committed": "a Kafka-style transaction of one request is durable with its "
                           "markers, the shard's state not told yet, not answered",
    "coordinator.batch_committed": "a transaction of one request committed on its shard, "
                                   "the coordinator logged nothing of it",
    "timer.checkpoint.before_rename": "a timer wheel checkpoint (a finished minute) is in its "
                                      "fsynced temp file, not renamed",
    "timer.checkpoint.renamed": "a timer wheel checkpoint is renamed in place, the finished "
                                "minute's bucket file not deleted yet",
}


def _parse(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    name, _, nth = value.partition(":")
    if name not in CRASH_POINTS:
        raise ValueError(f"{CRASH_ENV}={value!r}: unknown crash point; "
                         f"known: {', '.join(sorted(CRASH_POINTS))}")
    return name, int(nth or 1)


_armed = _parse(os.environ.get(CRASH_ENV))
_hits = 0


def arm(value: str | None) -> None:
    """Arm ``value`` (``NAME`` or ``NAME:N``, as in ``RAYMQ_STORAGE_CRASH_AT``) in this
    running process, counting hits from now; None disarms.  A test hook: a shard's
    ``set_fault("crash_at:NAME")`` kills it inside the production code path."""
    global _armed, _hits
    _armed, _hits = _parse(value), 0


def crash_point(name: str) -> None:
    """Return at once unless this process was started with ``name`` armed; else, at
    its N-th hit, say so on stderr and exit with ``CRASH_EXIT_CODE`` (no cleanup)."""
    if _armed is not None and _armed[0] == name:
        _hit(name)


def _hit(name: str) -> None:
    global _hits
    _hits += 1
    if _hits == _armed[1]:
        os.write(2, f"{CRASH_MARKER} {name} {_hits}\n".encode())
        os._exit(CRASH_EXIT_CODE)
