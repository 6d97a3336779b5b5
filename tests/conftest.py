"""Session fixtures: one local Ray for the whole run (through ``raymq.rpc``), RayMQ
deployed into it once; Ray clusters of a test's own.  What tests share otherwise is in
``tests.helpers``."""
from __future__ import annotations

import os
import time
import uuid

import pytest

from tests.helpers import ROOT

# Timeouts a stall on a busy 2-core machine must not reach (a false failure otherwise):
# a consumer gives its queues up after session_timeout_ms without a heartbeat through
# (25 heartbeats here), a transaction producer stops being live after producer_lease_ms
# without a poll, and a half stored txn_timeout_ms after its send began is rolled back
# by its own producer, or checked back while its end may still be on its way.
TEST_CONFIG = dict(num_shards=2, heartbeat_interval_ms=200, session_timeout_ms=5000,
                   delay_levels="100ms 200ms 300ms 400ms 500ms 600ms 700ms 800ms",
                   retry_first_level=1, max_reconsume=3, send_timeout_ms=5000,
                   pull_wait_ms=200, retry_backoff_ms=50, schedule_tick_ms=20,
                   txn_timeout_ms=1500, txn_check_interval_ms=200, txn_max_checks=3,
                   txn_check_backoff_max_ms=1500, txn_max_checks_per_group=20,
                   producer_lease_ms=5000,
                   # (no disk watermarks: a test machine's disk may be fuller than them)
                   disk_clean_ratio=1.0, disk_full_ratio=1.0)


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


# ------------------------------------------------- Ray clusters of a test's own
#: Holds an embedded Ray until its stdin closes; prints the Ray's GCS address first.
_HOLDER = """
import sys
import ray
ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""


def _kill_processes_naming(path: str) -> list[int]:
    """Kill the processes whose command line names ``path`` (a temp dir made by a test:
    only processes the test started can name it); their PIDs."""
    import psutil
    me = os.getpid()
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] != me and path in " ".join(p.info["cmdline"] or ()):
            found.append(p)
    for p in found:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(found, timeout=10)
    return [p.pid for p in found]


@pytest.fixture
def own_ray():
    """``own_ray(auth_mode="disabled")``: a Ray of the test's own, held by a subprocess.

    Returns an object with ``address`` (its GCS address) and ``tmp`` (its own
    ``RAY_TMPDIR``, short: Ray's socket paths live under it).  The session's Ray
    and this machine's Ray address file are not touched; at the end the holder
    stops its Ray and anything left that names ``tmp`` is killed by PID.
    """
    import shutil
    import subprocess
    import sys
    import tempfile
    from types import SimpleNamespace
    held = []

    def start(auth_mode: str = "disabled"):
        tmp = tempfile.mkdtemp(prefix="rq", dir="/tmp")
        env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_AUTH_MODE": auth_mode}
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env=env)
        held.append((proc, tmp))
        address = proc.stdout.readline().strip()
        assert address, "the holder's Ray did not start"
        return SimpleNamespace(address=address, tmp=tmp)
    yield start
    for proc, tmp in held:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        _kill_processes_naming(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def run_raymq():
    """``run_raymq(args, env, timeout_s=120, python=None)``: run ``raymq ARGS`` (or
    ``python -c CODE`` when ``python`` is given) in a subprocess of its own session;
    returns ``rc`` (None if it was killed at ``timeout_s``), ``out``, ``err``, ``seconds``."""
    import signal
    import subprocess
    import sys
    from types import SimpleNamespace
    root = ROOT

    def run(args=(), env=None, timeout_s: float = 120, python: str | None = None):
        cmd = [sys.executable, "-c", python] if python is not None else \
            [sys.executable, "-m", "raymq.tools.cli", *args]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            rc = None
        return SimpleNamespace(rc=rc, out=out, err=err, seconds=time.monotonic() - start)
    return run


def ray_env(**values) -> dict:
    """This process's environment without Ray's connection settings, plus ``values``
    (a value None removes the variable)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    for k, v in values.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env
