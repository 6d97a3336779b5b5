"""A power cut drops what was not fsynced: check that every acknowledged record survives it.

A SIGKILL cannot find a missing fsync -- the page cache survives the process.  Here the
store runs in this process with ``os.fsync`` wrapped: each fsync of a file under the
store records the file's bytes (by inode) as durable, each fsync of a directory its
entries (name -> inode).  At many moments of a workload (sync puts over many queues,
puts of several frames, new topics, checkpoints, segment rolls) the durable image --
only what was fsynced, as a power cut would leave it -- is written to a new directory,
opened as a store, and every record acknowledged so far is read back through its
consume queue.  What was written after a file's last fsync: in ``drop`` mode it is
gone; in ``zero`` mode the file keeps its size and those bytes read as zeros; in
``pages`` mode, for the consume queues (index files written without fsync), each 4 KiB
page of it is either there or zeros, at random -- the kernel writes dirty pages back
in any order (for the commit log as in ``zero`` mode).

The check is shown to catch a missing fsync: with the commit log's or the consume
queues' fsyncs not counted it fails.
"""
from __future__ import annotations

import os
import random
import shutil
import stat

import pytest

from raymq.storage import MessageStore, RecordBatch
from tests.crash_writer import CHECKPOINT_EVERY, POINTS_CONFIG, plan_puts, put_body
from tests.helpers import store_whose_queues_must_be_rebuilt

PUTS = 45
PAGE = 4096


