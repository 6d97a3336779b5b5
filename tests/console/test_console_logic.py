"""The console's pure parts, without Ray: counters and rates for the charts, the timer
histogram, body previews, a message's trace, the replicated groups' candidacy, and how
errors become HTTP statuses."""
from __future__ import annotations

from types import SimpleNamespace

from raymq.storage.errors import (AlreadyDeliveredError, BrokerUnavailableError,
                                  InvalidMessageError, InvalidTxnStateError,
                                  NotScheduledError, UnknownTopicError)
from raymq.tools.console import http_status, one_line
from raymq.tools.console_cluster import kind_of
from raymq.tools.console_pages import (History, counters_of, preview, replication_of,
                                       timer_histogram, trace)
from tests.helpers import ROOT


def status(depths: dict, lags: dict, timers: dict | None = None, shard: int = 0) -> dict:
    return {"shards": [{"shard": shard, "node": "n", "info": {
        "queues": depths, "lag": lags, "timers": timers or {}}}]}


def test_counters_count_user_topics_in_and_out_and_gauge_each_groups_lag():
    st = status({"orders/0": 10, "orders/1": 5, "%RETRY%g/0": 7},
                {"g": {"orders/0": 4, "orders/1": 0, "%RETRY%g/0": 7}})
    c = counters_of(st)
    assert c["in"] == 15 and c["in:shard-0"] == 15 and c["in:topic:orders"] == 15
    assert c["out"] == 11  # 6 of queue 0 and 5 of queue 1 consumed; retries left out
    assert c["lag:g"] == 4


def test_an_unavailable_shard_counts_nothing():
    st = {"shards": [{"shard": 0, "node": None, "info": {"error": "gone"}}]}
    assert counters_of(st) == {}


def test_history_gives_per_second_rates_and_gauges_and_keeps_a_bounded_window():
    h = History(keep=3)
    h.add(0, {"in": 0, "lag:g": 5})
    h.add(2000, {"in": 100, "lag:g": 7})
    h.add(4000, {"in": 50, "lag:g": 1})  # a shard restarted: its count went back
    s = h.series(["in", "lag:g"])
    assert s == {"t": [2.0, 4.0], "in": [50.0, 0.0], "lag:g": [7, 1]}
    assert h.last_rate("in") == 0.0
    h.add(6000, {"in": 80})
    assert len(h) == 3 and h.series(["in"])["t"] == [4.0, 6.0]


def test_history_of_one_sample_draws_nothing():
    h = History()
    h.add(0, {"in": 3})
    assert h.series(["in"]) == {"t": [], "in": []} and h.last_rate("in") == 0.0


def test_the_timer_histogram_sums_every_shard_by_due_time():
    st = status({}, {}, {"next_minute": 2, "next_hour": 1, "next_day": 0, "later": 4})
    st["shards"] += status({}, {}, {"next_minute": 1, "next_hour": 0, "next_day": 3,
                                    "later": 0}, shard=1)["shards"]
    st["shards"].append({"shard": 2, "node": None, "info": {"error": "down"}})
    assert timer_histogram(st) == [{"due": "next minute", "count": 3},
                                   {"due": "next hour", "count": 1},
                                   {"due": "next day", "count": 3},
                                   {"due": "later", "count": 4}]


def test_a_body_previews_as_text_or_as_hex_and_says_when_cut():
    assert preview(b"hello") == {"kind": "text", "text": "hello", "bytes": 5,
                                 "truncated": False}
    binary = preview(b"\xff\x00\x01")
    assert binary["kind"] == "hex" and binary["text"] == "ff 00 01"
    long = preview(b"a" * 2000)
    assert long["truncated"] and len(long["text"]) == 512 and long["bytes"] == 2000


def test_a_trace_says_which_groups_consumed_the_message_and_where_it_died():
    msg = SimpleNamespace(born_ms=1, store_ms=2, topic="t", queue_id=0, queue_offset=5,
                          shard=1, reconsume_count=2)
    steps = trace(msg, {"done": 6, "behind": 5},
                  {"done": {"id": "x", "store_ms": 9, "reason": "boom"}})
    kinds = [(s["step"], s.get("group")) for s in steps]
    assert kinds == [("sent", None), ("stored", None), ("not consumed yet", "behind"),
                     ("delivered", "done"), ("retried", None), ("dead letter", "done")]


def test_errors_become_4xx_statuses_with_one_line():
    assert http_status(InvalidMessageError("bad id")) == 400
    assert http_status(InvalidMessageError("no such message: x")) == 404
    assert http_status(UnknownTopicError("topic t")) == 404
    assert http_status(NotScheduledError("message x is not a delayed or timer message")) == 404
    assert http_status(InvalidTxnStateError("no transactional id 'x' here")) == 404
    assert http_status(InvalidTxnStateError("it committed")) == 409
    assert http_status(AlreadyDeliveredError("delivered")) == 409
    assert http_status(BrokerUnavailableError("gone")) == 503
    assert http_status(RuntimeError("?")) == 500
    assert one_line(ValueError("first\nsecond")) == "first"


