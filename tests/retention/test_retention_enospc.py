"""Retention on a disk with no room left at all (ENOSPC, not only past ``disk_full_ratio``):
a round must free space without first writing anything.  Two writes came before any
deletion and failed every round on such a disk, so nothing was ever freed: the
deleted-topics file rewritten once a deleted topic's old segments had gone, and the
carrying forward of what pins the log (a timer rolled to the head of the log).  Each is
now skipped for the round (logged); what may go goes.  In-process shard, no Ray."""
from __future__ import annotations

import errno

from raymq.message import Prop
from raymq.storage import RecordBatch, topics
from raymq.storage.clock import ManualClock
from raymq.storage.errors import DiskFullError
from tests.helpers import open_shard

HOUR, DAY = 3600_000, 86_400_000
MB = 1 << 20
SEG = 9 * MB


def bulk(sh, mb: int, start: int = 0) -> None:
    for i in range(mb * 4):
        sh.send(RecordBatch("bulk", 0, [b"%08d" % (start + i) + bytes(256 * 1024 - 8)]))


def no_room(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_deleted_topics_file_that_cannot_be_written_does_not_stop_deletion(tmp_path,
                                                                            monkeypatch):
    clock = ManualClock(1_700_000_000_000)
    sh = open_shard(tmp_path, [("bulk", 0), ("t", 0)], clock=clock, segment_size_bytes=SEG,
                    retention_ms=HOUR)
    try:
        sh.send(RecordBatch("t", 0, [b"old"]))
        assert sh.store.delete_topic("t")
        bulk(sh, 20)
        clock.advance(2 * HOUR)
        assert sh.janitor.run_once().count >= 1   # the tombstone's old segment went
        bulk(sh, 20, 100)
        clock.advance(2 * HOUR)
        monkeypatch.setattr(topics, "write_deleted", no_room)
        before = sh.store.min_phys_offset
        assert sh.janitor.run_once().count >= 1
        assert sh.store.min_phys_offset > before
    finally:
        monkeypatch.undo()
        sh.close()


def test_a_pin_that_cannot_be_carried_forward_still_lets_what_lies_below_it_go(tmp_path):
    clock = ManualClock(1_700_000_000_000)
    sh = open_shard(tmp_path, [("bulk", 0), ("t", 0)], clock=clock, segment_size_bytes=SEG,
                    retention_ms=HOUR)
    try:
        bulk(sh, 20)                                  # segments nothing waits on
        due = clock.now_ms() + 40 * DAY
        timer = sh.send(RecordBatch("t", 0, [b"in 40 days"],
                                    properties=[{Prop.DELIVER_AT: str(due)}]))
        bulk(sh, 20, 100)
        clock.advance(2 * HOUR)
        put = sh.store.put

        def full(batch, *args, **kwargs):  # the disk is full: the timer cannot be rolled
            raise DiskFullError("no space left on device (ENOSPC)")
        sh.store.put = full
        try:
            verdict = sh.janitor.run_once()
        finally:
            sh.store.put = put
        assert verdict.count >= 1 and verdict.held_by == "pinned", verdict
        assert sh.store.min_phys_offset <= timer.phys[0]  # the timer's segment stays
    finally:
        sh.close()
