"""A replica's leader-epoch file: which leader epoch wrote which part of its commit log.
Owns the ``(epoch, start offset)`` entries, the divergence rule a returning replica
truncates by, and the file's format (one CRC'd line an entry, replaced atomically).

Kafka's ``LeaderEpochFileCache`` (KIP-101/279) and RocketMQ 5's ``EpochFileCache``
keep the same thing: every leader, when elected with epoch E, records (E, its log end);
followers copy the entries with the log.  A replica coming back asks the leader where
its own latest epoch ended on the leader (``end_offset_for``) and cuts its log there
(``truncation_offset``), so it never keeps records a deposed leader wrote that the
new leader does not have.  Offsets are the commit log's physical byte offsets.  Pure
Python, no Ray.
"""
from __future__ import annotations

import bisect
import os
import zlib

from raymq.storage.errors import CorruptLogError, StorageError
from raymq.storage.fileutil import atomic_write

#: "No such epoch" / "no such offset" (Kafka's UNDEFINED_EPOCH / UNDEFINED_EPOCH_OFFSET).
UNDEFINED = -1
_MAGIC = "raymq-epochs 1"


class EpochCache:
    """The ``(epoch, start offset)`` entries of one replica, both strictly increasing.

    ``path`` (optional) is the file they are kept in: every change rewrites it
    atomically before it returns, and ``EpochCache(path)`` reads it back.
    """

    def __init__(self, path: str | None = None):
        self.path = path
        self._epochs: list[int] = []
        self._starts: list[int] = []
        if path is not None and os.path.exists(path):
            self._load()

    def entries(self) -> list[tuple[int, int]]:
        return list(zip(self._epochs, self._starts))

    def latest_epoch(self) -> int:
        return self._epochs[-1] if self._epochs else UNDEFINED

    # ------------------------------------------------------------- changes
    def assign(self, epoch: int, start_offset: int) -> bool:
        """A leader of ``epoch`` starts writing at ``start_offset`` (a leader on its
        election, a follower as it copies the leader's entries).  Idempotent for the
        latest entry; an epoch below the latest, or an offset below the latest start, is
        a broken invariant (``StorageError``).  Whether it changed anything."""
        if epoch < 0 or start_offset < 0:
            raise StorageError(f"epoch {epoch} at offset {start_offset}: both must be >= 0")
        if self._epochs:
            last_epoch, last_start = self._epochs[-1], self._starts[-1]
            if epoch == last_epoch:
                if start_offset < last_start:  # (Kafka keeps the earlier start too)
                    raise StorageError(f"epoch {epoch} already starts at {last_start}, "
                                       f"not at the earlier {start_offset}")
                return False
            if epoch < last_epoch or start_offset < last_start:
                raise StorageError(f"epoch {epoch} at offset {start_offset} goes back from "
                                   f"epoch {last_epoch} at {last_start}")
        self._epochs.append(epoch)
        self._starts.append(start_offset)
        self._save()
        return True

    def truncate_from_end(self, end_offset: int) -> None:
        """The log was cut at ``end_offset``: entries starting there or later go."""
        k = bisect.bisect_left(self._starts, end_offset)
        if k < len(self._starts):
            del self._epochs[k:], self._starts[k:]
            self._save()

    # -------------------------------------------------------------- queries
    def end_offset_for(self, epoch: int, log_end: int) -> tuple[int, int]:
        """Kafka's ``endOffsetFor`` (asked of the leader): ``(the largest epoch <= epoch
        it knows, the offset where that epoch's records end)``.  The latest epoch ends at
        ``log_end``; an epoch below the first known one ends where the first starts; an
        epoch above every known one, or none known: ``(UNDEFINED, UNDEFINED)``."""
        if epoch == UNDEFINED or not self._epochs:
            return UNDEFINED, UNDEFINED
        if epoch == self._epochs[-1]:
            return epoch, log_end
        higher = bisect.bisect_right(self._epochs, epoch)  # the first entry above it
        if higher == len(self._epochs):
            return UNDEFINED, UNDEFINED
        floor = higher - 1
        return (self._epochs[floor] if floor >= 0 else epoch), self._starts[higher]

    def truncation_offset(self, leader_epoch: int, leader_end: int, log_end: int) -> int:
        """Where this (returning) replica cuts its log, given the leader's answer
        ``(leader_epoch, leader_end)`` to ``end_offset_for(self.latest_epoch())``:

        - the leader knows no such epoch (``UNDEFINED``): nothing of this log is known
          to match -- cut to 0 (a caller that knows a confirmed offset may keep that);
        - the leader's epoch is this replica's: cut to ``min(leader_end, log_end)``;
        - the leader answered an older epoch (this replica's latest is unknown to it):
          where that older epoch ends here and there, whichever is first (KIP-279).
        """
        if leader_epoch == UNDEFINED or leader_end == UNDEFINED:
            return 0
        if leader_epoch == self.latest_epoch():
            return min(leader_end, log_end)
        mine_epoch, mine_end = self.end_offset_for(leader_epoch, log_end)
        if mine_epoch == UNDEFINED:
            return 0
        return min(leader_end, mine_end, log_end)

    def diverging(self, log_end: int, last_epoch: int | None,
                  from_phys: int) -> tuple[int, int] | None:
        """(asked of the leader, whose log ends at ``log_end``) Whether a follower whose
        log ends at ``from_phys`` with latest epoch ``last_epoch`` holds what this log does
        not: ``(epoch, end)`` to cut by (``truncation_offset``), or None when its log is a
        prefix of this one (Kafka's diverging-epoch check, KIP-320/595).  An empty log
        (``from_phys`` 0) never diverges; ``last_epoch`` None checks the end only."""
        if from_phys <= 0:
            return None
        if last_epoch is None:
            return None if from_phys <= log_end else (self.latest_epoch(), log_end)
        epoch, end = self.end_offset_for(last_epoch, log_end)
        if epoch == last_epoch and from_phys <= end:
            return None
        return epoch, end

    # ------------------------------------------------------------------ file
    def _save(self) -> None:
        if self.path is None:
            return
        lines = [_MAGIC]
        for e, s in zip(self._epochs, self._starts):
            body = f"{e} {s}"
            lines.append(f"{body} {zlib.crc32(body.encode()):08x}")
        atomic_write(self.path, ("\n".join(lines) + "\n").encode())

    def _load(self) -> None:
        with open(self.path, "rb") as f:
            lines = f.read().decode("ascii", "replace").splitlines()
        if not lines or lines[0] != _MAGIC:
            raise CorruptLogError(f"{self.path}: not a RayMQ epoch file")
        for n, line in enumerate(lines[1:], 2):
            parts = line.split()
            body = " ".join(parts[:2])
            if len(parts) != 3 or f"{zlib.crc32(body.encode()):08x}" != parts[2]:
                raise CorruptLogError(f"{self.path}: line {n} is damaged ({line[:60]!r})")
            epoch, start = int(parts[0]), int(parts[1])
            if self._epochs and (epoch <= self._epochs[-1] or start < self._starts[-1]):
                raise CorruptLogError(f"{self.path}: line {n}: epoch {epoch} at {start} "
                                      f"does not follow epoch {self._epochs[-1]} at "
                                      f"{self._starts[-1]}")
            self._epochs.append(epoch)
            self._starts.append(start)
