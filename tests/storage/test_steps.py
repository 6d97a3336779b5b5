"""The step stamps of one request (``raymq.storage.steps``): off, nothing is kept; on, a
thread's request collects its steps in order and ``take`` ends it; each thread has its
own.  No Ray."""
from __future__ import annotations

import threading

from raymq.storage import steps


def test_steps_are_kept_per_thread_only_while_on_and_taken_once():
    steps.enable(False)
    steps.start("a")
    steps.mark("b")
    assert steps.take() is None  # off: nothing kept
    steps.enable(True)
    try:
        steps.mark("before any start")  # (no request begun in this thread: ignored)
        steps.start("call")
        steps.mark("sent")
        other = []

        def elsewhere():
            steps.mark("not mine")
            steps.start("other")
            other.append(steps.take())
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
        steps.mark("woken")
        marks = steps.take()
        assert [name for name, _t in marks] == ["call", "sent", "woken"]
        assert [name for name, _t in other[0]] == ["other"]
        assert steps.take() is None  # taken: the request ended
        assert all(a[1] <= b[1] for a, b in zip(marks, marks[1:]))
        # a client's and a shard's stamps merged: each step timed from the one before it
        assert steps.durations([("call", 0), ("woken", 9_000), ("shard.read", 1_500)]) == {
            "shard.read": 1.5, "woken": 7.5}
    finally:
        steps.enable(False)


def test_a_stored_put_stamps_its_write_and_the_fsync_it_did(tmp_path):
    from raymq.storage import RecordBatch
    from tests.helpers import open_store
    from raymq.storage import StoreConfig
    steps.enable(True)
    try:
        with open_store(tmp_path, StoreConfig(flush_mode="sync")) as store:
            steps.start("put")
            store.put(RecordBatch("t", 0, [b"x"]))
            names = [name for name, _t in steps.take()]
        assert names == ["put", "store.written", "fsync.begin", "fsync.done"]
    finally:
        steps.enable(False)
