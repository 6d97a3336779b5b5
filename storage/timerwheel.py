"""The timer wheel of one shard: which scheduled messages are due in which time bucket,
on disk, so that memory does not grow with the number of scheduled messages.

RocketMQ 5 keeps a TimerLog (every timer message, in arrival order) and a TimerWheel
(slots of due time pointing into the log).  Here the timer log is the timer topic's
consume queue: one fixed-size entry per scheduled message (commit-log offset, size,
due time as its tag), durable and recovered with the commit log.  The wheel indexes it
by due time: one append-only file per ``bucket_ms`` of due time (``b/<day>/<key>``),
holding ``(timer-log index, due ms)`` pairs.  Only the bucket being delivered is ever
read into memory (``load``); a finished bucket's file is deleted (``drop``).

The wheel is derived data.  Its checkpoint (``checkpoint.json``, replaced atomically)
says what is certain after a crash; everything after it is indexed again from the
timer log, so a bucket may hold a pair twice (``load`` keeps one) and a torn tail of a
bucket file is ignored.  Pure Python and numpy: no Ray.
"""
from __future__ import annotations

import json
import os

import numpy as np

from raymq.storage.errors import ConfigError
from raymq.storage.fileutil import atomic_write, fsync_dir

#: One wheel entry: the message's index in the timer log and its due time.
WHEEL_ENTRY = np.dtype([("index", "<i8"), ("due", "<i8")])
#: Buckets per day directory (a day of one-minute buckets).
_PER_DIR = 1440
#: The wheel's own description (its bucket size), beside the checkpoint.
WHEEL_META = "wheel.json"


