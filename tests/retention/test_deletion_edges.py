"""Deleting a topic, at its edges: a crash at any point of dropping its queues is finished
when the store opens again (its old records never come back, a topic created again
starts at offset 0 and stays there across restarts); a deleted topic's Kafka-style
aborted ranges go with it, from memory and from the index's snapshot, so they never
hide the records of a topic created again with the name (a transactional id keeps its
producer id across epochs).  In-process stores and shards, no Ray."""
from __future__ import annotations

import json
import os

import pytest

from raymq.actors.kafka_tx.shard_side import KTX_INDEX_TOPIC, SNAPSHOT_FILE, SNAPSHOT_KIND
from raymq.storage import MessageStore, RecordBatch, topics
from raymq.storage.snapshots import read_snapshot
from tests.helpers import SMALL, batch, forget_checkpoint, open_shard


class Crash(Exception):
    """The process dies here (the store is abandoned: no close, no closing checkpoint)."""


def _note_then_crash(real):
    def write(directory, deleted):
        real(directory, deleted)
        raise Crash("after the deleted-topics file was written")
    return write


def _crash_instead(_directory, _deleted):
    raise Crash("before the deleted-topics file was written")


def _crash_at_second_unlink(monkeypatch):
    real, calls = os.unlink, []

    def unlink(path, *a, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise Crash(f"after one queue file of two was unlinked ({calls[0]})")
        return real(path, *a, **kw)
    monkeypatch.setattr(os, "unlink", unlink)


def _old_bodies(store, topic="a", qid=0):
    return [m.body for m in store.read_queue(topic, qid, 0, 1000)]


@pytest.mark.parametrize("where", ["after_noting", "between_queue_files", "before_noting"])
def test_a_crash_anywhere_in_dropping_the_queues_is_finished_on_open(tmp_path, monkeypatch,
                                                                    where):
    path = tmp_path / "s"
    store = MessageStore(str(path), SMALL, background=False)
    store.put(batch("a", 0, 0, 50))
    store.put(batch("a", 1, 0, 7))
    store.put(batch("b", 0, 0, 5))
    with monkeypatch.context() as m:
        if where == "after_noting":
            m.setattr(topics, "write_deleted", _note_then_crash(topics.write_deleted))
        elif where == "before_noting":
            m.setattr(topics, "write_deleted", _crash_instead)
        else:
            _crash_at_second_unlink(m)
        with pytest.raises(Crash):
            store.delete_topic("a")
    store.checkpoint()  # (the background flusher's checkpoint, covering the tombstone)
    del store           # the process died: abandoned, not closed
    for _ in range(2):  # opened again, and again (nothing undone by the second open)
        store = MessageStore(str(path), SMALL, background=False)
        try:
            assert store.max_queue_offset("a", 0) == 0 and store.max_queue_offset("a", 1) == 0
            assert _old_bodies(store) == [] and _old_bodies(store, qid=1) == []
            assert len(_old_bodies(store, "b")) == 5
            assert "a" in topics.read_deleted(store.directory)
            assert "a" in store.retention.tombstones  # (its old records are garbage)
        finally:
            store.close()
    # created again: from offset 0, and it stays, reopened from the checkpoint or the log
    with MessageStore(str(path), SMALL, background=False) as store:
        assert store.put(batch("a", 0, 900, 3)).queue_offsets == [0, 1, 2]
    for rebuild in (False, True, False):
        if rebuild:
            forget_checkpoint(path)
        with MessageStore(str(path), SMALL, background=False) as store:
            assert _old_bodies(store) == [batch("a", 0, 900, 3).bodies[i] for i in range(3)]
            assert store.max_queue_offset("a", 1) == 0


# ------------------------------------------------------- Kafka-style aborted ranges
PID = 5
BODIES_OLD = [b"aborted-%d" % i for i in range(5)]
BODIES_NEW = [b"committed-%d" % i for i in range(5)]


def _committed(sh, topic="t", qid=0) -> list[bytes]:
    [(_t, _q, got, _n, _e)] = sh.pull([(topic, qid, 0, 1000)], 0, None, None, "read_committed")
    return [m.body for m in got.messages()]


def _delete(sh, topic: str, left: list) -> None:
    """The controller deleted ``topic`` (its routes gone); the shard drops it."""
    sh.set_routes(left)
    sh.routes._fetch = lambda _i: left
    assert sh.drop_topic(topic)


def _create(sh, routes: list) -> None:
    sh.set_routes(routes)
    sh.routes._fetch = lambda _i: routes


def _snapshot_state(sh) -> dict:
    got = read_snapshot(os.path.join(sh.store.directory, SNAPSHOT_FILE), SNAPSHOT_KIND)
    assert got is not None
    return got[1]


def _aborted_in_snapshot(sh, topic: str) -> list:
    return [a for a in _snapshot_state(sh)["aborted"] if a[0] == topic]


def _abort_five(sh, epoch: int, topic="t") -> None:
    sh.ktx_register(PID, epoch, [(topic, 0)])
    sh.ktx_send(RecordBatch(topic, 0, list(BODIES_OLD)), PID, epoch, 1)
    sh.ktx_end(PID, epoch, "ABORT")


def test_a_deleted_topic_s_aborted_ranges_never_hide_the_topic_created_again(tmp_path):
    sh = open_shard(tmp_path, [("t", 0), ("u", 0)])
    try:
        _abort_five(sh, 0)
        assert _committed(sh) == [] and sh.ktx.state.aborted_count() == 1
        _delete(sh, "t", [("u", 0)])
        _create(sh, [("t", 0), ("u", 0)])
        sh.ktx_register(PID, 1, [("t", 0)])  # the same transactional id: the same producer id
        sh.ktx_send(RecordBatch("t", 0, list(BODIES_NEW)), PID, 1, 1)
        sh.ktx_end(PID, 1, "COMMIT")
        assert _committed(sh) == BODIES_NEW  # (offsets 0-4, where the aborted ones were)
    finally:
        sh.close()
    for compact in (False, True):  # after a restart: the index replayed, then its snapshot
        sh = open_shard(tmp_path, [("t", 0), ("u", 0)])
        try:
            assert _committed(sh) == BODIES_NEW
            if compact:
                assert sh.ktx.compact(force=True)
                assert _aborted_in_snapshot(sh, "t") == []
        finally:
            sh.close()
    sh = open_shard(tmp_path, [("t", 0), ("u", 0)])
    try:
        assert _committed(sh) == BODIES_NEW and sh.ktx.state.aborted_count() == 0
    finally:
        sh.close()


def test_a_deleted_topic_s_aborted_ranges_leave_memory_and_the_snapshot(tmp_path):
    """A topic never created again: its ranges go at once, another topic's stay."""
    sh = open_shard(tmp_path, [("t", 0), ("u", 0)])
    try:
        _abort_five(sh, 0)
        _abort_five(sh, 1, topic="u")
        assert sh.ktx.compact(force=True)  # (a snapshot holding both before the deletion)
        assert len(_aborted_in_snapshot(sh, "t")) == 1
        _delete(sh, "t", [("u", 0)])
        state = sh.ktx.state
        assert state.aborted_count() == 1 and list(state._aborted) == [("u", 0)]
        assert not sh.ktx.touched(("t", 0)) and ("t", 0) not in state._holding
        assert sh.ktx.compact(force=True)
        snap = _snapshot_state(sh)
        assert _aborted_in_snapshot(sh, "t") == [] and len(snap["aborted"]) == 1
        assert ["t", 0] not in snap["touched"]
    finally:
        sh.close()
    sh = open_shard(tmp_path, [("u", 0)])
    try:
        assert list(sh.ktx.state._aborted) == [("u", 0)] and _committed(sh, "u") == []
    finally:
        sh.close()


def test_a_restart_before_the_snapshot_replays_the_deletion_from_the_index(tmp_path):
    """The deletion reaches the index with the topic's tombstone (one put): a restart that
    replays the index from a snapshot taken before it forgets the ranges again."""
    sh = open_shard(tmp_path, [("t", 0), ("u", 0)])
    try:
        _abort_five(sh, 0)
        assert sh.ktx.compact(force=True)
        _delete(sh, "t", [("u", 0)])
    finally:
        sh.close()
    assert len(_aborted_in_snapshot(sh, "t")) == 1  # (the snapshot is from before)
    sh = open_shard(tmp_path, [("u", 0)])
    try:
        assert sh.ktx.state.aborted_count() == 0 and not sh.ktx.touched(("t", 0))
        index = [json.loads(m.body) for m in sh.store.scan_queue(KTX_INDEX_TOPIC, 0)]
        assert [r.get("topic") for r in index if r["k"] == "drop"] == ["t"]
    finally:
        sh.close()
