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


def cli_on_own_ray(own_ray, run_raymq, tmp_path):
    """A Ray of the test's own (one node), its environment, and ``raymq(*args, rc=0)``
    running the CLI there (asserting its exit code)."""
    cluster = own_ray()
    env = ray_env(RAY_ADDRESS=cluster.address, RAY_TMPDIR=cluster.tmp, RAY_AUTH_MODE="disabled",
                  RAYMQ_DATA_DIR=str(tmp_path / "data"))

    def raymq(*args, rc=0):
        res = run_raymq(list(args), env, timeout_s=180)
        assert res.rc == rc, f"raymq {' '.join(args)}: rc {res.rc}\n{res.out}\n{res.err[-3000:]}"
        return res
    return cluster, env, raymq


def test_only_up_deploys_and_up_refuses_other_settings(own_ray, run_raymq, tmp_path):
    cluster, env, raymq = cli_on_own_ray(own_ray, run_raymq, tmp_path)

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


def test_a_refused_up_deploys_nothing(own_ray, run_raymq, tmp_path):
    """Issue 34: on one node `raymq up --replication-factor 3` is refused in one line and
    leaves nothing behind (it left a controller with R = 3: every later `up` refused the
    same way, `status` said "partly deployed"); a plain `up` then works.  A running
    RayMQ asked other settings, or one whose own settings the cluster cannot hold, is
    refused naming them and that `raymq down` comes first."""
    _cluster, env, raymq = cli_on_own_ray(own_ray, run_raymq, tmp_path)

    def python(code: str) -> str:
        res = run_raymq(python="from raymq import rpc, deploy\nrpc.init()\n" + code, env=env,
                        timeout_s=180)
        assert res.rc == 0, res.err[-3000:]
        return res.out.strip()

    line = one_line(raymq("up", "--replication-factor", "3", rc=1).err)
    assert "CONFIG_INVALID" in line and "replication_factor 3 needs 3 alive Ray nodes, the " \
        "cluster has 1: add nodes or lower it" in line, line
    status = one_line(raymq("status", rc=1).err)
    assert "NOT_DEPLOYED" in status and "partly" not in status, status
    assert python("print(rpc.named_actors())") == "[]"  # no controller left behind
    assert "nothing was deployed" in line
    assert "controller + 2 shards" in raymq("up").out
    # asked of the running RayMQ: which setting differs (running -> asked), `raymq down` first
    line = one_line(raymq("up", "--replication-factor", "3", rc=1).err)
    assert "CONFIG_MISMATCH" in line and "replication_factor: running 1, asked 3" in line
    assert "`raymq down` first" in line and "nothing changed" in line
    assert "shards: 2" in raymq("status").out  # still up, unreplicated
    assert "controller" in raymq("down").out
    # a controller alone with R = 3 (as a refused `up` of an older RayMQ left one): a
    # plain `up` says the running RayMQ's setting is the cause, and `raymq down` first
    python("from raymq.actors.config import ClusterConfig\n"
           "cfg = ClusterConfig(replication_factor=3)\n"
           "first = {**cfg.to_dict(), 'data_dir': cfg.data_dir_template()}\n"
           "rpc.ControllerClient(deploy._create_controller(first)).call('ping', timeout_s=120)")
    line = one_line(raymq("up", rc=1).err)
    assert "CONFIG_INVALID" in line and "runs in the Ray cluster" in line, line
    assert "replication_factor 3, which needs 3 alive Ray nodes, the cluster has 1" in line
    assert "`raymq down` first" in line
    assert python("print(rpc.named_actors())") == "['controller']"  # nothing more made
    assert "controller" in raymq("down").out
    assert "controller + 2 shards" in raymq("up").out
    assert "shard-1" in raymq("down").out


def test_deploy_checks_the_cluster_before_it_creates_anything(monkeypatch):
    """No Ray: a replication factor over the alive nodes is refused before any actor is
    created -- asked of a first deploy, or the running controller's own."""
    from raymq import deploy, rpc
    from raymq.actors.config import ClusterConfig
    from raymq.storage.errors import ConfigError

    def created(*args, **kwargs):
        raise AssertionError("an actor was created")

    def no_controller():
        raise ValueError("no controller")

    class Control:
        def __init__(self, handle):
            pass

        def call(self, method, *args, **kwargs):
            return ClusterConfig(replication_factor=3).to_dict() if method == "get_config" \
                else {}
    monkeypatch.setattr(rpc, "alive_nodes", lambda: ["node-0", "node-1"])
    monkeypatch.setattr(rpc, "gcs_address", lambda: "10.0.0.1:6379")
    monkeypatch.setattr(rpc, "create_actor", created)
    monkeypatch.setattr(rpc, "ControllerClient", Control)
    monkeypatch.setattr(deploy, "get_controller", no_controller)
    with pytest.raises(ConfigError, match=r"^replication_factor 3 needs 3 alive Ray nodes, the "
                                          r"cluster has 2: add nodes or lower it"):
        deploy.deploy(ClusterConfig(replication_factor=3))
    monkeypatch.setattr(deploy, "get_controller", lambda: "the controller")
    with pytest.raises(ConfigError, match=r"runs in the Ray cluster at 10.0.0.1:6379 with "
                                          r"replication_factor 3, .*`raymq down` first"):
        deploy.deploy(ClusterConfig())  # (the running settings count, not those asked)
    deploy.check_deployable(ClusterConfig(replication_factor=2))  # two nodes: fine


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
