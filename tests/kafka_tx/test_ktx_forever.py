"""Kafka-style transactions that hold up for ever (issue 25): no wedged transactional id,
no stuck LSO, nothing applied out of order, nothing refused after the point of no return,
state that follows what is live.  In-process coordinator and shards on a manual clock
(the coordinator's shard calls go straight to ``BrokerShard`` objects, or fail, to play a
shard that is down); crashes are real process deaths in a child."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.helpers import open_shard
from raymq.actors.config import ClusterConfig
from raymq.actors.kafka_tx.log import TXN_LOG_TOPIC
from raymq.actors.kafka_tx.shard_side import KTX_STORE_PID_BASE, KafkaTxns
from raymq.actors.shard import BrokerShard
from raymq.actors.kafka_tx.state import MAX_EPOCH, TxnMetadata, TxnState
from raymq.storage import RecordBatch
from raymq.storage.errors import (BrokerUnavailableError, ConfigError, InvalidMessageError,
                                  InvalidTxnStateError, ProducerFencedError,
                                  QuotaExceededError, TransactionAbortedError)
from raymq.storage.records import SysFlag
from tests.kafka_tx.test_coordinator import Cluster, write
from tests.kafka_tx.test_ktx_shard import read, tx_write
from tests.helpers import ROOT



@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def at_epoch(cluster, tid: str, epoch: int) -> tuple[int, int]:
    """A transactional id whose log says it is at ``epoch`` (as after that many
    transactions), read back by a restarted coordinator: its (producer id, epoch)."""
    pid, _ = cluster.coordinator.init_producer(tid)
    meta = TxnMetadata(tid, pid, epoch, 10_000, TxnState.COMPLETE_COMMIT, update_ms=1)
    cluster.coordinator.log.store.put(RecordBatch(TXN_LOG_TOPIC, 0, [meta.to_json()], keys=[tid]))
    cluster.restart_coordinator()
    d = cluster.coordinator.describe_transaction(tid)
    return d["producer_id"], d["epoch"]


# ------------------------------------------------------------------ 1. epoch exhaustion
def test_the_transaction_that_exhausts_the_epoch_completes_under_a_new_producer_id(cluster):
    pid, epoch = at_epoch(cluster, "job", MAX_EPOCH - 3)
    c = cluster.coordinator
    seen = []
    for i in range(4):  # across the limit: MAX - 3, MAX - 2, (MAX - 1 -> new id), 0
        write(cluster, "job", pid, epoch, 1, i % 2, b"m%d" % i)
        nxt = c.end_transaction("job", pid, epoch, "COMMIT")
        assert c.end_transaction("job", pid, epoch, "COMMIT") == nxt  # a retry: the same
        seen.append(nxt)
        pid, epoch = nxt
    assert [e for _p, e in seen] == [MAX_EPOCH - 2, MAX_EPOCH - 1, 0, 1]
    assert len({p for p, _e in seen[:2]}) == 1 and seen[2][0] != seen[1][0]
    assert seen[3][0] == seen[2][0]
    assert cluster.read(0) == [b"m0", b"m2"] and cluster.read(1) == [b"m1", b"m3"]
    with pytest.raises(ProducerFencedError):  # the old producer id is fenced for good
        c.add_to_transaction("job", seen[1][0], MAX_EPOCH - 1, [(0, "t", 0)])
    with pytest.raises(ProducerFencedError):  # ... on the shards too
        cluster.shards[0].ktx_register(seen[1][0], MAX_EPOCH - 1, [("t", 0)])
    # a restart, a new instance, an operator: nothing is wedged at the limit
    c = cluster.restart_coordinator()
    assert c.describe_transaction("job")["producer_id"] == pid
    pid2, epoch2 = c.init_producer("job")
    assert (pid2, epoch2) == (pid, epoch + 1)


def test_a_new_instance_and_an_operator_abort_at_the_epoch_limit_do_not_wedge(cluster):
    pid, epoch = at_epoch(cluster, "job", MAX_EPOCH - 1)  # the highest a producer gets
    write(cluster, "job", pid, epoch, 1, 0, b"x")
    # a new instance fences the open transaction at the highest epoch, then rotates
    pid2, epoch2 = cluster.coordinator.init_producer("job")
    assert pid2 != pid and epoch2 == 1  # (aborted under the new id at 0, then bumped)
    assert cluster.read(0) == [] and cluster.shards[0].ktx_status() == []
    with pytest.raises(ProducerFencedError):  # the old instance is fenced
        cluster.coordinator.end_transaction("job", pid, epoch, "COMMIT")
    pid3, epoch3 = at_epoch(cluster, "op", MAX_EPOCH - 1)
    write(cluster, "op", pid3, epoch3, 1, 1, b"y")
    assert cluster.coordinator.abort_transaction("op") == "COMPLETE_ABORT"
    d = cluster.coordinator.describe_transaction("op")
    assert d["producer_id"] != pid3 and d["epoch"] == 0
    assert cluster.shards[1].ktx_status() == []


# ----------------------------------------------- 2. a shard failing while markers are written
def test_a_prepared_transaction_is_driven_to_its_end_by_the_coordinator_itself(cluster):
    c = cluster.coordinator
    pid, epoch = c.init_producer("job")
    other, oe = c.init_producer("other")
    write(cluster, "job", pid, epoch, 1, 0, b"a")
    write(cluster, "job", pid, epoch, 1, 1, b"b")
    cluster.down = {1}  # shard-1 cannot take its marker
    with pytest.raises(BrokerUnavailableError):
        c.end_transaction("job", pid, epoch, "COMMIT")
    assert c.describe_transaction("job")["state"] == "PREPARE_COMMIT"
    assert c.complete_prepared() == 0  # still down: tried, and again after a back-off
    cluster.down = set()
    # another producer's commit on the held queue stays invisible while it is held
    write(cluster, "other", other, oe, 1, 1, b"o")
    c.end_transaction("other", other, oe, "COMMIT")
    assert cluster.read(1) == []
    assert c.complete_prepared() == 0  # its back-off has not passed
    cluster.clock.advance(100)
    assert c.complete_prepared() == 1  # nobody asked: the coordinator drove it
    assert cluster.read(0) == [b"a"] and cluster.read(1) == [b"b", b"o"]
    # the producer's retried commit gets the final answer, and its next transaction runs
    nxt = c.end_transaction("job", pid, epoch, "COMMIT")
    assert nxt == (pid, epoch + 1)
    write(cluster, "job", pid, epoch + 1, 1, 0, b"c")
    c.end_transaction("job", pid, epoch + 1, "COMMIT")
    assert cluster.read(0) == [b"a", b"c"]


def test_a_producer_retrying_its_commit_completes_a_prepared_transaction(cluster):
    c = cluster.coordinator
    pid, epoch = c.init_producer("job")
    write(cluster, "job", pid, epoch, 1, 1, b"b")
    cluster.down = {1}
    with pytest.raises(BrokerUnavailableError):
        c.end_transaction("job", pid, epoch, "COMMIT")
    with pytest.raises(BrokerUnavailableError):  # still down: the same retriable error
        c.end_transaction("job", pid, epoch, "COMMIT")
    cluster.down = set()
    assert c.end_transaction("job", pid, epoch, "COMMIT") == (pid, epoch + 1)
    assert cluster.read(1) == [b"b"]
    with pytest.raises(InvalidTxnStateError, match="committed"):  # not an abort now
        c.end_transaction("job", pid, epoch, "ABORT")


def test_an_expiry_round_goes_on_past_a_transaction_it_cannot_complete(cluster):
    c = cluster.coordinator
    for tid, shard in (("stuck", 1), ("late", 0)):
        pid, epoch = c.init_producer(tid, 5_000)
        write(cluster, tid, pid, epoch, 1, shard, tid.encode())
    cluster.clock.advance(5_001)
    cluster.down = {1}
    assert sorted(c.abort_expired()) == ["late", "stuck"]  # both aborted; one prepared
    assert c.describe_transaction("late")["state"] == "COMPLETE_ABORT"
    assert c.describe_transaction("stuck")["state"] == "PREPARE_ABORT"
    cluster.down = set()
    cluster.clock.advance(100)
    assert c.complete_prepared() == 1
    assert c.describe_transaction("stuck")["state"] == "COMPLETE_ABORT"
    assert cluster.shards[1].ktx_status() == []


# ----------------------------------------------------- 3. offsets applied out of order
CHILD = textwrap.dedent("""
    import os, sys, threading
    from raymq.actors.shard import BrokerShard
    from raymq.storage import RecordBatch
    sh = BrokerShard(0, {"data_dir": sys.argv[1], "num_shards": 1}, background=False)
    sh.set_routes([("t", 0), ("src", 0)])
    sh.send(RecordBatch("src", 0, [b"in"] * 8))
    for pid in (1, 2):
        sh.ktx_register(pid, 0, [("t", 0)], ["g%d" % pid])
        sh.ktx_send(RecordBatch("t", 0, [b"out%d" % pid]), pid, 0, 1)
        sh.ktx_offsets(pid, 0, "g%d" % pid, {("src", 0): 2 + pid})
    save, held = sh.store.save_offsets, threading.Event()
    def save_offsets(values, **kw):  # P1's offsets wait: the process dies before they are saved
        if any(k.startswith("g1@") for k in values):
            held.set()
            threading.Event().wait()
        save(values, **kw)
    sh.store.save_offsets = save_offsets
    threading.Thread(target=sh.ktx_end, args=(1, 1, "COMMIT"), daemon=True).start()
    held.wait()                      # P1's markers are durable, its offsets not saved
    sh.ktx_end(2, 1, "COMMIT")       # P2 commits after it, offsets and all
    print("P2 applied", sh.get_offsets("g2", [("src", 0)]), flush=True)
    os._exit(9)
