"""A Kafka-style transaction of one request (issue 37, ``FastCommit.commit_batch``): its
writes and their COMMIT markers in one put on its one shard, never open there; resends,
fencing, and processes killed between the shard's put and the coordinator's log.  No
Ray: the coordinator over in-process shards (``tests.kafka_tx.test_coordinator.Cluster``);
a kill is a real process death at a crash point in a child."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from raymq.actors.shard import BrokerShard
from raymq.storage import RecordBatch
from raymq.storage.errors import (BrokerUnavailableError, InvalidTxnStateError,
                                  ProducerFencedError)
from tests.helpers import ROOT, wait_for
from tests.kafka_tx.test_coordinator import ROUTES, Cluster, cluster  # noqa: F401 (a fixture)
from tests.kafka_tx.test_fast_commit import fsyncs_of, lazy_write


def batch(*bodies: bytes, qids=None) -> RecordBatch:
    return RecordBatch("t", qids if qids is not None else 0, list(bodies))


def restart_shard(cluster, i: int = 0) -> None:
    cluster.shards[i].close()
    cluster.shards[i] = BrokerShard(i, cluster.cfg, background=False)
    cluster.shards[i].set_routes(ROUTES)


def test_a_transaction_of_one_request_is_one_put_and_one_fsync_and_never_open(
        cluster, monkeypatch):
    c = cluster.coordinator
    pid, epoch = c.init_producer("job")
    shard_log = fsyncs_of(monkeypatch, os.path.join("shard-0", "commitlog"))
    coordinator_log = fsyncs_of(monkeypatch, "coordinator-0")
    seen_open = []
    real_put = cluster.shards[0].store.put

    def put(b, **kw):  # what a reader would see of it just before the put
        seen_open.append(cluster.shards[0].ktx_status())
        return real_put(b, **kw)
    monkeypatch.setattr(cluster.shards[0].store, "put", put)
    new_pid, new_epoch, reply = c.commit_batch("job", pid, epoch, 0,
                                               batch(b"a", b"b", qids=[0, 1]), 1)
    assert (new_pid, new_epoch) == (pid, epoch + 1)
    assert reply.status == "SEND_OK" and reply.queue_offsets == [0, 0] and not reply.duplicate
    assert seen_open == [[]]  # one put, with nothing open before it
    assert len(shard_log) == 1 and coordinator_log == []  # its one fsync; no log waited for
    assert cluster.read(0) == [b"a"] and cluster.read(0, qid=1) == [b"b"]
    assert cluster.read(0, isolation="read_uncommitted") == [b"a"]  # (the marker skipped)
    assert cluster.shards[0].ktx_status() == []
    assert c.describe_transaction("job")["state"] == "COMPLETE_COMMIT"
    # a resend (its answer lost) is answered from the log: nothing written again
    assert c.commit_batch("job", pid, epoch, 0, batch(b"a", b"b", qids=[0, 1]), 1) == \
        (pid, epoch + 1, None)
    # the next transaction goes on at the next epoch, either way
    assert c.commit_batch("job", pid, epoch + 1, 0, batch(b"c"), 1)[:2] == (pid, epoch + 2)
    lazy_write(cluster, "job", pid, epoch + 2, 1, 0, b"d")
    assert c.end_transaction("job", pid, epoch + 2, "COMMIT", {0: 1}, [0]) == (pid, epoch + 3)
    assert cluster.read(0) == [b"a", b"c", b"d"]
    restart_shard(cluster)  # the index says it all again after a restart
    assert cluster.read(0) == [b"a", b"c", b"d"] and cluster.read(0, qid=1) == [b"b"]
    assert cluster.read(0, isolation="read_uncommitted") == [b"a", b"c", b"d"]


def test_a_fenced_instance_and_an_open_transaction_cannot_commit_in_one_request(cluster):
    c = cluster.coordinator
    pid, epoch = c.init_producer("job")
    lazy_write(cluster, "job", pid, epoch, 1, 0, b"open")
    with pytest.raises(InvalidTxnStateError, match="not a transaction of one request"):
        c.commit_batch("job", pid, epoch, 1, batch(b"x"), 1)
    # the shard refuses it too (a coordinator's call that raced an add)
    with pytest.raises(InvalidTxnStateError, match="is open here"):
        cluster.shards[0].ktx_commit_batch(batch(b"x"), pid, epoch, 2)
    new_pid, new_epoch = c.init_producer("job")  # a new instance: the open one aborted
    assert new_pid == pid and new_epoch > epoch
    with pytest.raises(ProducerFencedError):  # the old instance, at its old epoch
        c.commit_batch("job", pid, epoch, 0, batch(b"zombie"), 1)
    with pytest.raises(ProducerFencedError):  # straight to the shard, past its coordinator
        cluster.shards[0].ktx_commit_batch(batch(b"zombie"), pid, epoch, 1)
    assert cluster.read(0) == [] and cluster.read(0, isolation="read_uncommitted") == [b"open"]


CHILD = textwrap.dedent("""
    import pathlib, sys
    from raymq.actors.faults import faults_named
    from raymq.storage import RecordBatch
    from tests.kafka_tx.test_coordinator import Cluster
    cluster = Cluster(pathlib.Path(sys.argv[1]))
    c = cluster.coordinator
    pid, epoch = c.init_producer("job", 5_000)
    print("pid", pid, epoch, flush=True)
    faults_named("crash_at:" + sys.argv[2])
    c.commit_batch("job", pid, epoch, 0, RecordBatch("t", [0, 1], [b"a", b"b"]), 1)