class TimerWheel:
    """Bucket files of one shard's timer log (see the module doc)."""

    def __init__(self, directory: str, bucket_ms: int):
        if bucket_ms < 1:
            raise ValueError(f"bucket_ms must be >= 1, got {bucket_ms}")
        self.directory = directory
        self.bucket_ms = bucket_ms
        self._buckets_dir = os.path.join(directory, "b")
        os.makedirs(self._buckets_dir, exist_ok=True)
        self._check_bucket_size()
        self._checkpoint_path = os.path.join(directory, "checkpoint.json")
        #: entries per bucket key as written (a pair written twice counts twice)
        self.counts: dict[int, int] = {}
        self._mins: dict[int, int] = {}  # bucket key -> its lowest timer-log index (as read)
        self._dirty: set[int] = set()
        self._new_dirs: set[str] = set()
        self._scan()

    # --------------------------------------------------------------- writing
    def key_of(self, due_ms):
        """The bucket key of a due time (int or array)."""
        return due_ms // self.bucket_ms

    def add(self, keys: np.ndarray, indexes: np.ndarray, dues: np.ndarray) -> None:
        """Append ``(index, due)`` pairs to the buckets ``keys`` (not yet synced)."""
        if not len(keys):
            return
        order = np.argsort(keys, kind="stable")
        keys, indexes, dues = keys[order], indexes[order], dues[order]
        cuts = np.flatnonzero(np.diff(keys)) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(keys)]):
            key = int(keys[lo])
            pairs = np.empty(hi - lo, WHEEL_ENTRY)
            pairs["index"], pairs["due"] = indexes[lo:hi], dues[lo:hi]
            path = self._path(key, create=True)
            with open(path, "ab") as f:
                if f.tell() % WHEEL_ENTRY.itemsize:  # a torn pair from a crash: cut it
                    f.truncate(f.tell() - f.tell() % WHEEL_ENTRY.itemsize)
                    f.seek(0, os.SEEK_END)
                f.write(pairs.tobytes())
            self.counts[key] = self.counts.get(key, 0) + int(hi - lo)
            if key in self._mins:
                self._mins[key] = min(self._mins[key], int(indexes[lo:hi].min()))
            self._dirty.add(key)

    def sync(self) -> None:
        """Make every ``add`` so far durable (fsync the files and new directories)."""
        for key in sorted(self._dirty):
            path = self._path(key)
            if os.path.exists(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        for d in sorted(self._new_dirs):
            fsync_dir(d)
        if self._new_dirs:
            fsync_dir(self._buckets_dir)
        self._dirty.clear()
        self._new_dirs.clear()

    def drop(self, key: int) -> None:
        """Delete a finished bucket (after a checkpoint says it is finished)."""
        path = self._path(key)
        if os.path.exists(path):
            os.unlink(path)
        self.counts.pop(key, None)
        self._mins.pop(key, None)
        self._dirty.discard(key)
        d = os.path.dirname(path)
        if os.path.isdir(d) and not os.listdir(d):
            os.rmdir(d)

    # --------------------------------------------------------------- reading
    def load(self, key: int) -> np.ndarray:
        """A bucket's entries, each once, in due order (then timer-log order)."""
        path = self._path(key)
        if not os.path.exists(path):
            return np.empty(0, WHEEL_ENTRY)
        with open(path, "rb") as f:
            raw = f.read()
        raw = raw[:len(raw) - len(raw) % WHEEL_ENTRY.itemsize]
        pairs = np.unique(np.frombuffer(raw, WHEEL_ENTRY))  # sorts by (index, due)
        return pairs[np.lexsort((pairs["index"], pairs["due"]))]

    def oldest_index(self, *, besides: int | None = None) -> int | None:
        """The lowest timer-log index a bucket other than ``besides`` holds (None: none):
        what retention must keep (each bucket file read once, then kept up by ``add``)."""
        for key in self.counts:
            if key not in self._mins:
                pairs = self.load(key)
                self._mins[key] = int(pairs["index"].min()) if len(pairs) else 1 << 62
        mins = [m for k, m in self._mins.items() if k != besides]
        return min(mins) if mins else None

    def lowest(self, key: int) -> int:
        """The lowest timer-log index bucket ``key`` holds (as far as known: 0 when its
        file was not read yet; ``oldest_index`` reads them all)."""
        return self._mins.get(key, 0)

    def keep_from(self, key: int, low: int) -> None:
        """Rewrite bucket ``key`` without its entries below timer-log index ``low``
        (replaced atomically: a crash leaves the old file or the new one)."""
        pairs = self.load(key)
        pairs = pairs[pairs["index"] >= low]
        if not len(pairs):
            self.drop(key)
            return
        atomic_write(self._path(key), pairs.tobytes())
        self.counts[key] = len(pairs)
        self._mins[key] = int(pairs["index"].min())
        self._dirty.discard(key)

    def keys(self) -> list[int]:
        """Keys of the buckets on disk, in time order."""
        return sorted(self.counts)

    def next_key(self, after: int) -> int | None:
        """The first bucket key above ``after`` on disk (None: none)."""
        later = [k for k in self.counts if k > after]
        return min(later) if later else None

    # ------------------------------------------------------------ checkpoint
    def read_checkpoint(self) -> dict:
        """The last checkpoint written ({} before the first)."""
        try:
            with open(self._checkpoint_path, "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return {}

    def write_checkpoint(self, state: dict) -> None:
        """Sync the buckets, then replace the checkpoint with ``state`` (atomic)."""
        self.sync()
        atomic_write(self._checkpoint_path, json.dumps(state, sort_keys=True).encode(),
                     label="timer.checkpoint")

    # ---------------------------------------------------------------- inside
    def _check_bucket_size(self) -> None:
        """Bucket keys on disk are in units of the bucket size they were written with:
        recorded on first use; a wheel opened with another size is refused (its keys
        would strand every scheduled message)."""
        path = os.path.join(self.directory, WHEEL_META)
        try:
            with open(path, "rb") as f:
                recorded = json.loads(f.read())["bucket_ms"]
        except FileNotFoundError:
            atomic_write(path, json.dumps({"bucket_ms": self.bucket_ms}).encode())
            return
        if recorded != self.bucket_ms:
            raise ConfigError(f"timer_bucket_ms is {self.bucket_ms} but this shard's timer "
                              f"wheel ({self.directory}) was written with {recorded}: set it "
                              f"back to {recorded}")

    def _path(self, key: int, *, create: bool = False) -> str:
        d = os.path.join(self._buckets_dir, str(key // _PER_DIR))
        if create and not os.path.isdir(d):
            os.makedirs(d, exist_ok=True)
            self._new_dirs.add(d)
        return os.path.join(d, str(key))

    def _scan(self) -> None:
        for day in os.listdir(self._buckets_dir):
            d = os.path.join(self._buckets_dir, day)
            for name in os.listdir(d):
                if name.isdigit():
                    size = os.path.getsize(os.path.join(d, name))
                    self.counts[int(name)] = size // WHEEL_ENTRY.itemsize