def test_actor_kinds_from_their_names():
    assert [kind_of(n) for n in ("shard-3", "shard-0-r1", "coordinator-0-r2", "controller",
                                 "checker-1", "registry-0", "something")] == [
        "shard", "shard replica", "coordinator replica", "controller", "checker",
        "registry", "other"]


def test_the_overview_shows_who_could_be_elected_now_and_why_the_others_could_not():
    """Shards' and coordinators' groups, from ``admin.status()`` over the controller's
    replica groups (``tests.replica_fakes``)."""
    from tests.replica_fakes import Scene
    scene = Scene()

    def overview() -> dict:
        return replication_of({"shards": [], "replicas": scene.admin.replicas(),
                               "coordinator_replicas": scene.admin.coordinator_replicas()})
    ov = overview()
    [shard], [coordinator] = ov["replicas"], ov["coordinator_replicas"]
    assert (shard["group"], shard["shard"], coordinator["group"], coordinator["coordinator"]) \
        == ("shard-0", 0, "coordinator-0", 0)
    for kind, g in (("shard", shard), ("coordinator", coordinator)):
        assert g["leader"] == f"{kind}-0-r0" and g["electable"] == [f"{kind}-0-r1"]
        assert g["not_electable"] == {f"{kind}-0-r2": "not in sync"}
        assert [r["candidacy"] for r in g["replicas"]] == ["leader", "electable", "not in sync"]
        assert [r["log_end"] for r in g["replicas"]] == [500, 500, 200]
    scene.lose_in_sync()
    for kind, [g] in (("shard", overview()["replicas"]),
                      ("coordinator", overview()["coordinator_replicas"])):
        assert g["electable"] == [] and g["not_electable"] == {
            f"{kind}-0-r0": "not alive", f"{kind}-0-r1": "not alive",
            f"{kind}-0-r2": "not in sync"}
        assert g["electable_line"].startswith("electable now: none; not: ") and \
            f"`raymq {kind} elect 0 --unclean`" in g["electable_line"]
    # an unreplicated cluster's status has no groups
    assert replication_of({"shards": []}) == {"replicas": [], "coordinator_replicas": []}


def test_a_shards_gauges_count_what_it_holds(tmp_path):
    """``shard_gauges`` over a real shard (no Ray): stored messages, a group's lag, a
    pending half, and no open transaction or timer."""
    from raymq.actors.metrics import replication_gauges, shard_gauges
    from raymq.actors.shard import BrokerShard
    from tests.rocketmq_tx.test_shard_ends import tx_batch
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    try:
        sh.set_routes([("orders", 0), ("orders", 1)])
        sh.send(tx_batch("orders", 3, 0), 77, 1)  # three half messages, not ended
        sh.commit_offsets("g", {("orders", 0): 0})
        gauges = {(n, tuple(t.items())): v for n, v, t in shard_gauges(sh)}
        assert gauges[("halves_pending", ())] == 3
        assert gauges[("kafka_transactions_open", ())] == 0
        assert gauges[("timers_scheduled", ())] == 0
        assert gauges[("consumer_lag", (("group", "g"),))] == 0  # halves are not in queues
        assert gauges[("messages_stored", ())] >= 3
    finally:
        sh.close()
    assert replication_gauges({"lag_bytes": {"shard-0-r1": 10}, "in_sync": ["a", "b"]}) == [
        ("replication_lag_bytes", 10.0, {"follower": "shard-0-r1"}),
        ("replicas_in_sync", 2.0, {})]


def reported_metric_names() -> set[str]:
    """Every metric name RayMQ's code records (``metrics.inc/set/observe("name"`` and the
    gauges ``shard_gauges`` and ``replication_gauges`` report)."""
    import os
    import re
    root = ROOT
    names = set()
    for folder in ("actors", "cluster"):
        for dirpath, _dirs, files in os.walk(os.path.join(root, folder)):
            for f in files:
                if f.endswith(".py"):
                    text = open(os.path.join(dirpath, f)).read()
                    names |= set(re.findall(r'metrics\.(?:inc|set|observe)\("([a-z_]+)"', text))
                    names |= set(re.findall(r'\("([a-z_]+)", float\(', text))
    return names


def dashboard_metrics() -> set[str]:
    import json
    import os
    import re
    from raymq.tools import console
    path = os.path.join(os.path.dirname(console.STATIC), "grafana", "raymq-dashboard.json")
    with open(path) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return {m for e in exprs for m in re.findall(r"ray_raymq_([a-z_]+?)(?:_total|_bucket)?\b", e)}


def test_the_grafana_dashboard_charts_only_metrics_raymq_reports_and_the_readme_lists_them():
    import os
    charted = dashboard_metrics()
    assert len(charted) >= 15
    assert charted - reported_metric_names() == set()
    readme = open(os.path.join(ROOT,
                               "README.md")).read()
    assert sorted(m for m in charted if f"ray_raymq_{m}" not in readme) == []


def test_disk_usage_counts_allocated_bytes_not_a_files_length(tmp_path):
    import os

    from raymq.storage.fileutil import disk_usage
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "data").write_bytes(os.urandom(10_000))
    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(64 * 1024 * 1024)  # 64 MiB long, nothing written: no block allocated
    used = disk_usage(str(tmp_path))
    assert 10_000 <= used < 1024 * 1024
