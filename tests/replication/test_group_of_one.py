"""A shard that is not replicated is a group of one (``replication_factor`` 1): its one
replica leads, with no follower to wait for, under the same rules as a bigger group; and
it takes the files a plain shard of an earlier release kept (``shard-<i>``)."""
from __future__ import annotations

from raymq.deploy import adopt_plain_directory
from raymq.tools.nemesis import TOPIC, Sim
from raymq.storage import RecordBatch
from tests.helpers import open_shard


def test_a_group_of_one_takes_a_plain_shard_s_files_and_leads_them(tmp_path):
    old = open_shard(tmp_path, [(TOPIC, 0)])  # (its files in <data_dir>/shard-0)
    for i in range(3):
        assert old.send(RecordBatch(TOPIC, 0, [b"m%d" % i]), 0, 0).status == "SEND_OK"
    old.close()
    assert adopt_plain_directory(str(tmp_path), "shard", 0)
    assert not adopt_plain_directory(str(tmp_path), "shard", 0)  # (once)
    assert not (tmp_path / "shard-0").exists()
    s = Sim(tmp_path, n=1)
    try:
        s.settle()
        assert s.leader_name() == "shard-0-r0"
        assert s.bodies("shard-0-r0") == [b"m0", b"m1", b"m2"]
        assert s.send("shard-0-r0", b"next", pump=False) == "SEND_OK"  # (nobody to wait for)
        s.kill("shard-0-r0")  # a restart: it leads again, nothing lost
        s.start("shard-0-r0")
        s.settle()
        assert s.leader_name() == "shard-0-r0"
        assert s.bodies("shard-0-r0") == [b"m0", b"m1", b"m2", b"next"]
        shard = s.replicas["shard-0-r0"].serving()  # and readers see all of it at once
        [(_t, _q, batch, _next, _end)] = shard.pull([(TOPIC, 0, 0, 10)], 0, None, None,
                                                    "read_committed")
        assert [bytes(m.body) for m in batch.messages()] == [b"m0", b"m1", b"m2", b"next"]
        s.check()
    finally:
        s.close()


def test_a_group_of_one_whose_disk_was_replaced_leads_again_only_by_the_operator_s_call(tmp_path):
    """Its only replica back on a new disk would serve nothing of what was acknowledged:
    it waits for the operator (``raymq shard elect 0 --unclean``), as a bigger group's
    wiped replica does; so elected, it leads (it was undone at its next heartbeat, which
    told of its log before it acted on the election: a group wedged for good)."""
    s = Sim(tmp_path, n=1)
    try:
        s.settle()
        assert s.send("shard-0-r0", b"kept", pump=False) == "SEND_OK"
        s.kill("shard-0-r0")
        s.start("shard-0-r0", wipe=True)
        s.beat()
        assert s.leader_name() is None and s.replicas["shard-0-r0"].shard is None
        assert s.controller.replicas()[0]["candidacy"] == {"shard-0-r0": "not in sync"}
        s.controller.replica_elect(0, unclean=True)  # the operator's call
        s.beat()  # (it reports its log as it was before it heard of the election)
        s.beat()
        assert s.leader_name() == "shard-0-r0" and s.replicas["shard-0-r0"].shard is not None
        assert s.send("shard-0-r0", b"after", pump=False) == "SEND_OK"
        assert s.bodies("shard-0-r0") == [b"after"]
    finally:
        s.close()


def test_a_group_of_one_confirms_a_write_that_does_not_wait(tmp_path):
    """A Kafka-style transactional write answered once written (``durable=False``, made
    durable by its commit) is read uncommitted at once: nobody's fetch moves a group of
    one's confirmed offset, its own write does."""
    s = Sim(tmp_path, n=1)
    try:
        s.settle()
        shard = s.replicas["shard-0-r0"].serving(write=True)
        shard.ktx_register(7, 0, [(TOPIC, 0)])
        shard.ktx_send(RecordBatch(TOPIC, 0, [b"tx"]), 7, 0, 1, 0, durable=False)
        [(_t, _q, batch, _next, end)] = shard.pull([(TOPIC, 0, 0, 10)], 0, None, None,
                                                   "read_uncommitted")
        assert [bytes(m.body) for m in batch.messages()] == [b"tx"] and end == 1
    finally:
        s.close()