""")


@pytest.mark.parametrize("point", ["ktx.batch_committed", "coordinator.batch_committed"])
@pytest.mark.parametrize("then", ["resend", "new instance"])
def test_killed_between_the_shard_s_put_and_the_coordinator_s_log_it_stays_committed_once(
        tmp_path, point, then):
    """Killed after the put (the shard's state not told, or the coordinator's log not
    written): the restart finds it committed on the shard, in the index, and either the
    resend or a new instance goes on from there."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), point], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 86 and point in out.stderr, out.stderr
    pid, epoch = map(int, out.stdout.split()[1:3])
    cluster = Cluster(tmp_path)
    try:
        c = cluster.coordinator
        assert c.describe_transaction("job")["epoch"] == epoch  # it logged nothing of it
        assert cluster.read(0) == [b"a"] and cluster.read(0, qid=1) == [b"b"]
        assert cluster.shards[0].ktx_status() == []  # never open: holds no LSO
        if then == "resend":
            got = c.commit_batch("job", pid, epoch, 0, RecordBatch("t", [0, 1], [b"a", b"b"]), 1)
            assert got[:2] == (pid, epoch + 1) and got[2].duplicate
            nxt = epoch + 1
        else:
            # above the epoch the shard moved on to (the killed instance might have been
            # answered it): epoch + 2
            assert c.init_producer("job", 5_000) == (pid, epoch + 2)
            nxt = epoch + 2
            with pytest.raises(ProducerFencedError):  # the killed instance's resend
                cluster.shards[0].ktx_commit_batch(batch(b"late"), pid, epoch, 2)
        assert c.commit_batch("job", pid, nxt, 0, batch(b"c"), 1)[:2] == (pid, nxt + 1)
        assert cluster.read(0) == [b"a", b"c"] and cluster.read(0, qid=1) == [b"b"]
    finally:
        cluster.close()


