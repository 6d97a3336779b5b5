"""A topic deleted and created again before every shard dropped it: the controller
refuses the creation (retriable) until each shard of its routes confirmed the drop, so
the new topic never continues at the old one's offsets.  In-process, no Ray."""
from __future__ import annotations

import pytest

from raymq.actors.controller import Controller
from raymq.storage import RecordBatch
from raymq.storage.clock import ManualClock
from raymq.storage.errors import BrokerUnavailableError
from tests.helpers import open_shard


def controller(path, shards: int = 2) -> Controller:
    return Controller({"num_shards": shards, "data_dir": str(path)}, clock=ManualClock())


def test_creation_waits_for_every_shard_to_drop_the_old_topic_even_across_a_restart(
        tmp_path):
    c = controller(tmp_path)
    assert c.create_topic("t", 2)["routes"] == [0, 1]
    info = c.delete_topic("t")  # (the client died: no shard was asked to drop it)
    with pytest.raises(BrokerUnavailableError, match="shard-0, shard-1"):
        c.create_topic("t", 2)
    deletion = info["deletion"]
    c.topic_dropped("t", [0], deletion)  # shard-0 dropped it; shard-1 did not (yet)
    with pytest.raises(BrokerUnavailableError, match="shard-1") as err:
        c.create_topic("t", 2)
    assert err.value.retriable and "shard-0" not in str(err.value)
    settings = c.topic_settings()
    assert "t" in settings["deleted"] and settings["deleting"]["t"]["shards"] == [1]

    c = controller(tmp_path)  # the controller restarts: what is pending is kept
    with pytest.raises(BrokerUnavailableError, match="shard-1"):
        c.create_topic("t", 2)
    c.topic_dropped("t", [1], deletion - 1)  # (a confirmation of another deletion: no)
    with pytest.raises(BrokerUnavailableError):
        c.create_topic("t", 2)
    c.topic_settings(shard=1, dropped={"t": deletion})  # (as a janitor confirms)
    assert c.topic_settings()["deleting"] == {}
    assert c.create_topic("t", 2)["routes"] == [0, 1]
    assert "t" not in c.topic_settings()["deleted"]


def test_a_shard_that_no_longer_exists_is_not_waited_for(tmp_path):
    c = controller(tmp_path, shards=4)
    c.create_topic("a", 1), c.create_topic("b", 1), c.create_topic("c", 1)
    assert c.create_topic("t", 2)["routes"] == [3, 0]
    deletion = c.delete_topic("t")["deletion"]
    c = controller(tmp_path, shards=2)  # the cluster shrank: shard-3 is gone
    assert c.topic_settings()["deleting"]["t"]["shards"] == [0]
    c.topic_dropped("t", [0], deletion)
    assert c.create_topic("t", 2)["queues"] == 2


def test_the_pending_deletions_are_mirrored_with_the_topics(tmp_path):
    c = controller(tmp_path / "a")
    c.create_topic("t", 2)
    c.delete_topic("t")
    lost = controller(tmp_path / "b")  # a controller that lost its files takes the mirror
    lost._mirror(None, c.metadata())
    with pytest.raises(BrokerUnavailableError, match="shard-0, shard-1"):
        lost.create_topic("t", 2)


def test_a_shard_refusing_the_drop_keeps_the_name_until_its_janitor_dropped_it(tmp_path):
    """The end to end case on one shard: an open Kafka-style transaction writes to the
    topic, so the shard refuses the drop; the topic is created again meanwhile."""
    c = controller(tmp_path / "controller", shards=1)
    c.create_topic("t", 1)
    sh = open_shard(tmp_path / "shard", c.shard_routes(0), clock=ManualClock())
    sh.routes._fetch = lambda _i: c.shard_routes(0)
    sh.janitor._settings = lambda **kw: c.topic_settings(**kw)  # (the deploy's lambda)
    sh.send(RecordBatch("t", 0, [b"old-0", b"old-1"]))
    sh.commit_offsets("readers", {("t", 0): 2})
    sh.ktx_register(5, 0, [("t", 0)])
    sh.ktx_send(RecordBatch("t", 0, [b"in a transaction"]), 5, 0, 1)

    c.delete_topic("t")  # the client's drop_topic is refused: the transaction is open
    sh.janitor.run_once()  # (refused again: nothing confirmed)
    with pytest.raises(BrokerUnavailableError, match="shard-0"):
        c.create_topic("t", 1)
    sh.ktx_end(5, 1, "ABORT")
    sh.janitor.run_once()  # dropped now, and confirmed
    c.create_topic("t", 1)
    sh.set_routes(c.shard_routes(0))
    assert sh.store.max_queue_offset("t", 0) == 0  # the new topic starts empty
    assert not any("@t@" in k for k in sh.store.offsets.snapshot())
    assert sh.send(RecordBatch("t", 0, [b"new"])).queue_offsets == [0]
