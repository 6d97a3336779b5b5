"""Session fixtures: one local Ray for the whole run (through ``raymq.rpc``), RayMQ
deployed into it once; and ``wait_for``, the tests' polling helper."""
from __future__ import annotations

import os
import threading
import time
import uuid

import pytest

TEST_CONFIG = dict(num_shards=2, heartbeat_interval_ms=200, session_timeout_ms=1500,
                   delay_levels="100ms 200ms 300ms 400ms 500ms 600ms 700ms 800ms",
                   retry_first_level=1, max_reconsume=3, send_timeout_ms=5000,
                   pull_wait_ms=200, retry_backoff_ms=50, schedule_tick_ms=20,
                   txn_timeout_ms=400, txn_check_interval_ms=200, txn_max_checks=3,
                   txn_check_backoff_max_ms=800, txn_max_checks_per_group=20,
                   producer_lease_ms=1500)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from raymq import rpc
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rpc.init("local", num_cpus=2, include_dashboard=False,
             object_store_memory=300 * 1024 * 1024)
    yield ray
    rpc.shutdown()


@pytest.fixture(scope="session")
def mq(ray_session, tmp_path_factory):
    from raymq import connect
    from raymq.deploy import undeploy
    data = tmp_path_factory.mktemp("raymq-data")
    client = connect(data_dir=str(data), **TEST_CONFIG)
    yield client
    client.close()
    undeploy()


@pytest.fixture
def name():
    """A fresh topic or group name per test."""
    return f"t{uuid.uuid4().hex[:10]}"


def wait_for(cond, timeout_s: float = 30.0, what: str = "condition"):
    """Poll ``cond`` until truthy (returns its value) or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    ev = threading.Event()
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        ev.wait(0.02)