def test_a_record_logged_soon_is_written_within_its_linger_before_any_later_one_and_at_close(
        tmp_path):
    """The coordinator logs a transaction of one request's COMPLETE_COMMIT soon
    (``append_soon``): its writer thread writes it within ``SOON_MS``, newest per id
    (a replay keeps the newest anyway), never after a record logged later, and never
    left out at close."""
    from raymq.actors.config import ClusterConfig
    from raymq.actors.kafka_tx.log import TXN_LOG_TOPIC, TxnLog
    from raymq.actors.kafka_tx.state import TxnMetadata, TxnState
    from raymq.storage.clock import ManualClock

    def meta(tid, epoch):
        return TxnMetadata(tid, 256, epoch, 1000, TxnState.COMPLETE_COMMIT, update_ms=1)

    def logged(log):
        return [(m.transactional_id, m.epoch) for m in (
            TxnMetadata.from_json(r.body) for r in log.store.scan_queue(TXN_LOG_TOPIC, 0, 0))]
    cfg = ClusterConfig.from_dict({"data_dir": str(tmp_path)}).store_config()
    log = TxnLog(str(tmp_path / "c"), cfg, ManualClock(), compact_records=1000,
                 background=False)  # (no writer thread: the test takes its steps)
    try:
        log.append_soon(meta("a", 1))
        assert logged(log) == []  # not on the caller's path
        log.append(meta("b", 1), wait=False)  # a later record: after it, in one put
        assert logged(log) == [("a", 1), ("b", 1)]
        log.append_soon(meta("a", 2))
        log.append_soon(meta("c", 1))
        log.append_soon(meta("a", 3))  # before the writer came: replaces a's epoch 2
        log.write_soon()  # the writer's step
        assert logged(log) == [("a", 1), ("b", 1), ("c", 1), ("a", 3)]
        log.write_soon()  # nothing waits: nothing written
        assert len(logged(log)) == 4
        log.append_soon(meta("a", 4))
    finally:
        log.close()  # (what waits is written before the store closes)
    log = TxnLog(str(tmp_path / "c"), cfg, ManualClock(), compact_records=1000,
                 background=False)
    assert logged(log)[-1] == ("a", 4)
    log.close()
    # with its writer thread: written with no further call
    log = TxnLog(str(tmp_path / "c"), cfg, ManualClock(), compact_records=1000)
    try:
        log.append_soon(meta("a", 5))
        log.append_soon(meta("d", 1))
        wait_for(lambda: len(logged(log)) == 7, 10,
                 "the writer thread writing what append_soon left")
        assert logged(log)[4:] == [("a", 4), ("a", 5), ("d", 1)]
    finally:
        log.close()


LOST_LOG = textwrap.dedent("""
    import os, pathlib, sys
    from raymq.storage import RecordBatch
    from tests.kafka_tx.test_coordinator import Cluster
    cluster = Cluster(pathlib.Path(sys.argv[1]))
    c = cluster.coordinator
    pid, epoch = c.init_producer("job", 5_000)
    for i in range(3):  # back to back: their COMPLETE_COMMITs wait for the log's writer
        pid, epoch, _ = c.commit_batch("job", pid, epoch, 0, RecordBatch("t", 0, [b"m%d" % i]),
                                       1)
    print("pid", pid, epoch, flush=True)
    os._exit(0)  # killed before the writer came: none of the three is logged
""")


def test_a_coordinator_that_lost_several_commits_of_one_request_gives_a_new_instance_an_epoch_the_shards_take(
        tmp_path):
    """Transactions of one request committed back to back, their COMPLETE_COMMITs lost with
    the coordinator (killed before its log's writer wrote them; or a power loss before the
    log's next fsync): the shard moved the producer's epoch on three times, the log not
    at all.  A new instance must get an epoch above all of them -- one the shard takes,
    and which fences the instance before it -- not the logged epoch's next, which the
    shard refuses as fenced for good."""
    out = subprocess.run([sys.executable, "-c", LOST_LOG, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pid, epoch = map(int, out.stdout.split()[1:3])
    cluster = Cluster(tmp_path)
    try:
        c = cluster.coordinator
        assert c.describe_transaction("job")["epoch"] < epoch - 1  # several commits lost
        assert cluster.read(0) == [b"m0", b"m1", b"m2"]
        cluster.down = {1}  # a shard that cannot say what it saw: no epoch given (retriable)
        with pytest.raises(BrokerUnavailableError) as err:
            c.init_producer("job", 5_000)
        assert err.value.retriable
        cluster.down = set()
        new_pid, new_epoch = c.init_producer("job", 5_000)
        assert new_pid == pid and new_epoch > epoch  # above what the old instance holds
        got = c.commit_batch("job", new_pid, new_epoch, 0, batch(b"new"), 1)
        assert got[:2] == (pid, new_epoch + 1)
        with pytest.raises(ProducerFencedError):  # the old instance, at the epoch it holds
            c.commit_batch("job", pid, epoch, 0, batch(b"zombie"), 1)
        with pytest.raises(ProducerFencedError):  # straight to the shard, past the coordinator
            cluster.shards[0].ktx_commit_batch(batch(b"zombie"), pid, epoch, 1)
        assert cluster.read(0) == [b"m0", b"m1", b"m2", b"new"]
        assert c.init_producer("job", 5_000) == (pid, new_epoch + 2)  # asked once: known now
    finally:
        cluster.close()
