"""Small file helpers: atomic replace, directory fsync.
Owns the crash-safe way to replace a whole file.
"""
from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` so a crash leaves the old or the new file, whole.

    Write a temporary file beside it, fsync it, rename it over the target and
    fsync the directory (the rename is atomic on POSIX file systems).
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(directory)
