"""The segment being written is allocated ahead of its end, blocks reading as zeros (issue
37: an fsync of blocks the file already has skips the journal).  The zeros are never
data: a sealed segment and a closed log hold none, a crash leaves them as the end of the
data (not a torn tail), a disk too full for them still takes what fits, and a filesystem
that cannot allocate ahead is appended to.  No Ray."""
from __future__ import annotations

import errno
import logging
import os
import shutil

import pytest

from raymq.storage import commitlog
from raymq.storage.errors import DiskFullError
from tests.helpers import SMALL, batch, body, commitlog_files, open_store


def test_the_space_allocated_ahead_is_never_data(tmp_path, caplog):
    live, image = tmp_path / "live", tmp_path / "image"
    store = open_store(live)
    try:
        store.put(batch("t", 0, 0, 10))
        seg = commitlog_files(live)[-1]
        data_end = store.max_phys_offset
        assert os.path.getsize(seg) > data_end  # allocated ahead (to the segment's size here)
        with open(seg, "rb") as f:
            f.seek(data_end)
            assert not f.read().strip(b"\0")
        shutil.copytree(live, image)  # what a killed process leaves on disk
    finally:
        store.close()
    assert os.path.getsize(seg) == data_end  # closed: the data alone
    caplog.set_level(logging.WARNING, logger="raymq.storage")
    with open_store(image) as again:  # the zeros end the data: nothing torn, nothing lost
        assert again.max_phys_offset == data_end
        assert [m.body for m in again.read_queue("t", 0, 0, 100)] == [body(i) for i in range(10)]
        again.put(batch("t", 0, 10, 5))
        assert [m.body for m in again.read_queue("t", 0, 0, 100)] == [body(i) for i in range(15)]
    assert "torn" not in caplog.text


def test_a_torn_frame_before_the_zeros_is_still_cut_and_logged(tmp_path, caplog):
    live, image = tmp_path / "live", tmp_path / "image"
    with open_store(live) as store:
        store.put(batch("t", 0, 0, 10))
        last = store.put(batch("t", 0, 10, 10))
        shutil.copytree(live, image)
    seg = commitlog_files(image)[-1]
    with open(seg, "r+b") as f:  # the last frame half written, then the zeros ahead
        f.seek(last.phys_offsets[0] + 100)
        f.write(bytes(1000))
    caplog.set_level(logging.WARNING, logger="raymq.storage")
    if (image / "checkpoint").exists():  # (the whole segment scanned, as after a crash)
        os.unlink(image / "checkpoint")
    with open_store(image) as again:
        assert [m.body for m in again.read_queue("t", 0, 0, 100)] == [body(i) for i in range(10)]
    assert "truncating torn tail" in caplog.text


def test_a_sealed_segment_holds_no_zeros(tmp_path):
    with open_store(tmp_path) as store:
        for k in range(30):  # ~200 KiB a round of 4 KiB bodies: several 256 KiB segments
            store.put(batch("t", 0, k * 50, 50, size=4000))
        segments = store._log.segments()
        files = commitlog_files(tmp_path)
        assert len(files) >= 3
        for path, _base, size in segments[:-1]:
            assert os.path.getsize(path) == size


def test_a_disk_too_full_for_the_zeros_takes_what_fits_and_refuses_only_what_does_not(
        tmp_path, monkeypatch):
    """The zeros ahead are a convenience: with no room for them a put writes what it needs;
    with no room for that either it fails with nothing written, and the store goes on."""
    store = open_store(tmp_path, SMALL)
    try:
        store.put(batch("t", 0, 0, 1))
        seg = store._log._segments[-1]
        commitlog._trim(seg)  # (nothing allocated ahead: the next put must allocate)
        room = [seg.size + 600]  # the disk's last free byte (a file offset)
        real_fallocate = os.posix_fallocate

        def fallocate(fd, offset, length):
            if fd == seg.fd and offset + length > room[0]:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_fallocate(fd, offset, length)
        monkeypatch.setattr(commitlog.os, "posix_fallocate", fallocate)
        store.put(batch("t", 0, 1, 1))  # fits: stored though the space ahead could not be
        assert seg.allocated <= room[0]
        with pytest.raises(DiskFullError, match="nothing written"):
            store.put(batch("t", 0, 2, 3))  # does not fit
        assert os.path.getsize(seg.path) == seg.allocated == seg.size
        room[0] = 1 << 40  # room again
        store.put(batch("t", 0, 2, 3))
        assert [m.body for m in store.read_queue("t", 0, 0, 10)] == [body(i) for i in range(5)]
    finally:
        store.close()


def test_a_filesystem_that_cannot_allocate_ahead_is_appended_to(tmp_path, monkeypatch):
    def cannot(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")
    monkeypatch.setattr(commitlog.os, "posix_fallocate", cannot)
    with open_store(tmp_path) as store:
        for k in range(3):
            store.put(batch("t", 0, k * 10, 10))
            assert os.path.getsize(commitlog_files(tmp_path)[-1]) == store.max_phys_offset
    with open_store(tmp_path) as again:
        assert [m.body for m in again.read_queue("t", 0, 0, 100)] == [body(i) for i in range(30)]
