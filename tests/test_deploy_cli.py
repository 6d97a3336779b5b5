"""Only ``raymq up`` deploys: the other commands on a cluster without RayMQ say so in one
line with the fix, ``up`` with settings other than the running cluster's says which and
changes nothing, and ``connect()`` deploys only into an embedded Ray of its own process.

Runs the command line in subprocesses against a Ray of the test's own (``own_ray``):
``raymq down`` there cannot touch the session's RayMQ.
"""
from __future__ import annotations

import json

import pytest

from tests.conftest import ray_env

pytestmark = pytest.mark.slow


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{text[-3000:]}"
    return lines[0]


def test_only_up_deploys_and_up_refuses_other_settings(own_ray, run_raymq, tmp_path):
    cluster = own_ray()
    env = ray_env(RAY_ADDRESS=cluster.address, RAY_TMPDIR=cluster.tmp, RAY_AUTH_MODE="disabled",
                  RAYMQ_DATA_DIR=str(tmp_path / "data"))

    def raymq(*args, rc=0):
        res = run_raymq(list(args), env, timeout_s=180)
        assert res.rc == rc, f"raymq {' '.join(args)}: rc {res.rc}\n{res.out}\n{res.err[-3000:]}"
        return res

    # a cluster without RayMQ: status says so and deploys nothing
    line = one_line(raymq("status", rc=1).err)
    assert "NOT_DEPLOYED" in line and "raymq up" in line and cluster.address in line
    assert "nothing was running" in raymq("down").out
    assert "controller + 2 shards" in raymq("up", "--num-shards", "2").out
    # other settings on the running cluster: refused, naming what differs; nothing changed
    line = one_line(raymq("up", "--num-shards", "3", rc=1).err)
    assert "CONFIG_MISMATCH" in line and "num_shards" in line and "2" in line and "3" in line
    line = one_line(raymq("up", "--data-dir", str(tmp_path / "elsewhere"), rc=1).err)
    assert "data_dir" in line and str(tmp_path / "elsewhere") in line
    (tmp_path / "cfg.json").write_text(json.dumps({"flush_mode": "async", "num_shards": 2}))
    line = one_line(raymq("--config", str(tmp_path / "cfg.json"), "up", rc=1).err)
    assert "flush_mode" in line and "num_shards" not in line  # only what differs
    assert "controller + 2 shards" in raymq("up").out  # the same settings: idempotent
    assert "shards: 2" in raymq("status").out
    assert "shard-0" in raymq("down").out
    # after down: every command but up says so, and redeploys nothing
    for args in (["status"], ["topic", "list"], ["half", "list"]):
        line = one_line(raymq(*args, rc=1).err)
        assert "NOT_DEPLOYED" in line and "raymq up" in line
    # the SDK on a cluster it joined does not deploy either, unless asked to
    res = run_raymq(python="from raymq import connect\nconnect()", env=env, timeout_s=120)
    assert res.rc == 1 and "NotDeployedError" in res.err and "raymq up" in res.err
    assert "nothing was running" in raymq("down").out
    res = run_raymq(python="from raymq import connect\nprint(connect(deploy=True).num_shards)",
                    env=env, timeout_s=180)
    assert res.rc == 0 and res.out.strip() == "2", res.err[-3000:]
    assert "shard-1" in raymq("down").out


def test_differences_name_only_settings_asked_that_differ(monkeypatch, tmp_path):
    """No Ray: what `raymq up` compares (a data dir by where it resolves, delay levels by
    their values)."""
    from raymq.actors.config import ClusterConfig
    from raymq.deploy import differences
    from raymq.storage.errors import ConfigError
    monkeypatch.setenv("RAYMQ_DATA_DIR", str(tmp_path / "d"))
    running = ClusterConfig.from_dict({"num_shards": 2, "data_dir": str(tmp_path / "d")})
    assert differences(running, {}) == []
    assert differences(running, {"num_shards": 2, "data_dir": ""}) == []  # "" resolves there
    assert differences(running, {"delay_levels": running.delay_levels.replace(" ", "  ")}) == []
    assert differences(running, {"num_shards": 3, "flush_mode": "sync"}) == [
        "num_shards: running 2, asked 3"]
    with pytest.raises(ConfigError, match="num_shard"):
        differences(running, {"num_shard": 3})  # asked settings are checked first
