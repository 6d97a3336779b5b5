"""kafkajs (Node.js: a Kafka client with protocol code of its own) against the listener in
front of the session cluster (issue 36): an idempotent producer with binary keys and
repeated headers, a consumer group that commits, a transactional copy with the group's
offsets in it and an aborted transaction.  What it did is checked with RayMQ's own
SDK.  Needs Node.js and ``npm ci`` in ``tests/wire/kafkajs`` (the install script does
both in CI); elsewhere the test skips, naming what is missing."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.ray

HERE = os.path.join(os.path.dirname(__file__), "kafkajs")


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("kafkajs test: Node.js is not installed (the CI install script adds it)")
    if not os.path.isdir(os.path.join(HERE, "node_modules", "kafkajs")):
        pytest.skip("kafkajs test: run `npm ci` in tests/wire/kafkajs (the CI install "
                    "script does)")
    return node


def test_kafkajs_produces_idempotently_consumes_in_a_group_and_copies_in_transactions(
        mq, name, listener):
    from tests.client.test_cluster import read_to_end
    node = _node()
    src, dst, group = name + "-in", name + "-out", name + "-g"
    mq.create_topic(src, 2)
    mq.create_topic(dst, 2)
    run = subprocess.run([node, os.path.join(HERE, "scenario.js"), "%s:%d" % listener.address,
                          src, dst, group, "24"], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    seen = out["seen"]
    assert sorted(m["value"] for m in seen) == sorted(f"js {i}" for i in range(24))
    assert all(m["headers"] == [m["value"][3:], "again"] for m in seen)
    assert all(m["key"] == [0xFF, int(m["value"][3:])] for m in seen)

    c = mq.consumer(name + "-sdk", [src])  # what the SDK reads of the producer's messages
    got = {m.body: m for m in read_to_end(c, mq, [src])}
    c.close()
    assert len(got) == 24
    assert (got[b"js 5"].key, got[b"js 5"].headers) == (b"\xff\x05", [("h", b"5"),
                                                                       ("h", b"again")])
    c = mq.consumer(name + "-rc", [dst], isolation="read_committed")
    copied = sorted(m.body for m in read_to_end(c, mq, [dst]))
    c.close()
    assert copied == sorted(b"JS %d" % i for i in range(24))  # (the aborted one: never)
    for g, want in ((group, out["ends"]), (group + "-copier", out["ends"])):
        committed = mq.admin.reset_offsets(g, src, to="latest", dry_run=True)
        assert {q: before for (_t, q), (before, _a) in committed.items()} == {
            int(p): end for p, end in want.items()}
