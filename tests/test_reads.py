"""How much one pull reads (``raymq.actors.reads``): as many messages as asked, up to
``PULL_MAX_BYTES`` of the log a queue.  In-process shard, no Ray."""
from __future__ import annotations

import os

from raymq.actors import reads
from raymq.actors.shard import BrokerShard
from raymq.storage import RecordBatch


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
