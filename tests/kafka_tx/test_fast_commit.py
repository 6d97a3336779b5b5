"""Kafka-style commits with fewer durable writes (issue 27, ``raymq.actors.kafka_tx.fast_commit``):
a transaction's writes answered once written, one shard committing in one phase with
one fsync, the coordinator's in-doubt transactions settled by asking the shard.  No Ray:
the coordinator over in-process shards (``tests.kafka_tx.test_coordinator.Cluster``); a power
cut is the durable image of what was fsynced (``FsyncRecorder``), a coordinator crash a
real process death at a crash point in a child."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest

from raymq.actors.shard import BrokerShard
from raymq.storage import RecordBatch
from raymq.storage.errors import (BrokerUnavailableError, InvalidTxnStateError,
                                  TransactionAbortedError)
from tests.kafka_tx.test_coordinator import ROUTES, Cluster, cluster  # noqa: F401 (a fixture)
from tests.storage.test_storage_powerloss import FsyncRecorder
from tests.helpers import ROOT



def lazy_write(cluster, tid, pid, epoch, seq, shard, body, qid=0, durable=False):
    cluster.coordinator.add_to_transaction(tid, pid, epoch, [(shard, "t", qid)])
    reply = cluster.shards[shard].ktx_send(RecordBatch("t", qid, [body]), pid, epoch, seq, 0,
                                           durable)
    assert reply.status == "SEND_OK"


def power_cut(cluster, rec: FsyncRecorder, tmp_path) -> None:
    """Shard-0's machine loses power: it restarts from what was fsynced."""
    image = tmp_path / "after-power-cut"
    rec.write_image(str(image), "drop", random.Random(1))
    cluster.shards[0].close()
    cluster.shards[0] = BrokerShard(0, {**cluster.cfg, "data_dir": str(tmp_path / "x")},
                                    directory=str(image), background=False)
    cluster.shards[0].set_routes(ROUTES)


def fsyncs_of(monkeypatch, part: str) -> list:
    """Paths of the fsyncs of files whose path holds ``part``, from now on."""
    seen, real = [], os.fsync

    def fsync(fd):
        real(fd)
        path = os.readlink(f"/proc/self/fd/{fd}")
        if part in path:
            seen.append(path)
    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_one_shard_commits_in_one_phase_its_writes_made_durable_by_the_marker_s_fsync(
        cluster, monkeypatch):
    c = cluster.coordinator
    pid, epoch = c.init_producer("job")
    shard_log = fsyncs_of(monkeypatch, os.path.join("shard-0", "commitlog"))
    lazy_write(cluster, "job", pid, epoch, 1, 0, b"a")
    lazy_write(cluster, "job", pid, epoch, 2, 0, b"b", qid=1)
    assert shard_log == []  # answered once written
    coordinator_log = fsyncs_of(monkeypatch, "coordinator-0")
    assert c.end_transaction("job", pid, epoch, "COMMIT", {0: 2}, [0]) == (pid, epoch + 1)
    assert len(shard_log) == 1  # the markers' fsync, covering the writes before them
    assert coordinator_log == []  # no PREPARE logged and fsynced before the markers
    assert cluster.read(0) == [b"a"] and cluster.read(0, qid=1) == [b"b"]
    assert c.describe_transaction("job")["state"] == "COMPLETE_COMMIT"
    # a retry answers the same; an abort of it now is refused as before
    assert c.end_transaction("job", pid, epoch, "COMMIT", {0: 2}, [0]) == (pid, epoch + 1)
    with pytest.raises(InvalidTxnStateError, match="committed"):
        c.end_transaction("job", pid, epoch, "ABORT")


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """A cluster whose shard-0 files are followed by an ``FsyncRecorder`` (for
    ``power_cut``)."""
    rec = FsyncRecorder(str(tmp_path / "shard-0"))
    rec.install(monkeypatch)
    cluster = Cluster(tmp_path)
    yield cluster, rec
    cluster.close()


def test_writes_a_power_cut_lost_abort_the_commit_instead_of_committing_part_of_it(
        tmp_path, recorded):
    cluster, rec = recorded
    c = cluster.coordinator
    pid, epoch = c.init_producer("job")
    lazy_write(cluster, "job", pid, epoch, 1, 0, b"kept", durable=True)  # (fsynced)
    lazy_write(cluster, "job", pid, epoch, 2, 0, b"lost")  # answered, never fsynced
    power_cut(cluster, rec, tmp_path)
    with pytest.raises(TransactionAbortedError, match="lost writes"):
        c.end_transaction("job", pid, epoch, "COMMIT", {0: 2}, [0])
    assert c.describe_transaction("job")["state"] == "COMPLETE_ABORT"
    assert cluster.read(0) == []  # nothing of it: not the write that survived either
    assert cluster.read(0, isolation="read_uncommitted") == [b"kept"]
    assert cluster.shards[0].ktx_status() == []  # its LSO is not held
    pid, epoch = c.describe_transaction("job")["producer_id"], epoch + 1
    lazy_write(cluster, "job", pid, epoch, 1, 0, b"next")  # the next one commits
    c.end_transaction("job", pid, epoch, "COMMIT", {0: 1}, [0])
    assert cluster.read(0) == [b"next"]


