"""Child of ``test_jobs_big.py``: its own embedded Ray with a 2 GiB object store, a topic
of ``N`` messages of 256 bytes (more than the store holds), read with
``read_committed``; prints one JSON line of what it saw."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

from raymq import Message, rpc
from raymq.client import connect
from raymq.jobs import read_committed

data, n = sys.argv[1], int(sys.argv[2])
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ray_dir = tempfile.mkdtemp(prefix="rmqbig-")  # (a short path: Ray's sockets live there)
rpc.init("local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
         object_store_memory=2 * 1024 ** 3, _temp_dir=ray_dir)
mq = connect(data_dir=os.path.join(data, "raymq"), num_shards=1, flush_mode="async")
mq.create_topic("big", queues=1)
p = mq.producer()
batch = [Message("big", os.urandom(256)) for _ in range(10_000)]
t0 = time.monotonic()
for _ in range(n // len(batch)):
    p.send_batch(batch)
produced_s = time.monotonic() - t0
t0 = time.monotonic()
rb = read_committed(mq, ["big"], start="earliest")
rows = rb.dataset.count()
print(json.dumps({"rows": rows, "end": rb.end_offsets[("big", 0)], "blocks": len(rb._refs),
                  "dataset_bytes": rb.dataset.size_bytes(), "produce_s": round(produced_s, 1),
                  "read_s": round(time.monotonic() - t0, 1)}), flush=True)
mq.close()
rpc.shutdown()
shutil.rmtree(ray_dir, ignore_errors=True)
