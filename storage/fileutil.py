"""Small file helpers: atomic replace, directory fsync.
Owns the crash-safe way to replace a whole file.
"""
from __future__ import annotations

import os
import threading

from raymq.storage.faults import crash_point


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, *, label: str | None = None) -> None:
    """Replace ``path`` with ``data`` so a crash leaves the old or the new file, whole.

    Write a temporary file beside it, fsync it, rename it over the target and
    fsync the directory (the rename is atomic on POSIX file systems).  ``label``
    names the crash points ``<label>.before_rename`` and ``<label>.renamed``.
    """
    directory = os.path.dirname(os.path.abspath(path))
    # (one temporary file per writer: two threads replacing one file never share one)
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    if label:
        crash_point(f"{label}.before_rename")
    os.replace(tmp, path)
    if label:
        crash_point(f"{label}.renamed")
    fsync_dir(directory)


def disk_usage(path: str) -> int:
    """Bytes the files under ``path`` take on disk (allocated blocks, as ``du``; a file
    gone while walking counts 0)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            total += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
    return total


def read_tree(root: str, prefix: str) -> dict[str, bytes]:
    """Every file under ``root`` as ``{prefix/relative path: bytes}``."""
    out = {}
    for d, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(d, name)
            with open(path, "rb") as f:
                out[os.path.join(prefix, os.path.relpath(path, root))] = f.read()
    return out
