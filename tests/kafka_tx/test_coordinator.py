"""The TransactionCoordinator over in-process shards (issue 13): two-phase commit, fencing,
restarts in PREPARE_COMMIT and before it, timeouts, operators' abort.  No Ray: the
coordinator's shard calls go straight to ``BrokerShard`` objects (or fail, to play a
shard that is down)."""
from __future__ import annotations

import pytest

from raymq.actors.kafka_tx.coordinator import TransactionCoordinator
from raymq.actors.shard import BrokerShard
from raymq.storage import RecordBatch
from raymq.storage.clock import ManualClock
from raymq.storage.errors import (BrokerUnavailableError, InvalidTxnStateError,
                                  ProducerFencedError, TransactionAbortedError)

ROUTES = [("t", 0), ("t", 1), ("src", 0)]


class Cluster:
    """Two in-process shards and a coordinator calling them (``down``: shards that fail)."""

    def __init__(self, tmp_path, clock=None, **config):
        self.cfg = {"data_dir": str(tmp_path), "num_shards": 2, "kafka_txn_timeout_ms": 10_000,
                    **config}
        self.clock = clock or ManualClock(1_000_000)
        self.shards = []
        for i in range(2):
            sh = BrokerShard(i, self.cfg, background=False)
            sh.set_routes(ROUTES)
            self.shards.append(sh)
        self.down: set[int] = set()
        self.coordinator = self.start()

    def call_shard(self, shard, method, *args):
        if shard in self.down:
            raise BrokerUnavailableError(f"shard-{shard} is down")
        return getattr(self.shards[shard], method)(*args)

    def start(self):
        return TransactionCoordinator(0, self.cfg, call_shard=self.call_shard, clock=self.clock,
                                      background=False)

    def restart_coordinator(self):
        self.coordinator.close()
        self.coordinator = self.start()
        self.coordinator.complete_prepared()  # what its background loop does first
        return self.coordinator

    def read(self, shard, topic="t", qid=0, isolation="read_committed"):
        [(_t, _q, batch, _n, _e)] = self.shards[shard].pull([(topic, qid, 0, 100)], 0, None,
                                                            None, isolation)
        return [m.body for m in batch.messages()]

    def close(self):
        self.coordinator.close()
        for sh in self.shards:
            sh.close()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def write(cluster, tid, pid, epoch, seq, shard, body, qid=0):
    cluster.coordinator.add_to_transaction(tid, pid, epoch, [(shard, "t", qid)])
    cluster.shards[shard].ktx_send(RecordBatch("t", qid, [body]), pid, epoch, seq)


def test_a_commit_over_two_shards_is_visible_on_both_and_bumps_the_epoch(cluster):
    pid, epoch = cluster.coordinator.init_producer("job")
    write(cluster, "job", pid, epoch, 1, 0, b"a")
    write(cluster, "job", pid, epoch, 1, 1, b"b")
    assert cluster.read(0) == [] and cluster.read(1) == []  # open: held back
    assert cluster.coordinator.end_transaction("job", pid, epoch, "COMMIT") == (pid, epoch + 1)
    assert cluster.read(0) == [b"a"] and cluster.read(1) == [b"b"]
    # a retry of the same commit answers the same; a late write of it is fenced
    assert cluster.coordinator.end_transaction("job", pid, epoch, "COMMIT") == (pid, epoch + 1)
    with pytest.raises(ProducerFencedError):
        cluster.shards[0].ktx_send(RecordBatch("t", 0, [b"late"]), pid, epoch, 2)
    described = cluster.coordinator.describe_transaction("job")
    assert (described["state"], described["epoch"]) == ("COMPLETE_COMMIT", epoch + 1)


def test_a_second_instance_fences_the_first_and_aborts_its_transaction(cluster):
    pid, epoch = cluster.coordinator.init_producer("job")
    write(cluster, "job", pid, epoch, 1, 0, b"zombie")
    pid2, epoch2 = cluster.coordinator.init_producer("job")
    assert pid2 == pid and epoch2 > epoch
    assert cluster.read(0, isolation="read_uncommitted") == [b"zombie"]
    assert cluster.read(0) == []  # aborted, markers written
    with pytest.raises(ProducerFencedError):
        cluster.coordinator.end_transaction("job", pid, epoch, "COMMIT")
    with pytest.raises(ProducerFencedError):
        cluster.coordinator.add_to_transaction("job", pid, epoch, [(0, "t", 0)])
    with pytest.raises(ProducerFencedError):
        cluster.shards[0].ktx_send(RecordBatch("t", 0, [b"zombie-2"]), pid, epoch, 2)
    write(cluster, "job", pid2, epoch2, 1, 0, b"new")
    cluster.coordinator.end_transaction("job", pid2, epoch2, "COMMIT")
    assert cluster.read(0) == [b"new"]


