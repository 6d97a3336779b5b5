"""A shard in-process (no Ray): transaction ends with and without the halves kept in memory."""
from __future__ import annotations

import pytest

from actors import shard as shard_mod
from actors.shard import BrokerShard
from cluster.message import Prop, make_msg_id
from storage import RecordBatch


def tx_batch(topic: str, n: int, start: int) -> RecordBatch:
    return RecordBatch(
        topic, [i % 2 for i in range(n)], [f"body-{start + i}".encode() for i in range(n)],
        keys=[f"k{start + i}" for i in range(n)], tags=["t" if i % 2 else None for i in range(n)],
        properties=[{Prop.TRAN_MSG: "true", Prop.PRODUCER_GROUP: "g",
                     Prop.TRANSACTION_ID: f"tx{start + i}", "user": str(start + i)}
                    for i in range(n)], born_ms=1_700_000_000_000)


@pytest.mark.parametrize("kept", [0, 2, 100])
def test_commit_writes_the_same_real_messages_whether_halves_are_kept_or_read(
        tmp_path, monkeypatch, kept):
    monkeypatch.setattr(shard_mod, "HALF_CACHE_MAX", kept)
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    try:
        sh.set_routes([("orders", 0), ("orders", 1)])
        sent = sh.send(tx_batch("orders", 5, 0), 77, 1)
        assert len(sh._half_cache) == min(kept, 5)
        ends = [("g", f"tx{i}", [phys], "COMMIT_MESSAGE") for i, phys in enumerate(sent["phys"])]
        ends[4] = ("g", "tx4", [sent["phys"][4]], "ROLLBACK_MESSAGE")
        ends.append(("other-group", "tx0", [sent["phys"][0]], "COMMIT_MESSAGE"))
        # the ends ride on the producer's next request (one put with its new halves)
        more = sh.send(tx_batch("orders", 3, 100), 77, 2, ends)
        assert more["ends"][:5] == ["COMMITTED"] * 4 + ["ROLLED_BACK"]
        assert more["ends"][5].startswith("REFUSED")  # wrong group: refused, nothing written
        assert more["status"] == "SEND_OK" and len(more["phys"]) == len(more["queue_offsets"]) == 3
        # resolved halves are not kept; the new ones are, as far as the bound allows
        assert set(sh._half_cache) == set(more["phys"][:min(kept, 3)])
        # a resend of that request (a timeout) stores nothing again and ends nothing again
        again = sh.send(tx_batch("orders", 3, 100), 77, 2, ends)
        assert again["duplicate"] and again["phys"] == more["phys"]
        # ends alone (nothing else to send): the rest of the transactions
        alone = sh.send(None, 0, 0, [("g", f"tx{100 + i}", [p], "ROLLBACK_MESSAGE")
                                     for i, p in enumerate(more["phys"])])
        assert alone["ends"] == ["ROLLED_BACK"] * 3 and alone["phys"] == []
        assert sh._half_cache == {}
        got = []
        for q in (0, 1):
            [(_t, _q, batch, _next, _end)] = sh.pull([("orders", q, 0, 100)])
            got += batch.messages()
        assert sorted(m.body for m in got) == [f"body-{i}".encode() for i in range(4)]
        for m in got:
            i = int(m.properties["user"])
            assert (m.key, m.tags, m.queue_id, m.born_ms) == \
                (f"k{i}", "t" if i % 2 else None, i % 2, 1_700_000_000_000)
            assert m.properties[Prop.ORIGIN_MSG_ID] == make_msg_id(0, sent["phys"][i])
            assert m.properties[Prop.TRANSACTION_ID] == f"tx{i}"
            assert not {Prop.TRAN_MSG, Prop.REAL_TOPIC, Prop.REAL_QID} & set(m.properties)
        # a late duplicate end changes nothing
        assert sh.send(None, 0, 0, ends[:1])["ends"] == ["NOOP"]
    finally:
        sh.close()
