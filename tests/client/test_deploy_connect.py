"""Joining a Ray cluster: an address where nothing answers, a cluster that wants a token,
and Ray's address file left behind by a dead cluster are each answered in one line with
the fix, within seconds -- never minutes of Ray's retries.

Every Ray here is the test's own (``own_ray``, or the embedded one ``connect()`` starts
in its subprocess), with its own ``RAY_TMPDIR``: this machine's address file and the
session's Ray are not touched.
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile

import pytest

from tests.conftest import ray_env

pytestmark = pytest.mark.slow


def free_port() -> int:
    """A TCP port of 127.0.0.1 nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{text[-3000:]}"
    return lines[0]


@pytest.fixture
def stale_ray_dir():
    """A RAY_TMPDIR whose Ray address file names a cluster that is gone (a free port)."""
    tmp = tempfile.mkdtemp(prefix="rq", dir="/tmp")
    os.makedirs(os.path.join(tmp, "ray"))
    address = f"127.0.0.1:{free_port()}"
    path = os.path.join(tmp, "ray", "ray_current_cluster")
    with open(path, "w") as f:
        f.write(address)
    yield tmp, path, address
    from tests.conftest import _kill_processes_naming
    _kill_processes_naming(tmp)
    shutil.rmtree(tmp, ignore_errors=True)


