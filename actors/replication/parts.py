"""What a leader keeps beside its log, copied to its followers (issue 26).

A shard's leader folds its Kafka-style index into a snapshot and checkpoints its timer
wheel; a coordinator's leader folds its transaction log into a snapshot.  A new leader
reads those and replays only the log after them; without them it would replay the
whole history.  So the leader ships each *part* with a fetch whenever it changed (the
timer wheel at most once a minute, ``replica_timer_ship_ms``: it changes with every
bucket), and only with every record it covers -- read before the frames and shipped only
when the reply reaches the leader's end as of then -- so a part never runs ahead of the
follower's log.  The follower makes its log durable first, then installs the part
atomically.

After its log is cut (``_Follower._truncate``) a follower deletes its parts: they may
cover records it no longer holds; the next leader rebuilds them, or the leader ships
them again.  Pure Python: no Ray.
"""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Callable

from raymq.actors.kafka_tx import log as txn_log, shard_side as ktx
from raymq.actors.timing import timers
from raymq.storage.fileutil import atomic_write, fsync_dir

log = logging.getLogger("raymq.replica")

#: Where each part lives in a replica's directory (deleted there when its log is cut):
#: named by the components that write them.
KTX_SNAPSHOT, TXN_SNAPSHOT, TIMER_DIR = ktx.SNAPSHOT_FILE, txn_log.SNAPSHOT_FILE, timers.WHEEL_DIR
PART_PATHS = (KTX_SNAPSHOT, TXN_SNAPSHOT, TIMER_DIR)
#: Kept beside the parts, never shipped, deleted with them: the coordinator's previous
#: snapshot (``raymq.actors.kafka_tx.log``).
LOCAL_PATHS = (TXN_SNAPSHOT + txn_log.PREV_SUFFIX,)


@dataclass(frozen=True)
class Part:
    """One part: ``version()`` changes whenever ``read()`` (``{path relative to the
    replica's directory: bytes}``) would; ``directory`` names the directory the part
    replaces whole (None: single files); shipped at most every ``every_ms``."""

    name: str
    version: Callable[[], object]
    read: Callable[[], dict[str, bytes]]
    directory: str | None = None
    every_ms: int = 0


def file_part(name: str, directory: str, filename: str) -> Part:
    """A part that is one file (a snapshot replaced atomically by its writer)."""
    path = os.path.join(directory, filename)

    def version():
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return [st.st_mtime_ns, st.st_size, st.st_ino]

    def read():
        try:
            with open(path, "rb") as f:
                return {filename: f.read()}
        except FileNotFoundError:
            return {}
    return Part(name, version, read)


def parts_of(served) -> list[Part]:
    """What the leader serving ``served`` ships: a shard's Kafka-style index snapshot and
    timer wheel, a coordinator's transaction-log snapshot."""
    wheel = getattr(served, "timers", None)
    if wheel is not None:  # (a BrokerShard)
        return [file_part("ktx-index", served.directory, KTX_SNAPSHOT),
                Part(**wheel.replica_part(served.config.replica_timer_ship_ms))]
    return [file_part("txn-log", served.directory, TXN_SNAPSHOT)]


class Shipper:
    """A leader's side: which parts each follower holds, and when each was last sent."""

    def __init__(self, parts: list[Part], clock):
        self.parts, self.clock = parts, clock
        self._sent_ms: dict[tuple[str, str], int] = {}

    def due(self, follower: str, held: dict) -> dict:
        """The parts ``follower`` (holding versions ``held``) should get now, read now:
        ``{name: {"version", "directory", "files"}}``."""
        out, now = {}, self.clock.monotonic_ms()
        for part in self.parts:
            version = part.version()
            if version is None or version == held.get(part.name):
                continue
            if now - self._sent_ms.get((follower, part.name), -1 << 62) < part.every_ms:
                continue
            out[part.name] = {"version": version, "directory": part.directory,
                              "files": part.read()}
        return out

    def sent(self, follower: str, names) -> None:
        now = self.clock.monotonic_ms()
        for name in names:
            self._sent_ms[(follower, name)] = now


def install(directory: str, shipped: dict) -> None:
    """A follower installs the parts ``shipped`` (its log already durable up to them)."""
    for name, part in shipped.items():
        if part["directory"] is None:
            for rel, data in part["files"].items():
                atomic_write(os.path.join(directory, rel), data)
        else:
            _replace_tree(directory, part["directory"], part["files"])
        log.debug("%s: installed %s (%d files)", directory, name, len(part["files"]))


def _replace_tree(directory: str, sub: str, files: dict[str, bytes]) -> None:
    """Replace ``directory/sub`` with ``files`` (paths starting ``sub/``): written beside
    it, then swapped in; a crash between leaves the old, or none (rebuilt from the log)."""
    final = os.path.join(directory, sub)
    fresh, old = final + ".new", final + ".old"
    for leftover in (fresh, old):
        shutil.rmtree(leftover, ignore_errors=True)
    dirs = set()
    for rel, data in files.items():
        path = os.path.join(fresh, os.path.relpath(rel, sub))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        dirs.add(os.path.dirname(path))
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    os.makedirs(fresh, exist_ok=True)
    for d in sorted(dirs, key=len, reverse=True):
        fsync_dir(d)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(fresh, final)
    fsync_dir(directory)
    shutil.rmtree(old, ignore_errors=True)


def forget(directory: str) -> None:
    """Delete every part (after the log was cut: they may cover records now gone)."""
    for rel in PART_PATHS + LOCAL_PATHS:
        path = os.path.join(directory, rel)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)
    for leftover in ("timer.new", "timer.old"):
        shutil.rmtree(os.path.join(directory, leftover), ignore_errors=True)
