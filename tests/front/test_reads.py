"""How much one pull reads (``raymq.actors.front.reads``): as many messages as asked, up to
``PULL_MAX_BYTES`` of the log a queue; and what it answers in each ``form``.  In-process
shard, no Ray."""
from __future__ import annotations

import os
import pickle

import pytest

from raymq.actors.front import reads
from raymq.actors.shard import BrokerShard
from raymq.storage import RecordBatch
from raymq.storage.errors import InvalidMessageError
from raymq.storage.records import RecordSpans


def test_a_pull_of_batched_records_reads_as_many_as_asked(tmp_path):
    """Records sent in batches share frames; each consume-queue entry's size spans the
    frame's other records, so summing them capped a pull at ~150 messages."""
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    try:
        sh.set_routes([("t", 0)])
        for _ in range(3):
            sh.send(RecordBatch("t", 0, [os.urandom(256)] * 10_000))
        [(_t, _q, batch, nxt, end)] = sh.pull([("t", 0, 0, 20_000)])
        assert (len(batch), nxt, end) == (20_000, 20_000, 30_000)
    finally:
        sh.close()


def test_a_pull_stops_at_pull_max_bytes_of_the_log_and_reads_one_at_least(tmp_path,
                                                                         monkeypatch):
    monkeypatch.setattr(reads, "PULL_MAX_BYTES", 1 << 20)
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    try:
        sh.set_routes([("t", 0)])
        sh.send(RecordBatch("t", 0, [os.urandom(300 << 10) for _ in range(8)]))
        [(_t, _q, batch, nxt, _e)] = sh.pull([("t", 0, 0, 100)])
        assert len(batch) == nxt == 3  # 3 x 300 KiB fit in 1 MiB, a fourth does not
        sh.send(RecordBatch("t", 0, [os.urandom(2 << 20)]))
        [(_t, _q, batch, _n, _e)] = sh.pull([("t", 0, 8, 100)])
        assert len(batch) == 1  # larger than the cap alone: still read
    finally:
        sh.close()


def test_a_spans_pull_holds_the_records_a_messages_pull_decodes(tmp_path):
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    try:
        sh.set_routes([("t", 0)])
        sh.send(RecordBatch("t", 0, [os.urandom(100) for _ in range(50)],
                            keys=[f"k{i}" for i in range(50)]))
        [(_t, _q, batch, nxt, end)] = sh.pull([("t", 0, 10, 30)])
        [(_t, _q, spans, nxt2, end2)] = sh.pull([("t", 0, 10, 30)], form="spans")
        assert isinstance(spans, RecordSpans) and (nxt2, end2) == (nxt, end) == (40, 50)
        got = pickle.loads(pickle.dumps(spans, 5)).decode()  # as the channel carries it
        assert (got.bodies, got.keys, got.queue_offsets.tolist()) == \
            (batch.bodies, batch.keys, list(range(10, 40)))
        [(_t, _q, none, nxt3, _e)] = sh.pull([("t", 0, 50, 10)], form="spans")
        assert isinstance(none, RecordSpans) and len(none) == 0 and nxt3 == 50
        assert len(pickle.loads(pickle.dumps(none, 5))) == 0
        for bad in ({"form": "arrow"}, {"form": "spans", "tags": {"t": ["a"]}}):
            with pytest.raises(InvalidMessageError, match="form must be"):
                sh.pull([("t", 0, 0, 10)], **bad)
    finally:
        sh.close()


def test_a_large_spans_pull_crosses_the_channel_out_of_band_and_unchanged(tmp_path):
    """Its buffer is a frame of its own after the pickle (no copy into or out of it); a
    small reply stays one plain pickle."""
    from raymq.actors.channel import (OUT_OF_BAND_FROM, Endpoint, connect, encode_reply,
                                      encode_request, read_reply)
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    ep = Endpoint(sh)
    link = connect(ep.address, ep.authkey, 5)
    try:
        sh.set_routes([("t", 0)])
        sh.send(RecordBatch("t", 0, [os.urandom(300) for _ in range(10_000)],
                            keys=[f"k{i}" for i in range(10_000)]))
        local = sh.pull([("t", 0, 0, 10_000)], form="spans")
        assert len(local[0][2].buf) > OUT_OF_BAND_FROM
        frames = encode_reply(True, local)
        assert len(frames) == 2 and frames[0][:4] == b"RMQB" and \
            bytes(frames[1]) == bytes(local[0][2].buf)
        link.send_bytes(encode_request("pull", ([("t", 0, 0, 10_000)], 0, None, None,
                                                "read_uncommitted", "spans")))
        ok, [(_t, _q, spans, nxt, end)] = read_reply(link)
        want = sh.pull([("t", 0, 0, 10_000)])[0][2]
        got = spans.decode()
        assert ok and (nxt, end) == (10_000, 10_000)
        assert (got.bodies, got.keys, got.queue_offsets.tolist()) == \
            (want.bodies, want.keys, list(range(10_000)))
        small = encode_reply(True, sh.pull([("t", 0, 0, 10)], form="spans"))
        assert len(small) == 1 and pickle.loads(small[0])[1][0][2].decode().bodies == \
            want.bodies[:10]
    finally:
        link.close()
        ep.close()
        sh.close()