""")


def reopen(tmp_path) -> BrokerShard:
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    sh.set_routes([("t", 0), ("src", 0)])
    return sh


def test_a_commit_whose_offsets_were_lost_is_applied_again_whatever_committed_after(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 9 and "P2 applied {('src', 0): 4}" in out.stdout, out.stderr
    sh = reopen(tmp_path)
    try:
        assert sh.get_offsets("g1", [("src", 0)]) == {("src", 0): 3}  # redone on start
        assert sh.get_offsets("g2", [("src", 0)]) == {("src", 0): 4}
        assert read(sh)[0] == [b"out1", b"out2"]
    finally:
        sh.close()
    sh = reopen(tmp_path)
    try:  # a second start redoes nothing more and keeps them
        assert sh.get_offsets("g1", [("src", 0)]) == {("src", 0): 3}
    finally:
        sh.close()


#: A child's shard with one transaction (a write and a group's offsets) ready to end.
ONE_COMMIT_WITH_OFFSETS = textwrap.dedent("""
        import os, sys
        from raymq.actors.faults import faults_named
        from raymq.actors.shard import BrokerShard
        from raymq.storage import RecordBatch
        sh = BrokerShard(0, {"data_dir": sys.argv[1], "num_shards": 1}, background=False)
        sh.set_routes([("t", 0), ("src", 0)])
        sh.send(RecordBatch("src", 0, [b"in"] * 8))
        sh.ktx_register(5, 0, [("t", 0)], ["g"])
        sh.ktx_send(RecordBatch("t", 0, [b"out"]), 5, 0, 1)
        sh.ktx_offsets(5, 0, "g", {("src", 0): 6})
