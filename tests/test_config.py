"""Cluster configuration, placement resources and the ray up file (no Ray)."""
from __future__ import annotations

import os

import pytest

from raymq.actors.config import ClusterConfig, parse_delay_levels
from raymq.placement import node_resources
from raymq.storage.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
