"""Tests of the cluster configuration (``raymq.actors.config``, ``raymq config``), the
placement resources and the ray up file (no Ray)."""
from __future__ import annotations

import os

import pytest

from raymq.actors.config import ClusterConfig, parse_delay_levels
from raymq.placement import node_resources
from raymq.storage.errors import ConfigError
from tests.helpers import ROOT



def test_default_delay_levels_are_rocketmqs_18():
    levels = ClusterConfig().delay_levels_ms
    assert len(levels) == 18
    assert levels[:4] == (1000, 5000, 10_000, 30_000) and levels[-1] == 7_200_000
    assert parse_delay_levels("100ms 2s 1m 1h 1d") == (100, 2000, 60_000, 3_600_000, 86_400_000)


@pytest.mark.parametrize("bad, match", [
    ({"delay_levels": "5s 1s"}, "must not decrease"),
    ({"delay_levels": "5 seconds"}, "bad delay level"),
    ({"num_shards": 0}, "num_shards"),
    ({"retry_first_level": 30}, "past the last delay level"),
    ({"session_timeout_ms": 100, "heartbeat_interval_ms": 200}, "longer than"),
    ({"flush_mode": "never"}, "flush_mode"),
    ({"shards": 3}, "unknown ClusterConfig key"),
    ({"auto_create_topics": "yes"}, "true or false"),
])
def test_bad_config_is_rejected(bad, match):
    with pytest.raises(ConfigError, match=match):
        ClusterConfig.from_dict(bad)


def test_every_config_field_is_documented():
    assert all(doc for _name, _default, doc in ClusterConfig.describe())


def test_placement_resources_cover_every_shard_once():
    nodes, shards = 3, 7
    per_node = [node_resources(j, nodes, shards) for j in range(nodes)]
    names = [r for res in per_node for r in res if r.startswith("raymq_shard_")]
    assert sorted(names) == sorted(f"raymq_shard_{i}" for i in range(shards))
    assert "raymq_controller" in per_node[0] and "raymq_controller" not in per_node[1]


def test_ray_up_file_is_a_local_provider_cluster_that_installs_the_project():
    import yaml  # ships with ray
    with open(os.path.join(ROOT, "ray_config.yaml")) as f:
        cfg = yaml.safe_load(f)
    assert cfg["provider"]["type"] == "local" and cfg["provider"]["worker_ips"]
    assert any(".ci/install.sh" in c for c in cfg["setup_commands"])
    assert any("raymq.placement" in c for c in cfg["head_start_ray_commands"])
    assert any("raymq.placement" in c for c in cfg["worker_start_ray_commands"])


def test_metrics_never_raise_even_for_values_ray_refuses():
    from raymq.metrics import RayMetrics
    m = RayMetrics(shard="0")
    m.inc("test_counter", 0)      # ray refuses 0 for counters: skipped
    m.inc("test_counter", 2, group="g")
    m.set("test_gauge", 1.5)
    m.observe("test_hist", 12.0)
    assert set(m._made) == {"test_counter", "test_gauge", "test_hist"}


# ------------------------------------------------------------ the config as a model
def test_config_pickles_compares_and_hashes_by_value_and_round_trips_as_a_dict():
    import pickle

    import cloudpickle  # what Ray uses
    cfg = ClusterConfig(num_shards=3, linger_ms=2, auto_create_topics=True)
    for copy in (pickle.loads(pickle.dumps(cfg)), cloudpickle.loads(cloudpickle.dumps(cfg)),
                 ClusterConfig.from_dict(cfg.to_dict())):
        assert copy == cfg and hash(copy) == hash(cfg)
        assert copy.delay_levels_ms == cfg.delay_levels_ms and len(copy.delay_levels_ms) == 18
    assert cfg != ClusterConfig(num_shards=4) and ClusterConfig() == ClusterConfig()
    assert type(cfg.to_dict()) is dict and cfg.to_dict()["num_shards"] == 3
    assert set(cfg.to_dict()) == {name for name, _d, _doc in ClusterConfig.describe()}
    with pytest.raises(Exception, match="frozen"):
        cfg.num_shards = 5
    assert cfg.num_shards == 3