""")


def test_recovery_reapplies_the_offsets_of_a_commit_cut_short_before_them(tmp_path):
    """Crash point between the end record and its offsets: the child dies inside the
    production path (``ktx.markers_durable``), the restart applies them."""
    child = ONE_COMMIT_WITH_OFFSETS + textwrap.dedent("""
        faults_named("crash_at:ktx.markers_durable")
        sh.ktx_end(5, 1, "COMMIT")
    """)
    out = subprocess.run([sys.executable, "-c", child, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 86 and "ktx.markers_durable" in out.stderr, out.stderr
    assert_committed_with_offsets(tmp_path)


def assert_committed_with_offsets(tmp_path) -> None:
    """``ONE_COMMIT_WITH_OFFSETS``'s transaction, reopened: committed, offsets applied."""
    sh = reopen(tmp_path)
    try:
        assert read(sh)[0] == [b"out"]
        assert sh.get_offsets("g", [("src", 0)]) == {("src", 0): 6}
    finally:
        sh.close()


def test_a_commit_s_offsets_need_no_fsync_of_their_own_a_crash_after_it_keeps_them(tmp_path):
    """The offsets table is not rewritten (fsynced) by a commit (issue 27): the child dies
    right after the commit returned, its offsets file without them; the restart applies
    them again from the durable end record."""
    child = ONE_COMMIT_WITH_OFFSETS + textwrap.dedent("""
        sh.ktx_end(5, 1, "COMMIT")
        print("served", sh.get_offsets("g", [("src", 0)]), flush=True)
        on_disk = os.path.join(sh.directory, "offsets.json")
        print("on disk", os.path.exists(on_disk) and "g@" in open(on_disk).read(), flush=True)
        os._exit(9)
    """)
    out = subprocess.run([sys.executable, "-c", child, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 9, out.stderr
    assert "served {('src', 0): 6}" in out.stdout  # (read at once from the table)
    assert "on disk False" in out.stdout  # (no rewrite of the file by the commit)
    assert_committed_with_offsets(tmp_path)


# ------------------------------------------------------- 4. a quota in the middle of a commit
def test_the_group_quota_refuses_offsets_when_they_are_sent_never_at_the_commit(tmp_path):
    cfg = {"data_dir": str(tmp_path), "num_shards": 1, "max_groups": 2}
    sh = BrokerShard(0, cfg, background=False)
    sh.set_routes([("t", 0), ("src", 0)])
    sh.send(RecordBatch("src", 0, [b"in"] * 4))
    sh.commit_offsets("a", {("src", 0): 1})
    sh.ktx_register(3, 0, [("t", 0)], ["b", "c"])
    tx_write(sh, 3, 0, 1, [b"out"])
    sh.ktx_offsets(3, 0, "b", {("src", 0): 2})  # the second group: taken
    with pytest.raises(QuotaExceededError):  # the third: refused here, not at the commit
        sh.ktx_offsets(3, 0, "c", {("src", 0): 3})
    assert sh.ktx_end(3, 1, "COMMIT") == {"markers": 1}
    assert sh.get_offsets("b", [("src", 0)]) == {("src", 0): 2}
    assert read(sh)[0] == [b"out"]
    sh.close()
    sh = BrokerShard(0, cfg, background=False)  # and it starts again (no crash loop)
    assert sh.get_offsets("b", [("src", 0)]) == {("src", 0): 2}
    sh.close()


# --------------------------------------------------- 6. one producer entry, not one an epoch
def test_the_producer_table_keeps_one_entry_a_producer_id_across_transactions(shard):
    for epoch in range(50):
        shard.ktx_register(9, epoch, [("t", 0)])
        tx_write(shard, 9, epoch, 1, [b"a"])
        again = tx_write(shard, 9, epoch, 1, [b"a"])  # a retry in the same epoch: once
        assert again.duplicate
        tx_write(shard, 9, epoch, 2, [b"b"])
        shard.ktx_end(9, epoch + 1, "COMMIT")
    ktx = [p for p in shard.store.producer_ids() if p >= KTX_STORE_PID_BASE]
    assert len(ktx) == 1
    assert len(read(shard)[0]) == 100


@pytest.fixture
def shard(tmp_path):
    sh = open_shard(tmp_path, [("t", 0), ("t", 1), ("u", 0)])
    yield sh
    sh.close()


# --------------------------------- 7. the aborted index: by producer, searched by offset
def test_two_producers_interleaved_in_one_queue_one_aborting_one_committing(shard):
    shard.ktx_register(1, 0, [("t", 0)])
    shard.ktx_register(2, 0, [("t", 0)])
    for i in range(3):  # a1 c1 a2 c2 a3 c3: interleaved in one queue
        tx_write(shard, 1, 0, i + 1, [b"abort-%d" % i])
        tx_write(shard, 2, 0, i + 1, [b"commit-%d" % i])
    shard.ktx_end(1, 1, "ABORT")
    shard.ktx_end(2, 1, "COMMIT")
    assert read(shard)[0] == [b"commit-0", b"commit-1", b"commit-2"]
    # and the other way round in the next transactions
    shard.ktx_register(1, 1, [("t", 0)])
    shard.ktx_register(2, 1, [("t", 0)])
    tx_write(shard, 2, 1, 1, [b"abort-b"])
    tx_write(shard, 1, 1, 1, [b"commit-b"])
    shard.ktx_end(2, 2, "ABORT")
    shard.ktx_end(1, 2, "COMMIT")
    assert read(shard)[0] == [b"commit-0", b"commit-1", b"commit-2", b"commit-b"]


def test_the_aborted_index_is_searched_not_scanned():
    txns = KafkaTxns()
    q = ("t", 0)
    n = 20_000
    for k in range(n):  # producer 1: aborted [10k, 10k + 5), producer 2: committed between
        txns.apply({"k": "begin", "pid": 1, "epoch": k, "queues": [["t", 0, 10 * k]]})
        txns.apply({"k": "end", "pid": 1, "epoch": k, "fence": k + 1, "outcome": "ABORT",
                    "markers": [["t", 0, 10 * k + 5]]})
    assert txns.aborted_count() == n
    offs = np.arange(0, 10 * n, dtype=np.int64)
    headers = np.zeros(len(offs), dtype=[("flags", "<u4"), ("prepared_offset", "<i8"),
                                         ("queue_offset", "<i8")])
    headers["flags"] = int(SysFlag.TRANSACTIONAL)
    headers["queue_offset"] = offs
    headers["prepared_offset"] = np.where(offs % 10 < 5, 1, 2)
    headers["flags"][offs % 10 == 5] = int(SysFlag.CONTROL)
    keep = txns.visible(q, headers, True)
    expected = (offs % 10 > 5)  # producer 2's records; never a marker
    assert np.array_equal(keep, expected)
    assert txns.visible(q, headers, False).sum() == len(offs) - n  # markers only hidden


# --------------------------------------------------- 12. reserved flags, contradicting ends
def test_a_plain_send_with_reserved_flags_is_refused(shard):
    for flag in (SysFlag.CONTROL, SysFlag.TRANSACTIONAL, SysFlag.TRANSACTION_PREPARED):
        reply = shard.send(RecordBatch("t", 0, [b"x", b"y"], flags=int(flag)))
        assert reply.queue_offsets == [-1, -1] and "flags" in reply.refused[0]
    assert read(shard, isolation="read_uncommitted")[0] == []


def test_an_end_that_contradicts_the_one_written_is_refused(cluster):
    c = cluster.coordinator
    pid, epoch = c.init_producer("victim")
    write(cluster, "victim", pid, epoch, 1, 0, b"a")
    write(cluster, "victim", pid, epoch, 1, 1, b"b")
    # someone with shard-1's channel key aborts the victim's transaction there
    cluster.shards[1].ktx_end(pid, epoch + 1, "ABORT")
    with pytest.raises(InvalidTxnStateError, match="ABORT"):  # never reported a success
        c.end_transaction("victim", pid, epoch, "COMMIT")
    assert c.describe_transaction("victim")["state"] == "PREPARE_COMMIT"
    assert cluster.shards[1].ktx_end(pid, epoch + 1, "ABORT") == {"markers": 0}  # the same


# ------------------------------------------------------------- 13. a monotonic clock
def test_a_wall_clock_stepped_back_does_not_keep_a_transaction_open(cluster):
    c = cluster.coordinator
    pid, epoch = c.init_producer("job", 5_000)
    write(cluster, "job", pid, epoch, 1, 0, b"a")
    cluster.clock.step_wall(-3_600_000)  # an hour back
    cluster.clock.advance(5_001)
    assert c.abort_expired() == ["job"]
    assert cluster.shards[0].ktx_status() == []


def test_a_restart_keeps_an_open_transaction_s_age(cluster):
    c = cluster.coordinator
    pid, epoch = c.init_producer("job", 5_000)
    write(cluster, "job", pid, epoch, 1, 0, b"a")
    cluster.clock.advance(4_000)
    c = cluster.restart_coordinator()
    assert c.abort_expired() == []
    cluster.clock.advance(1_001)
    assert c.abort_expired() == ["job"]


# --------------------------------------------- 7. timeouts capped, transactional ids expire
def test_a_transaction_timeout_over_the_maximum_is_refused(cluster):
    with pytest.raises(InvalidMessageError, match="max_txn_timeout_ms"):
        cluster.coordinator.init_producer("job", 900_001)
    assert cluster.coordinator.init_producer("job", 900_000)
    with pytest.raises(ConfigError, match="max_txn_timeout_ms"):
        ClusterConfig(kafka_txn_timeout_ms=1_000_000)


def test_idle_transactional_ids_expire_and_an_open_one_never_does(tmp_path):
    c = Cluster(tmp_path)
    try:
        c.cfg["transactional_id_expiration_ms"] = 60_000
        coordinator = c.restart_coordinator()
        for i in range(5):
            coordinator.init_producer(f"idle-{i}")
        pid, epoch = coordinator.init_producer("busy", 500_000)
        write(c, "busy", pid, epoch, 1, 0, b"a")
        c.clock.advance(60_001)
        assert sorted(coordinator.expire_ids()) == [f"idle-{i}" for i in range(5)]
        assert [t["transactional_id"] for t in coordinator.list_transactions()] == ["busy"]
        coordinator = c.restart_coordinator()  # the log says so too
        assert [t["transactional_id"] for t in coordinator.list_transactions()] == ["busy"]
        new_pid, new_epoch = coordinator.init_producer("idle-0")  # starts again
        assert new_epoch == 0
    finally:
        c.close()


# ------------------------------------------- 7. logs of state compacted: snapshot + tail
def test_the_coordinator_log_is_compacted_and_a_restart_reads_only_the_tail(tmp_path):
    c = Cluster(tmp_path)
    try:
        c.cfg["state_log_compact_records"] = 200
        coordinator = c.restart_coordinator()
        seq = {}
        for k in range(300):  # 3 ids, 3 log records a transaction: ~900 records
            tid = f"job-{k % 3}"
            if tid not in seq:
                seq[tid] = coordinator.init_producer(tid)
            pid, epoch = seq[tid]
            write(c, tid, pid, epoch, 1, k % 2, b"%d" % k)
            seq[tid] = coordinator.end_transaction(tid, pid, epoch,
                                                   "ABORT" if k % 5 == 0 else "COMMIT")
            if k % 100 == 99:
                assert coordinator.log.compact()
        pid, epoch = coordinator.init_producer("open")
        write(c, "open", pid, epoch, 1, 0, b"open")
        before = coordinator.list_transactions()
        coordinator = c.restart_coordinator()
        assert coordinator.ping()["replayed_on_start"] < 200  # the tail, not ~900 records
        assert coordinator.list_transactions() == before
        assert coordinator.end_transaction("open", pid, epoch, "COMMIT") == (pid, epoch + 1)
        assert coordinator.init_producer("new")[0] not in {p for p, _e in seq.values()}
        # a damaged snapshot: reported, and the previous one read instead, with the log
        # after it (issue 35: the log before the previous snapshot is given back)
        with open(os.path.join(coordinator.directory, "txn-log.snapshot"), "r+b") as f:
            f.seek(40)
            f.write(b"\x00garbage")
        after = coordinator.list_transactions()
        coordinator = c.restart_coordinator()
        assert 200 < coordinator.ping()["replayed_on_start"] < 900
        assert coordinator.list_transactions() == after
    finally:
        c.close()


def test_the_shard_index_is_compacted_and_a_restart_reads_only_the_tail(tmp_path):
    cfg = {"data_dir": str(tmp_path), "num_shards": 1, "state_log_compact_records": 100}

    def start():
        sh = BrokerShard(0, cfg, background=False)
        sh.set_routes([("t", 0), ("t", 1), ("src", 0)])
        return sh
    sh = start()
    sh.send(RecordBatch("src", 0, [b"in"] * 1000))
    for k in range(200):  # two producers, aborts among the commits, offsets with some
        pid = 1 + k % 2
        sh.ktx_register(pid, k // 2, [("t", k % 2)], ["g"] if k % 3 == 0 else [])
        tx_write(sh, pid, k // 2, 1, [b"%d" % k], qid=k % 2)
        if k % 3 == 0:
            sh.ktx_offsets(pid, k // 2, "g", {("src", 0): k})
        sh.ktx_end(pid, k // 2 + 1, "ABORT" if k % 4 == 1 else "COMMIT")
        if k % 50 == 49:
            assert sh.ktx.compact()
    sh.ktx_register(7, 0, [("t", 0)], ["h"])  # open across the restart, with offsets
    tx_write(sh, 7, 0, 1, [b"open"])
    sh.ktx_offsets(7, 0, "h", {("src", 0): 500})
    want = [read(sh, qid=q)[0] for q in (0, 1)]
    assert sh.get_offsets("g", [("src", 0)]) == {("src", 0): 198}
    sh.close()
    sh = start()
    try:
        assert sh.ktx.replayed < 100
        assert [read(sh, qid=q)[0] for q in (0, 1)] == want
        assert read(sh)[1] < read(sh, isolation="read_uncommitted")[1]  # LSO held: open
        assert sh.ktx_end(7, 1, "COMMIT") == {"markers": 1}
        assert read(sh)[0] == want[0] + [b"open"]
        assert sh.get_offsets("h", [("src", 0)]) == {("src", 0): 500}
        with pytest.raises(ProducerFencedError):  # fences survive the snapshot
            sh.ktx_register(1, 0, [("t", 0)])
        applied = [k for k in sh.store.offsets.snapshot() if k.startswith("ktx-applied@")]
        assert len(applied) <= 2  # passed ones are dropped with each snapshot
    finally:
        sh.close()


# ------------------------------------------------------------- the long run (proof)
@pytest.mark.slow
def test_one_transactional_id_commits_forty_thousand_transactions_past_the_epoch_limit(
        tmp_path):
    """40,000 transactions of one id (the epoch rolls over to a new producer id past
    32,766), the log and index compacted along the way: a read_committed reader sees every
    one in order, and a fresh transaction after them commits and is visible."""
    c = Cluster(tmp_path, flush_mode="async", state_log_compact_records=5_000)
    try:
        co = c.coordinator
        pid, epoch = co.init_producer("long")
        pids = {pid}
        n = 40_000
        for k in range(n):
            co.add_to_transaction("long", pid, epoch, [(0, "t", 0)])
            c.shards[0].ktx_send(RecordBatch("t", 0, [b"%d" % k]), pid, epoch, 1)
            pid, epoch = co.end_transaction("long", pid, epoch, "COMMIT")
            pids.add(pid)
            if k % 5_000 == 4_999:
                co.log.compact()
                c.shards[0].ktx.compact()
        assert len(pids) == 2 and epoch == n - MAX_EPOCH  # rolled over once, after 32,767
        got, offset = [], 0
        while True:
            [(_t, _q, batch, nxt, end)] = c.shards[0].pull([("t", 0, offset, 20_000)], 0,
                                                           None, None, "read_committed")
            got += [m.body for m in batch.messages()]
            if nxt >= end:
                break
            offset = nxt
        assert got == [b"%d" % k for k in range(n)]
        co = c.restart_coordinator()
        assert co.ping()["replayed_on_start"] <= 5_000 * 3
        write(c, "long", pid, epoch, 1, 1, b"fresh")
        assert co.end_transaction("long", pid, epoch, "COMMIT") == (pid, epoch + 1)
        assert c.read(1) == [b"fresh"]
        ids = [p for p in c.shards[0].store.producer_ids() if p >= KTX_STORE_PID_BASE]
        assert len(ids) == 2  # one entry a producer id, not one a transaction
    finally:
        c.close()


def test_per_key_locks_live_only_while_in_use():
    from raymq.actors.kafka_tx.shard_side import KeyedLocks
    locks = KeyedLocks()
    for pid in range(1000):  # a key a producer id, a transactional id: each once
        with locks.of(pid):
            assert len(locks) == 1
    assert len(locks) == 0
    import threading
    order = []
    with locks.of("k"):
        t = threading.Thread(target=lambda: (locks.of("k").__enter__(), order.append("b")))
        t.start()
        t.join(0.2)
        assert order == [] and len(locks) == 1  # the second waits on the same lock
        order.append("a")
    t.join(5)
    assert order == ["a", "b"]


def test_producer_ids_are_drawn_only_when_handed_out(cluster):
    """A coordinator's producer-id counter is finite: a restart of the same producer (a
    new epoch) draws none."""
    c = cluster.coordinator
    first, _ = c.init_producer("a")
    for _ in range(100):
        assert c.init_producer("a")[0] == first
    second, _ = c.init_producer("b")
    assert second >> 8 == (first >> 8) + 1
    c = cluster.restart_coordinator()
    assert c.init_producer("c")[0] >> 8 == (first >> 8) + 2  # never one handed out twice


def test_a_snapshot_never_passes_an_end_whose_offsets_are_not_saved(tmp_path):
    """Compaction folds the index up to the first end still applying its offsets: a crash
    then replays that end and applies them (the snapshot alone would skip it)."""
    import threading
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1,
                         "state_log_compact_records": 1}, background=False)
    sh.set_routes([("t", 0), ("src", 0)])
    try:
        sh.send(RecordBatch("src", 0, [b"in"] * 8))
        sh.ktx_register(1, 0, [("t", 0)], ["g"])
        tx_write(sh, 1, 0, 1, [b"out"])
        sh.ktx_offsets(1, 0, "g", {("src", 0): 5})
        save, held, go = sh.store.save_offsets, threading.Event(), threading.Event()

        def paused(values, **kw):  # the end's offsets wait here, its markers written
            if any(k.startswith("g@") for k in values):
                held.set()
                go.wait(30)
            save(values, **kw)
        sh.store.save_offsets = paused
        ender = threading.Thread(target=sh.ktx_end, args=(1, 1, "COMMIT"))
        ender.start()
        assert held.wait(30)
        end_record = sh.store.max_queue_offset("RMQ_SYS_KTX_INDEX", 0) - 1
        sh.ktx.compact()
        assert sh.ktx._snapshot_offset <= end_record  # not past the end still applying
        go.set()
        ender.join(30)
        assert sh.ktx.compact() and sh.ktx._snapshot_offset > end_record  # now it may
        assert sh.get_offsets("g", [("src", 0)]) == {("src", 0): 5}
    finally:
        sh.close()


def test_the_coordinator_log_gives_its_segments_back_and_falls_back_on_its_last_snapshot(
        tmp_path):
    """Compactions delete the log's segments before the previous snapshot's end (issue 35:
    a coordinator's disk follows the ids in use); a damaged snapshot falls back on the
    previous one and the records after it: nothing is forgotten."""
    from raymq.actors.kafka_tx.log import TxnLog
    from raymq.actors.kafka_tx.state import TxnMetadata, TxnState
    from raymq.storage.clock import ManualClock
    cfg = ClusterConfig.from_dict({"data_dir": str(tmp_path), "num_shards": 1,
                                   "segment_size_bytes": 9 << 20})
    directory = str(tmp_path / "coordinator-0")
    clock = ManualClock(1_000_000)
    queues = frozenset((0, f"topic-{i:04d}", 0) for i in range(400))  # ~8 KiB a record
    tl = TxnLog(directory, cfg.store_config(), clock, compact_records=300, background=False)
    tl.load()
    expected = {}
    for k in range(3000):
        meta = TxnMetadata(f"job-{k % 7}", (k % 7 + 1) << 8, k // 7, 60_000, TxnState.ONGOING,
                           queues, start_ms=1, update_ms=k)
        tl.append(meta, wait=k % 100 == 99)
        expected[meta.transactional_id] = meta
        if k % 300 == 299:
            assert tl.compact()
    # (~23 MiB logged: all but the segment written to and at most one before it go)
    assert tl.store.min_phys_offset > 9 << 20
    assert tl.store.max_phys_offset - tl.store.min_phys_offset < 2 * (9 << 20)
    tl.close()
    tl = TxnLog(directory, cfg.store_config(), clock, compact_records=300, background=False)
    assert tl.load() == (expected, 7)
    tl.close()
    with open(os.path.join(directory, "txn-log.snapshot"), "r+b") as f:
        f.seek(40)
        f.write(b"\x00garbage")
    tl = TxnLog(directory, cfg.store_config(), clock, compact_records=300, background=False)
    try:
        assert tl.load() == (expected, 7)     # the previous snapshot and the log after it
        assert 300 <= tl.replayed < 700
    finally:
        tl.close()
