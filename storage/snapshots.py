"""Snapshots of state kept as a log: the state folded up to a log offset, in one file.
Owns the snapshot file's format (magic, version, CRC) and its atomic replacement.

A log of state (the coordinator's transaction log, a shard's Kafka-style index topic)
is compacted into a snapshot of its live state plus the tail after it: a restart reads
the snapshot and replays only the tail, so its time and memory follow what is live, not
how much ever happened.  The log itself stays the source of truth: a missing or damaged
snapshot is reported and the log is replayed from its start.  Pure Python: no Ray.
"""
from __future__ import annotations

import json
import logging
import zlib

from raymq.storage.fileutil import atomic_write

log = logging.getLogger("raymq.storage")

FORMAT = "raymq-snapshot"
VERSION = 1


def write_snapshot(path: str, kind: str, offset: int, state) -> None:
    """Replace the snapshot at ``path``: ``state`` (JSON-able) folded from the log up to
    (not including) ``offset``.  Atomic: a crash leaves the old snapshot or the new."""
    body = json.dumps(state, sort_keys=True, separators=(",", ":"))
    doc = {"format": FORMAT, "version": VERSION, "kind": kind, "offset": int(offset),
           "crc": zlib.crc32(body.encode()), "state": body}
    atomic_write(path, json.dumps(doc).encode())


def read_snapshot(path: str, kind: str) -> tuple[int, object] | None:
    """(offset, state) of the snapshot at ``path``; None when there is none, or when it
    is damaged or of another kind (logged: the caller falls back on an older snapshot,
    or replays the whole log)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        if doc["format"] != FORMAT or doc["version"] != VERSION or doc["kind"] != kind:
            raise ValueError(f"format {doc['format']!r} version {doc['version']!r} kind "
                             f"{doc['kind']!r}")
        if zlib.crc32(doc["state"].encode()) != doc["crc"]:
            raise ValueError("bad CRC")
        offset = doc["offset"]
        if type(offset) is not int or offset < 0:
            raise ValueError(f"bad offset {offset!r}")
        return offset, json.loads(doc["state"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        log.error("%s: snapshot unreadable (%s): falling back on an older one or the log",
                  path, err)
        return None