def test_a_power_cut_that_lost_the_whole_transaction_on_its_shard_aborts_it(
        tmp_path, recorded):
    """The registration too was written lazily (covered by the first durable write, which
    never came): the shard knows nothing of the transaction; the commit aborts it."""
    cluster, rec = recorded
    c = cluster.coordinator
    pid, epoch = c.init_producer("job")
    lazy_write(cluster, "job", pid, epoch, 1, 0, b"lost")
    power_cut(cluster, rec, tmp_path)
    with pytest.raises(TransactionAbortedError):
        c.end_transaction("job", pid, epoch, "COMMIT", {0: 1}, [0])
    assert c.describe_transaction("job")["state"] == "COMPLETE_ABORT"
    assert cluster.read(0, isolation="read_uncommitted") == []
    lazy_write(cluster, "job", pid, epoch + 1, 1, 0, b"next")  # and the id goes on
    c.end_transaction("job", pid, epoch + 1, "COMMIT", {0: 1}, [0])
    assert cluster.read(0) == [b"next"]


def test_two_shards_verify_the_lazily_written_one_before_prepare(tmp_path, recorded):
    cluster, rec = recorded
    c = cluster.coordinator
    pid, epoch = c.init_producer("job")
    lazy_write(cluster, "job", pid, epoch, 1, 0, b"lost")  # one shard so far: lazy
    lazy_write(cluster, "job", pid, epoch, 1, 1, b"other", durable=True)
    power_cut(cluster, rec, tmp_path)
    with pytest.raises(TransactionAbortedError):
        c.end_transaction("job", pid, epoch, "COMMIT", {0: 1, 1: 1}, [0])
    assert c.describe_transaction("job")["state"] == "COMPLETE_ABORT"
    assert cluster.read(1) == [] and cluster.read(0) == []
    assert cluster.shards[1].ktx_status() == []


def test_an_in_doubt_transaction_is_never_aborted_blindly_while_its_shard_is_down(cluster):
    c = cluster.coordinator
    pid, epoch = c.init_producer("job", 5_000)
    lazy_write(cluster, "job", pid, epoch, 1, 0, b"a")
    cluster.down = {0}
    with pytest.raises(BrokerUnavailableError):  # the reply is lost: did it commit there?
        c.end_transaction("job", pid, epoch, "COMMIT", {0: 1}, [0])
    cluster.clock.advance(5_001)
    assert c.abort_expired() == []  # not aborted while its shard cannot say
    assert c.describe_transaction("job")["state"] == "ONGOING"
    cluster.down = set()
    assert c.abort_expired() == ["job"]  # asked: it had not committed, so aborted
    assert c.describe_transaction("job")["state"] == "COMPLETE_ABORT"
    assert cluster.read(0) == [] and cluster.shards[0].ktx_status() == []


CHILD = textwrap.dedent("""
    import sys
    from raymq.actors.faults import faults_named
    from raymq.storage import RecordBatch
    from tests.kafka_tx.test_coordinator import Cluster
    import pathlib
    cluster = Cluster(pathlib.Path(sys.argv[1]))
    c = cluster.coordinator
    pid, epoch = c.init_producer("job", 5_000)
    c.add_to_transaction("job", pid, epoch, [(0, "t", 0)])
    cluster.shards[0].ktx_send(RecordBatch("t", 0, [b"in-doubt"]), pid, epoch, 1, 0, False)
    print("pid", pid, epoch, flush=True)
    faults_named("crash_at:coordinator.one_phase_decided")
    c.end_transaction("job", pid, epoch, "COMMIT", {0: 1}, [0])
""")


@pytest.mark.parametrize("then", ["retried commit", "timeout", "new instance", "operator"])
def test_a_coordinator_killed_after_the_shard_committed_keeps_it_committed(tmp_path, then):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 86 and "coordinator.one_phase_decided" in out.stderr, out.stderr
    pid, epoch = map(int, out.stdout.split()[1:3])
    cluster = Cluster(tmp_path)  # restarted: the coordinator's log says ONGOING
    try:
        c = cluster.coordinator
        assert c.describe_transaction("job")["state"] == "ONGOING"
        if then == "retried commit":
            assert c.end_transaction("job", pid, epoch, "COMMIT", {0: 1}, [0]) == \
                (pid, epoch + 1)
        elif then == "timeout":
            cluster.clock.advance(5_001)
            assert c.abort_expired() == []  # it committed: not aborted
        elif then == "new instance":
            assert c.init_producer("job", 5_000) == (pid, epoch + 2)
        else:
            assert c.abort_transaction("job") == "COMPLETE_COMMIT"
        assert c.describe_transaction("job")["state"] in ("COMPLETE_COMMIT", "EMPTY")
        assert cluster.read(0) == [b"in-doubt"]  # visible, once
        assert cluster.shards[0].ktx_status() == []
        if then == "retried commit":  # and the producer goes on
            cluster.coordinator.add_to_transaction("job", pid, epoch + 1, [(0, "t", 0)])
            cluster.shards[0].ktx_send(RecordBatch("t", 0, [b"next"]), pid, epoch + 1, 1)
            c.end_transaction("job", pid, epoch + 1, "COMMIT")
            assert cluster.read(0) == [b"in-doubt", b"next"]
    finally:
        cluster.close()
