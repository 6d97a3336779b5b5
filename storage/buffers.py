"""Large buffers about to be filled by a reader (a frame of a pull's records arriving on
the data channel, a dataset block): fresh memory in huge pages where the kernel has them
(Linux transparent huge pages, ``madvise`` mode).  Filling 90 MB of fresh memory took
57-60 ms in 4 KiB pages and 13-16 ms in 2 MiB ones on this kind of machine (page faults,
not copying, were the cost); smaller buffers gain nothing and stay plain.  (Not on the
shard's side: its reads and compacted pulls in huge pages cost the shard process more
CPU per pull, not less, measured in a cluster.)
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_madvise = getattr(ctypes.CDLL(None), "madvise", None)


def fresh_buffer(size: int):
    """``size`` writable bytes to fill (a ``bytearray``, or from ``HUGE_PAGE_BYTES`` a
    view of an anonymous private ``mmap`` in huge pages, not zeroed first).  The mapping
    is a whole number of huge pages: the kernel then places it on a huge-page boundary,
    and none of it is left in 4 KiB pages (13 reads of 7 MB: 52 page faults and 6.5 ms,
    against 2,600-4,300 and 11-13 ms mapped at their own size)."""
    if size < HUGE_PAGE_BYTES or _MADV_HUGEPAGE is None:
        return bytearray(size)
    whole = -(-size // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    buf = mmap.mmap(-1, whole, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (not shmem)
    with contextlib.suppress(OSError):
        buf.madvise(_MADV_HUGEPAGE)
    return memoryview(buf)[:size] if whole > size else buf


def fresh_bytes(size: int) -> tuple[bytes, memoryview]:
    """A new ``bytes`` object of ``size`` and a writable view of its memory (valid while
    the object lives), to fill before the object is shared (CPython's
    ``PyBytes_FromStringAndSize(NULL, n)``), in huge pages: for a result that must be
    ``bytes`` (a dataset block) without a second copy into one."""
    out = _new_bytes(None, size)
    address = _bytes_data(out)
    _advise_huge_pages(address, size)
    return out, memoryview((ctypes.c_char * size).from_address(address)).cast("B")


_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_data = ctypes.pythonapi.PyBytes_AsString
_bytes_data.restype, _bytes_data.argtypes = ctypes.c_void_p, (ctypes.py_object,)


def _advise_huge_pages(address: int, size: int) -> None:
    """Ask for huge pages under ``size`` bytes at ``address`` (memory just allocated and
    not yet written); the whole huge pages inside only."""
    lo = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    hi = (address + size) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if hi > lo and _madvise is not None and _MADV_HUGEPAGE is not None:
        _madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE)