def test_an_add_asked_again_after_its_shard_failed_registers_it_there(cluster):
    """A queue logged in the transaction whose shard did not take the registration: the
    producer's retry (its answer was an error) registers it, so its write is taken."""
    pid, epoch = cluster.coordinator.init_producer("job")
    cluster.down = {1}
    with pytest.raises(BrokerUnavailableError):
        cluster.coordinator.add_to_transaction("job", pid, epoch, [(1, "t", 0)])
    assert cluster.coordinator.describe_transaction("job")["queues"] == [[1, "t", 0]]
    cluster.down = set()
    cluster.coordinator.add_to_transaction("job", pid, epoch, [(1, "t", 0)])
    cluster.shards[1].ktx_send(RecordBatch("t", 0, [b"b"]), pid, epoch, 1)
    cluster.coordinator.end_transaction("job", pid, epoch, "COMMIT")
    assert cluster.read(1) == [b"b"]


def test_a_coordinator_restarted_in_prepare_commit_commits_everywhere(cluster):
    pid, epoch = cluster.coordinator.init_producer("job")
    write(cluster, "job", pid, epoch, 1, 0, b"a")
    write(cluster, "job", pid, epoch, 1, 1, b"b")
    cluster.down = {1}  # shard-1 cannot take its marker: the commit stops half-way
    with pytest.raises(BrokerUnavailableError):
        cluster.coordinator.end_transaction("job", pid, epoch, "COMMIT")
    assert cluster.coordinator.describe_transaction("job")["state"] == "PREPARE_COMMIT"
    assert cluster.read(0) == [b"a"] and cluster.read(1) == []  # past the point of no return
    cluster.down = set()
    c = cluster.restart_coordinator()
    assert c.completed_on_start == 1
    assert cluster.read(0) == [b"a"] and cluster.read(1) == [b"b"]
    assert c.describe_transaction("job")["state"] == "COMPLETE_COMMIT"


def test_a_coordinator_restarted_before_prepare_leaves_it_open_then_aborts_it_on_timeout(
        cluster):
    pid, epoch = cluster.coordinator.init_producer("job", 5_000)
    write(cluster, "job", pid, epoch, 1, 0, b"a")
    c = cluster.restart_coordinator()
    assert c.describe_transaction("job")["state"] == "ONGOING"
    assert c.abort_expired() == []
    cluster.clock.advance(5_001)
    assert c.abort_expired() == ["job"]
    assert cluster.read(0) == [] and cluster.read(0, isolation="read_uncommitted") == [b"a"]
    assert cluster.shards[0].ktx_status() == []  # nothing holds the LSO any more
    with pytest.raises(TransactionAbortedError):  # the producer learns it at its commit
        c.end_transaction("job", pid, epoch, "COMMIT")


def test_an_operator_aborts_an_open_transaction(cluster):
    pid, epoch = cluster.coordinator.init_producer("job")
    write(cluster, "job", pid, epoch, 1, 1, b"stuck")
    assert [h["producer_id"] for h in cluster.shards[1].ktx_status()] == [pid]
    assert cluster.coordinator.abort_transaction("job") == "COMPLETE_ABORT"
    assert cluster.shards[1].ktx_status() == [] and cluster.read(1) == []
    with pytest.raises(InvalidTxnStateError):
        cluster.coordinator.abort_transaction("nobody")


def test_offsets_in_a_transaction_commit_with_it(cluster):
    cluster.shards[0].send(RecordBatch("src", 0, [b"in-%d" % i for i in range(4)]))
    pid, epoch = cluster.coordinator.init_producer("job")
    write(cluster, "job", pid, epoch, 1, 1, b"out")
    cluster.coordinator.add_to_transaction("job", pid, epoch, [], [(0, "job")])
    cluster.shards[0].ktx_offsets(pid, epoch, "job", {("src", 0): 4})
    assert cluster.shards[0].get_offsets("job", [("src", 0)]) == {("src", 0): -1}
    cluster.coordinator.end_transaction("job", pid, epoch, "COMMIT")
    assert cluster.shards[0].get_offsets("job", [("src", 0)]) == {("src", 0): 4}
    assert cluster.read(1) == [b"out"]