class FsyncRecorder:
    """What the fsyncs under ``root`` made durable, so far."""

    def __init__(self, root: str, *, not_durable: str | None = None):
        self.root = os.path.realpath(root)
        self.not_durable = not_durable  # sabotage: fsyncs of paths containing it are ignored
        self.contents: dict[int, bytes] = {}  # inode -> bytes at its last fsync
        self.listings: dict[str, dict[str, tuple[int, bool]]] = {}  # dir -> name -> (ino, dir?)
        self.fsyncs = 0
        self.on_fsync = None  # called after each fsync recorded

    def install(self, monkeypatch) -> None:
        real_fsync, real_open = os.fsync, os.open

        def fsync(fd):
            real_fsync(fd)
            self._record(fd)

        def open_(path, flags, mode=0o777, *, dir_fd=None):
            existed = os.path.exists(path)
            fd = real_open(path, flags, mode, dir_fd=dir_fd)
            if (flags & os.O_CREAT and not existed) or flags & os.O_TRUNC:
                self.contents.pop(os.fstat(fd).st_ino, None)  # a new file: nothing durable yet
            return fd
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "open", open_)

    def _record(self, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if not path.startswith(self.root):
            return
        if self.not_durable and self.not_durable in path:
            return
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            self.listings[path] = {e.name: (e.inode(), e.is_dir(follow_symlinks=False))
                                   for e in os.scandir(path)}
        else:
            with open(f"/proc/self/fd/{fd}", "rb") as f:
                self.contents[os.fstat(fd).st_ino] = f.read()
        self.fsyncs += 1
        if self.on_fsync is not None:
            self.on_fsync()

    def write_image(self, dest: str, mode: str, rng: random.Random) -> None:
        """The durable state under ``root``, as a power cut now would leave it, at ``dest``."""
        self._write_dir(self.root, dest, mode, rng)

    def _write_dir(self, src: str, dest: str, mode: str, rng: random.Random) -> None:
        os.makedirs(dest, exist_ok=True)
        for name, (ino, is_dir) in self.listings.get(src, {}).items():
            if is_dir:
                self._write_dir(os.path.join(src, name), os.path.join(dest, name), mode, rng)
                continue
            data = self.contents.get(ino, b"")
            if mode != "drop":
                data = unsynced_tail(os.path.join(src, name), ino, data,
                                     pages=(mode == "pages" and "consumequeue" in src), rng=rng)
            with open(os.path.join(dest, name), "wb") as f:
                f.write(data)


def unsynced_tail(path: str, ino: int, synced: bytes, *, pages: bool,
                  rng: random.Random) -> bytes:
    """``synced`` followed by what the live file holds past it: zeros, or (``pages``)
    each page's bytes or zeros at random."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_ino != ino:
                return synced
            live = f.read()
    except FileNotFoundError:
        return synced
    if len(live) <= len(synced):
        return synced
    out = bytearray(synced)
    pos = len(synced)
    while pos < len(live):
        end = min(len(live), (pos // PAGE + 1) * PAGE)
        out += live[pos:end] if pages and rng.random() < 0.5 else bytes(end - pos)
        pos = end
    return bytes(out)


def check_image(recorder: FsyncRecorder, dest: str, acked: dict[int, list[int]], plan, *,
                mode: str, rng: random.Random) -> None:
    """Every acknowledged record is in the durable image, where its ack said."""
    recorder.write_image(dest, mode, rng)
    on_fsync, recorder.on_fsync = recorder.on_fsync, None
    expected: dict[tuple[str, int], dict[int, bytes]] = {}
    for p, offsets in acked.items():
        for i, (queue, qoff) in enumerate(zip(plan[p], offsets)):
            expected.setdefault(queue, {})[qoff] = put_body(p, i, len(plan[p]))
    try:
        with MessageStore(dest, POINTS_CONFIG, background=False) as store:
            for (topic, qid), want in expected.items():
                read = store.read_batch(topic, qid, 0, max(want) + 1)
                got = dict(zip(read.queue_offsets.tolist(), read.bodies))
                lost = sorted(q for q, b in want.items() if got.get(q) != b)
                assert not lost, (f"acknowledged records lost at {topic}/{qid}, queue offsets "
                                  f"{lost[:5]}...: a power cut at fsync {recorder.fsyncs}")
        shutil.rmtree(dest)
    finally:
        recorder.on_fsync = on_fsync


def run_workload(tmp_path, monkeypatch, *, mode: str, not_durable: str | None = None,
                 seed: int = 3) -> int:
    """Write, checking the durable image at a fifth of the fsyncs and after every ack;
    return how many images were checked."""
    directory = str(tmp_path / "store")
    os.makedirs(directory)
    plan = plan_puts(seed, PUTS)
    recorder = FsyncRecorder(directory, not_durable=not_durable)
    rng = random.Random(seed)
    acked: dict[int, list[int]] = {}
    checked = [0]

    def check():
        checked[0] += 1
        check_image(recorder, str(tmp_path / f"image{checked[0]}"), acked, plan,
                    mode=mode, rng=rng)
    recorder.install(monkeypatch)
    store = MessageStore(directory, POINTS_CONFIG, background=False)
    recorder.on_fsync = lambda: rng.random() < 0.2 and check()
    try:
        for p, keys in enumerate(plan):
            n = len(keys)
            res = store.put(RecordBatch([t for t, _ in keys], [q for _, q in keys],
                                        [put_body(p, i, n) for i in range(n)]))
            assert res.status.name == "PUT_OK"
            acked[p] = res.queue_offsets
            check()
            if p % CHECKPOINT_EVERY == CHECKPOINT_EVERY - 1:
                store.checkpoint()
        segments = len(store.segments())
    finally:
        recorder.on_fsync = None
        store.close()
    assert segments >= 3 and recorder.fsyncs > PUTS  # rolls and checkpoints happened
    return checked[0]


@pytest.mark.slow  # some 3 to 7 s each
@pytest.mark.parametrize("mode", ["drop", "zero", "pages"])
def test_every_acknowledged_record_survives_a_power_cut_at_any_fsync(tmp_path, monkeypatch,
                                                                     mode):
    checked = run_workload(tmp_path, monkeypatch, mode=mode)
    assert checked > PUTS


@pytest.mark.parametrize("mode", ["drop", "zero", "pages"])
def test_a_power_cut_at_any_fsync_of_a_consume_queue_rebuild_loses_nothing(tmp_path,
                                                                           monkeypatch, mode):
    directory = str(tmp_path / "store")
    expected = store_whose_queues_must_be_rebuilt(directory, POINTS_CONFIG)
    recorder = FsyncRecorder(directory)
    for path, dirs, files in os.walk(directory):  # all of it durable before the rebuild
        for name in dirs + files + ["."]:
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
            try:
                recorder._record(fd)
            finally:
                os.close(fd)
    rng, checked = random.Random(5), []

    def check():
        dest = str(tmp_path / f"image{len(checked)}")
        checked.append(dest)
        recorder.on_fsync = None
        recorder.write_image(dest, mode, rng)
        with MessageStore(dest, POINTS_CONFIG, background=False) as store:
            got = {q: [m.body for m in store.read_queue(*q, 0, 100)] for q in expected}
        assert got == expected, f"records lost after a power cut at fsync {recorder.fsyncs}"
        shutil.rmtree(dest)
        recorder.on_fsync = check
    recorder.install(monkeypatch)
    recorder.on_fsync = check
    MessageStore(directory, POINTS_CONFIG, background=False).close()  # rebuilds
    recorder.on_fsync = None
    assert len(checked) >= 8  # marker, deletions, new queues, the final checkpoint...


@pytest.mark.parametrize("sabotage", ["commitlog/", "consumequeue/"])
def test_the_power_cut_check_catches_a_missing_fsync(tmp_path, monkeypatch, sabotage):
    """Fsyncs of the commit log (or of the consume queues) not counted: the check fails."""
    with pytest.raises(AssertionError, match="lost"):
        run_workload(tmp_path, monkeypatch, mode="drop", not_durable=sabotage)