def test_delay_levels_are_parsed_once_when_the_config_is_made(monkeypatch):
    import pickle

    from raymq.actors import config as config_mod
    calls = []
    real = config_mod.parse_delay_levels

    def counted(text):
        calls.append(text)
        return real(text)
    monkeypatch.setattr(config_mod, "parse_delay_levels", counted)
    cfg = ClusterConfig(delay_levels="1s 2s 3s")
    copy = pickle.loads(pickle.dumps(cfg))
    for _ in range(5):
        assert cfg.delay_levels_ms == copy.delay_levels_ms == (1000, 2000, 3000)
    assert calls == ["1s 2s 3s"]


@pytest.mark.parametrize("bad, field", [
    ({"shards": 3}, "shards"),                       # an unknown key
    ({"num_shards": 2, "nmu_shards": 3}, "nmu_shards"),
    ({"linger_ms": -1}, "linger_ms"),                # below its bound
    ({"num_shards": True}, "num_shards"),            # a bool is not a count
    ({"send_retries": "3"}, "send_retries"),         # nor a string
    ({"send_timeout_ms": 1.5}, "send_timeout_ms"),   # nor a float
    ({"auto_create_topics": 1}, "auto_create_topics"),
    ({"transport": "tcp"}, "transport"),
    ({"flush_mode": "never"}, "flush_mode"),
    ({"data_dir": 5}, "data_dir"),
    ({"delay_levels": "5 seconds"}, "delay_levels"),
    ({"delay_levels": ""}, "delay_levels"),
    ({"segment_size_bytes": 1 << 20}, "segment_size_bytes"),  # the storage's own rule
    ({"retry_first_level": 19}, "retry_first_level"),
    ({"session_timeout_ms": 500}, "session_timeout_ms"),
])
def test_an_unknown_key_or_a_bad_value_is_one_config_error_line_naming_it(bad, field):
    for make in (ClusterConfig.from_dict, lambda d: ClusterConfig(**d)):
        with pytest.raises(ConfigError) as err:
            make(bad)
        text = str(err.value)
        assert field in text and "\n" not in text
        assert "pydantic" not in text  # our words, not the library's report
        assert err.value.code == "CONFIG_INVALID"


def test_every_field_refuses_a_value_of_the_wrong_type():
    """A new field cannot go unvalidated: each one has a type that is checked (and every
    integer refuses a bool, as before)."""
    for name, _default, _doc in ClusterConfig.describe():
        with pytest.raises(ConfigError, match=name):
            ClusterConfig(**{name: object()})
        if ClusterConfig.model_fields[name].annotation is int:
            with pytest.raises(ConfigError, match=name):
                ClusterConfig(**{name: True})
            assert ClusterConfig.type_text(name).startswith("int >= ")


def test_the_choices_are_the_ones_the_storage_and_the_sdk_know():
    from typing import get_args

    from raymq.actors.config import TRANSPORTS
    from raymq.storage.config import FLUSH_MODES
    assert get_args(ClusterConfig.model_fields["flush_mode"].annotation) == FLUSH_MODES
    assert TRANSPORTS == ("direct", "ray")
    assert ClusterConfig.type_text("transport") == "'direct' | 'ray'"
    with pytest.raises(ConfigError, match="mapping"):
        ClusterConfig.from_dict([("num_shards", 2)])


def _cli(*args, cwd=ROOT):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "raymq.tools.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_cli_config_describe_prints_every_field_with_its_type_and_default():
    import json
    proc = _cli("config", "--describe")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name, default, doc in ClusterConfig.describe():
        head = [line for line in lines if line.startswith(f"{name}  (")]
        assert head == [f"{name}  ({ClusterConfig.type_text(name)})  "
                        f"default: {json.dumps(default)}"], name
        assert doc.split()[0] in lines[lines.index(head[0]) + 1]
    assert "session_timeout_ms > heartbeat_interval_ms" in proc.stdout  # the rules too
    helped = _cli("config", "--help")
    assert helped.returncode == 0 and "--describe" in helped.stdout


def test_cli_config_checks_a_settings_file(tmp_path):
    import json
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"num_shards": 3}))
    proc = _cli("--config", str(good), "config")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ClusterConfig(num_shards=3).to_dict()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"num_shards": 0}))
    proc = _cli("--config", str(bad), "config")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["raymq: CONFIG_INVALID: num_shards must be an integer "
                                        ">= 1, got 0"]
