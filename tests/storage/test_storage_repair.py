"""`raymq storage cut`: the operator's way out of a bad frame followed by valid data.

End to end on a store directory, no Ray: corrupt a frame in the middle, see the store
refuse to open with an error naming file, offset and command; cut; reopen; everything
before the cut is intact and what was after it is kept aside in a quarantine directory.
"""
from __future__ import annotations

import io
import os

import pytest

from raymq.storage import CorruptLogError
from raymq.storage.records import FRAME_HEADER_BYTES
from raymq.tools.cli import main
from tests.helpers import (batch, body, commitlog_files, flip, forget_checkpoint,
                           open_store)
from tests.helpers import queue_bodies as bodies






def corrupted_store(tmp_path):
    """t/0: 10 records, then a frame of 10 with a flipped byte, then u/0: 5 records."""
    directory = tmp_path / "store"
    with open_store(directory) as store:
        store.put(batch("t", 0, 0, 10))
        bad = store.put(batch("t", 0, 10, 10))
        after = store.put(batch("u", 0, 0, 5))
    forget_checkpoint(directory)  # older than the damage, so recovery scans it
    seg = commitlog_files(directory)[-1]
    flip(seg, bad.phys_offsets[3] + 90)
    return (directory, seg, bad.phys_offsets[0] - FRAME_HEADER_BYTES,
            after.phys_offsets[0] - FRAME_HEADER_BYTES)


def test_a_bad_frame_followed_by_valid_data_names_the_command_that_cuts_there(tmp_path):
    directory, seg, at, _after = corrupted_store(tmp_path)
    with pytest.raises(CorruptLogError) as err:
        open_store(directory)
    text = str(err.value)
    assert seg in text and f"file offset {at}" in text  # segment base 0: file offset = phys
    assert f"raymq storage cut {directory} --at {at}" in text


def test_storage_cut_refuses_without_confirmation_then_cuts_and_the_store_opens(
        tmp_path, capsys, monkeypatch):
    directory, seg, at, _after = corrupted_store(tmp_path)
    with open(seg, "rb") as f:
        original = f.read()
    monkeypatch.setattr("sys.stdin", io.StringIO("n\n"))
    assert main(["storage", "cut", str(directory), "--at", str(at)]) == 1
    out = capsys.readouterr().out
    assert f"{len(original) - at} bytes" in out and "5 records" in out and "u: 5" in out
    assert "nothing was changed" in out
    with open(seg, "rb") as f:
        assert f.read() == original
    with pytest.raises(CorruptLogError):
        open_store(directory)

    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    assert main(["storage", "cut", str(directory), "--at", str(at)]) == 0
    out = capsys.readouterr().out
    [qdir] = [os.path.join(directory, "quarantine", n)
              for n in os.listdir(directory / "quarantine")]
    assert qdir in out
    with open(os.path.join(qdir, os.path.basename(seg) + f".from-{at}"), "rb") as f:
        assert f.read() == original[at:]  # nothing thrown away: moved aside
    assert os.path.getsize(seg) == at
    with open_store(directory) as store:
        assert bodies(store, "t") == [body(i) for i in range(10)]
        assert bodies(store, "u") == []
        assert store.put(batch("t", 0, 10, 1)).queue_offsets == [10]


def test_storage_cut_moves_later_segments_aside_too(tmp_path, capsys):
    directory = tmp_path / "store"
    with open_store(directory) as store:
        first = store.put(batch("t", 0, 0, 50))
        store.put(batch("t", 0, 50, 50))
        store.put(batch("t", 0, 100, 2000))  # fills more segments
    forget_checkpoint(directory)
    segs = commitlog_files(directory)
    assert len(segs) >= 3
    at = first.phys_offsets[-1] + first.sizes[-1]  # the second put's frame
    flip(segs[0], at + FRAME_HEADER_BYTES + 100)
    with pytest.raises(CorruptLogError, match=f"raymq storage cut {directory} --at {at}"):
        open_store(directory)
    assert main(["storage", "cut", str(directory), "--at", str(at), "--yes"]) == 0
    out = capsys.readouterr().out
    assert f"{len(segs) - 1} later segment files" in out and "2000 records" in out
    assert commitlog_files(directory) == segs[:1]
    [qdir] = os.listdir(directory / "quarantine")
    assert sorted(os.listdir(directory / "quarantine" / qdir)) == sorted(
        [os.path.basename(segs[0]) + f".from-{at}"] + [os.path.basename(s) for s in segs[1:]])
    with open_store(directory) as store:
        assert bodies(store, "t") == [body(i) for i in range(50)]


@pytest.mark.parametrize("where", ["inside a frame", "past the end", "after the bad frame"])
def test_storage_cut_refuses_an_offset_that_is_not_a_frame_boundary_of_good_frames(
        tmp_path, capsys, where):
    directory, seg, at, after = corrupted_store(tmp_path)
    with open(seg, "rb") as f:
        original = f.read()
    offset = {"inside a frame": at - 7, "past the end": len(original) + 100,
              "after the bad frame": after}[where]
    assert main(["storage", "cut", str(directory), "--at", str(offset), "--yes"]) == 1
    err = capsys.readouterr().err
    assert "STORAGE_ERROR" in err and str(offset) in err
    if where == "inside a frame":
        assert "frame boundaries" in err
    if where == "after the bad frame":
        assert f"cut there instead (--at {at})" in err
    with open(seg, "rb") as f:
        assert f.read() == original
    assert not os.path.exists(directory / "quarantine")


def test_a_cut_inside_a_put_of_several_frames_says_the_whole_put_goes(tmp_path, capsys):
    directory = tmp_path / "store"
    with open_store(directory) as store:
        store.put(batch("t", 0, 0, 10))
        big = store.put(batch("t", 0, 10, 200))
    phys = big.phys_offsets
    starts = [phys[0]] + [phys[i] for i in range(1, len(phys)) if phys[i] - phys[i - 1] != 78]
    frames = [p - FRAME_HEADER_BYTES for p in starts]
    assert len(frames) >= 3
    forget_checkpoint(directory)
    flip(commitlog_files(directory)[-1], frames[2] + 200)
    with pytest.raises(CorruptLogError, match=f"--at {frames[2]}"):
        open_store(directory)
    assert main(["storage", "cut", str(directory), "--at", str(frames[2]), "--yes"]) == 0
    assert f"began at physical offset {frames[0]}" in capsys.readouterr().out
    with open_store(directory) as store:  # the put is all or nothing: its first frames go
        assert bodies(store, "t") == [body(i) for i in range(10)]