def test_status_with_ray_address_at_nothing_is_one_line_within_seconds(run_raymq, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    res = run_raymq(["status"], ray_env(RAY_ADDRESS=address, RAY_TMPDIR=str(tmp_path)),
                    timeout_s=60)
    assert res.rc is not None and res.rc != 0, f"still waiting after {res.seconds:.0f} s"
    assert res.seconds < 20
    line = one_line(res.err)
    assert address in line and "RAY_ADDRESS" in line


def test_a_token_cluster_joined_without_token_mode_says_set_ray_auth_mode(own_ray, run_raymq,
                                                                         tmp_path):
    cluster = own_ray(auth_mode="token")
    res = run_raymq(["status"], ray_env(RAY_ADDRESS=cluster.address, RAY_TMPDIR=cluster.tmp),
                    timeout_s=60)
    assert res.rc == 1 and res.seconds < 20, (res.rc, res.seconds, res.err[-2000:])
    line = one_line(res.err)
    assert "RAY_AUTH_MODE=token" in line and cluster.address in line
    # a wrong token: refused, and said so
    res = run_raymq(["down"], ray_env(RAY_ADDRESS=cluster.address, RAY_TMPDIR=cluster.tmp,
                                      RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 32),
                    timeout_s=60)
    assert res.rc == 1 and res.seconds < 20
    assert "refused" in one_line(res.err)
    # token mode and no token anywhere: Ray's own AuthenticationError, in one line
    res = run_raymq(["down"], ray_env(RAY_ADDRESS=cluster.address, RAY_TMPDIR=cluster.tmp,
                                      RAY_AUTH_MODE="token", HOME=str(tmp_path)), timeout_s=60)
    assert res.rc == 1 and res.seconds < 20
    line = one_line(res.err)
    assert "no authentication token was found" in line and "no Ray cluster" not in line
    # with the fix it attaches (down deploys nothing: there was nothing to stop)
    res = run_raymq(["down"], ray_env(RAY_ADDRESS=cluster.address, RAY_TMPDIR=cluster.tmp,
                                      RAY_AUTH_MODE="token"), timeout_s=60)
    assert res.rc == 0, res.err[-2000:]
    assert "nothing was running" in res.out


def test_the_cli_names_a_dead_clusters_address_file_in_one_line(stale_ray_dir, run_raymq):
    tmp, path, address = stale_ray_dir
    res = run_raymq(["status"], ray_env(RAY_TMPDIR=tmp), timeout_s=60)
    assert res.rc == 1 and res.seconds < 20, (res.rc, res.seconds, res.err[-2000:])
    line = one_line(res.err)
    assert path in line and address in line


CONNECT = """
import time
from raymq import connect, rpc
start = time.monotonic()
mq = connect()
print("connected", round(time.monotonic() - start, 1), "embedded", rpc.embedded(), flush=True)
print("queues", mq.create_topic("t", queues=3)["queues"], flush=True)
mq.close()
"""


def test_connect_past_a_dead_clusters_address_file_starts_the_embedded_ray(stale_ray_dir,
                                                                          run_raymq):
    """The README's promise: ``connect()`` works out of the box on this machine."""
    tmp, path, _address = stale_ray_dir
    res = run_raymq(python=CONNECT, env=ray_env(RAY_TMPDIR=tmp, RAYMQ_DATA_DIR=f"{tmp}/data",
                                                RAY_AUTH_MODE="disabled"), timeout_s=120)
    assert res.rc == 0, f"rc {res.rc} after {res.seconds:.0f} s: {res.err[-3000:]}"
    assert "embedded True" in res.out and "queues 3" in res.out
    assert path in res.err  # the warning says which file it passed by


def test_a_ray_started_here_keeps_idle_workers_and_runs_them_at_normal_priority(monkeypatch):
    """Past its soft limit Ray kills a worker idle for a second, and RayMQ's and Spark's
    actors count: every committed dataset would start its read workers afresh."""
    from raymq import rpc
    for var in ("RAY_worker_niceness", "RAY_num_workers_soft_limit"):
        monkeypatch.delenv(var, raising=False)
    rpc.worker_settings()
    assert os.environ["RAY_worker_niceness"] == "0"
    assert int(os.environ["RAY_num_workers_soft_limit"]) == \
        os.cpu_count() + rpc.WORKERS_SOFT_LIMIT_EXTRA
    monkeypatch.setenv("RAY_num_workers_soft_limit", "3")  # an operator's own setting wins
    rpc.worker_settings()
    assert os.environ["RAY_num_workers_soft_limit"] == "3"


def test_an_embedded_rays_object_store_is_sized_and_reserved_only_where_it_fits():
    from raymq import rpc
    gib = 1 << 30
    big = rpc.embedded_store_settings({"num_cpus": 2}, 24 * gib, 20 * gib)
    assert big["object_store_memory"] == rpc.EMBEDDED_OBJECT_STORE_MAX
    assert big["_system_config"] == {"preallocate_plasma_memory": True}
    assert big["num_cpus"] == 2
    small = rpc.embedded_store_settings({}, 4 * gib, 2 * gib)  # 30% of 4 GiB: below the cap
    assert small["object_store_memory"] == int(4 * gib * 0.3)
    assert small["_system_config"]["preallocate_plasma_memory"] is True
    docker = rpc.embedded_store_settings({}, 24 * gib, 64 << 20)  # a 64 MB /dev/shm
    assert docker["object_store_memory"] == rpc.EMBEDDED_OBJECT_STORE_MAX
    assert "_system_config" not in docker  # Ray's store on disk: never written whole
    mine = rpc.embedded_store_settings(
        {"object_store_memory": 300 << 20, "_system_config": {"preallocate_plasma_memory": False,
                                                              "other": 1}}, 24 * gib, 20 * gib)
    assert mine["object_store_memory"] == 300 << 20  # the caller's choices win
    assert mine["_system_config"] == {"preallocate_plasma_memory": False, "other": 1}


def test_the_embedded_rays_object_store_is_resident_from_its_start(ray_session):
    """The session's Ray (``rpc.init("local")`` with a 300 MB store) holds its whole
    object store in memory before any object is stored in most of it."""
    from ray._private import ray_constants
    node = ray_session._private.worker.global_worker.node
    [raylet] = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET]
    status = open(f"/proc/{raylet.process.pid}/status").read()
    shmem_kb = int(status.split("RssShmem:")[1].split()[0])
    store = ray_session.cluster_resources()["object_store_memory"]
    assert shmem_kb * 1024 >= 0.95 * store, (shmem_kb, store)
