"""Retention end to end on a RayMQ of its own (an embedded Ray in a child process): the
shard's janitor thread deletes the segments past a topic's retention while producers and
consumers run; a group whose offset aged out goes on from the log start
(``auto_offset_reset="earliest"``) or is told so by ``poll`` (``"error"``); ``raymq
status``'s data say what was deleted."""
from __future__ import annotations

import pytest

from tests.conftest import _kill_processes_naming, ray_env

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CHILD = """
import time
from raymq import Message, OffsetOutOfRangeError, connect
mq = connect(num_shards=1, segment_size_bytes=9 << 20, retention_check_ms=200,
             disk_clean_ratio=1.0, disk_full_ratio=1.0, heartbeat_interval_ms=200,
             session_timeout_ms=2000, pull_wait_ms=100)
mq.create_topic("t", 1, retention_ms=1000)
p = mq.producer()
body = bytes(256 * 1024)
for i in range(40):                                   # ~10 MiB: one segment sealed
    p.send(Message("t", b"%04d" % i + body))
c = mq.consumer("slow", ["t"])
got = []
while len(got) < 5:
    got += c.poll(5 - len(got), 1.0)
c.seek("t", 0, 5)
c.commit()
c.close()
time.sleep(1.5)                                       # what was sent is past its retention
for i in range(40, 80):                               # and a second segment to seal
    p.send(Message("t", b"%04d" % i + body))
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    info = mq.admin.status()["shards"][0]["info"]["retention"]
    if info["deleted_segments"]:
        break
    time.sleep(0.2)
print("deleted", info["deleted_segments"], "log_starts", info["log_starts"], flush=True)
e = mq.consumer("slow", ["t"], auto_offset_reset="error")
try:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        e.poll(10, 0.5)
    print("no error", flush=True)
except OffsetOutOfRangeError as err:
    print("error:", err, flush=True)
e.close()
time.sleep(2.5)                                       # (its session ends)
c = mq.consumer("slow", ["t"])
first = []
deadline = time.monotonic() + 30
while not first and time.monotonic() < deadline:
    first = c.poll(1, 0.5)
now_start = mq.admin.status()["shards"][0]["info"]["retention"]["log_starts"]["t/0"]
print("earliest", first[0].queue_offset, first[0].body[:4].decode(), now_start, flush=True)
c.close()
mq.close()
"""


def test_a_group_whose_offset_aged_out_resumes_as_its_reset_says(run_raymq, tmp_path):
    import shutil
    import tempfile
    ray_tmp = tempfile.mkdtemp(prefix="rq", dir="/tmp")  # (Ray's socket paths are short)
    try:
        res = run_raymq(python=CHILD, env=ray_env(RAY_TMPDIR=ray_tmp,
                                                  RAYMQ_DATA_DIR=str(tmp_path / "data"),
                                                  RAY_AUTH_MODE="disabled"), timeout_s=240)
    finally:
        _kill_processes_naming(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert res.rc == 0, f"rc {res.rc} after {res.seconds:.0f} s: {res.err[-3000:]}"
    lines = {line.split(" ", 1)[0]: line for line in res.out.splitlines()}
    deleted, starts = lines["deleted"].split(" ")[1], lines["deleted"].split("log_starts ")[1]
    assert int(deleted) >= 1 and "'t/0'" in starts
    start = int(starts.split("'t/0': ")[1].rstrip("}"))
    assert start > 5
    assert lines["error:"].startswith(f"error: t/0: offset 5 is below the queue's log start "
                                      f"{start}")
    _word, offset, body, now_start = lines["earliest"].split()
    # from the log start it had when it read (later segments may have gone since)
    assert start <= int(offset) <= int(now_start) and body == f"{int(offset):04d}"
