"""The open files of one store's consume queues: at most ``limit`` at once, least recently
used closed first.  Owns opening, closing and reopening queue files, and their lock.

A store may hold many more queues than a process may open files: every queue
file operation takes ``lock`` and asks ``fd(queue)`` for its descriptor, which
reopens the file if it was closed and then closes the least recently used one
when more than ``limit`` are open.  Holding the lock for the whole operation
means a descriptor is never closed (and its number reused) under a read or a
write.  The limit is also kept to half the process's descriptor limit
(``ulimit -n``), so that commit-log segments, directory listings and sockets
find descriptors too; when the process runs out of them anyway (EMFILE), open
queue files are given back one by one until the open succeeds.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from collections import OrderedDict

from raymq.storage.errors import StorageError

try:
    import resource
except ImportError:  # not POSIX
    resource = None

log = logging.getLogger("raymq.storage")


def usable_limit(limit: int) -> int:
    """``limit``, kept to half the process's soft descriptor limit (at least 1)."""
    if resource is None:
        return limit
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or limit <= soft // 2:
        return limit
    usable = max(1, soft // 2)
    log.info("max_open_queue_files=%d is more than half the process's descriptor limit "
                "(%d); keeping at most %d consume-queue files open", limit, soft, usable)
    return usable


class QueueFiles:
    """Descriptors of consume-queue files, by queue, in least-recently-used order.

    A queue's open descriptor is also kept on the queue (``queue.open_fd``, None when
    closed; set only here), so that the common case costs one attribute read; the
    use order is kept only once a file had to be closed for room.
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.configured_limit = limit
        self.limit = usable_limit(limit)
        self.lock = threading.Lock()  # held by every operation on a descriptor of ours
        self._open: OrderedDict[object, int] = OrderedDict()
        self._evicting = False  # a file was closed for room: keep the use order from now on
        self.closed = False

    def fd(self, queue) -> int:
        """The descriptor of ``queue``'s file (``queue.path``), opened if need be, closing
        the least recently used other ones beyond ``limit``.  Call it holding ``lock``."""
        fd = queue.open_fd
        if fd is not None:
            if self._evicting:
                self._open.move_to_end(queue)
            return fd
        if self.closed:
            raise StorageError(f"consume queue {queue.path}: the store is closed")
        while len(self._open) >= self.limit:
            self._close_least_recent()
        fd = self._open_file(queue.path)
        self._open[queue] = queue.open_fd = fd
        return fd

    def _open_file(self, path: str) -> int:
        while True:
            try:
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError as err:
                if err.errno not in (errno.EMFILE, errno.ENFILE) or not self._open:
                    raise
                log.warning("out of file descriptors opening %s (%d consume-queue files "
                            "open); closing one -- lower max_open_queue_files or raise "
                            "the process limit (ulimit -n)", path, len(self._open))
                self._close_least_recent()

    def _close_least_recent(self) -> None:
        queue, fd = self._open.popitem(last=False)
        queue.open_fd = None
        self._evicting = True
        os.close(fd)

    def release(self, queue) -> None:
        """Close ``queue``'s file if it is open.  Call it holding ``lock``."""
        fd = self._open.pop(queue, None)
        queue.open_fd = None
        if fd is not None:
            os.close(fd)

    def close_all(self) -> None:
        """Close every file; any later use raises."""
        with self.lock:
            self.closed = True
            for queue, fd in self._open.items():
                queue.open_fd = None
                os.close(fd)
            self._open.clear()

    @property
    def open_count(self) -> int:
        return len(self._open)
