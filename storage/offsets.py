"""Durable offsets: consumer groups, checker and scheduler progress.
Owns the offsets file (``OffsetStore``): its format, CRC and atomic rewrite.

The whole table is rewritten atomically (temp file, fsync, rename, directory
fsync), so a crash leaves the previous or the new table, never half of one.
Each file carries a CRC of its content, so a damaged file is reported rather
than read as zeros.
"""
from __future__ import annotations

import json
import os
import threading
import zlib

from raymq.storage.errors import CorruptLogError
from raymq.storage.fileutil import atomic_write

FORMAT = "raymq-offsets"
VERSION = 1


class OffsetStore:
    """A durable ``str -> int`` table.  All methods are thread-safe."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._remove_stale_temp_files()
        self._table: dict[str, int] = self._load()
        self._dirty = False  # changes made with ``durable=False`` not written yet
        #: counts the table's changes since it was opened (a leader ships the table to its
        #: followers when this moved, ``raymq.actors.replication.replica``)
        self.version = 0

    def _remove_stale_temp_files(self) -> None:
        """Temp files of writes that a crash interrupted (never read: the rename did not happen)."""
        directory, base = os.path.split(os.path.abspath(self.path))
        for name in os.listdir(directory):
            if name.startswith(base + ".tmp."):
                try:
                    os.unlink(os.path.join(directory, name))
                except FileNotFoundError:
                    pass

    def _load(self) -> dict[str, int]:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return {}
        try:
            doc = json.loads(raw)
            body = json.dumps(doc["offsets"], sort_keys=True, separators=(",", ":"))
            ok = (doc.get("format") == FORMAT and doc.get("version") == VERSION
                  and zlib.crc32(body.encode()) == doc.get("crc"))
        except (ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            raise CorruptLogError(f"{self.path}: offset file is damaged (bad JSON, format "
                                  "or CRC); restore it or delete it to start from scratch")
        return {str(k): int(v) for k, v in doc["offsets"].items()}

    def get(self, key: str, default: int = -1) -> int:
        with self._lock:
            return self._table.get(key, default)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._table)

    def update(self, values: dict[str, int], *, durable: bool = True) -> None:
        """Set several offsets and persist them durably before returning; with
        ``durable=False`` they are written by the next durable change or ``flush`` (for
        values the caller can rebuild after a crash: a Kafka-style commit's offsets,
        re-applied from its durable end record)."""
        with self._lock:
            table = dict(self._table)
            table.update({str(k): int(v) for k, v in values.items()})
            if durable:
                self._write(table)
            else:
                self._dirty = True
                self.version += 1
            self._table = table

    def flush(self) -> None:
        """Write the changes made with ``durable=False`` (nothing when there are none)."""
        with self._lock:
            if self._dirty:
                self._write(self._table)

    def replace(self, table: dict[str, int]) -> None:
        """Make the table ``table`` (a follower takes its leader's), durably."""
        with self._lock:
            table = {str(k): int(v) for k, v in table.items()}
            if table != self._table:
                self._write(table)
                self._table = table

    def versioned(self) -> tuple[int, dict[str, int]]:
        """``(version, a copy of the table)``, taken together."""
        with self._lock:
            return self.version, dict(self._table)

    def delete(self, keys) -> None:
        with self._lock:
            self._drop(set(keys))

    def delete_below(self, prefix: str, bound: int) -> int:
        """Delete the keys starting with ``prefix`` whose value is below ``bound`` (as they
        are now: one set meanwhile to a higher value stays); how many."""
        with self._lock:
            gone = {k for k, v in self._table.items() if k.startswith(prefix) and v < bound}
            if gone:
                self._drop(gone)
            return len(gone)

    def _drop(self, gone: set[str]) -> None:
        """Rewrite the table without ``gone`` (under the lock)."""
        table = {k: v for k, v in self._table.items() if k not in gone}
        self._write(table)
        self._table = table

    def _write(self, table: dict[str, int]) -> None:
        body = json.dumps(table, sort_keys=True, separators=(",", ":"))
        doc = {"format": FORMAT, "version": VERSION, "crc": zlib.crc32(body.encode()),
               "offsets": table}
        atomic_write(self.path, json.dumps(doc, sort_keys=True).encode())
        self._dirty = False
        self.version += 1

