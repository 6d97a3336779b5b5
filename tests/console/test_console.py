"""The web console's JSON against the session cluster: every page's data, every action
with and without the token, a read-only console's refusals, bad ids answered with a 4xx
and one line."""
from __future__ import annotations

import pytest

from tests import console_scene
from tests.console_scene import get, post
from tests.helpers import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def scene(mq):
    import uuid
    s = console_scene.build(mq, f"console{uuid.uuid4().hex[:6]}")
    yield s
    s.close()


@pytest.fixture(scope="module")
def server(mq, scene):
    srv = console_scene.serve(mq)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def read_only(mq, scene):
    srv = console_scene.serve(mq, read_only=True)
    yield srv
    srv.stop()


def test_overview_shows_every_shard_and_actor_alive_and_the_nodes(server, mq):
    status, d = get(server, "overview")
    assert status == 200
    assert [s["shard"] for s in d["shards"]] == list(range(mq.num_shards))
    assert all(s["alive"] and s["log_bytes"] > 0 for s in d["shards"])
    # disk used: the shard's files (log, indexes) as of its last 5-s report
    wait_for(lambda: all(s["disk_bytes"] >= s["log_bytes"] > 0
                         for s in get(server, "overview")[1]["shards"]), what="disk used")
    kinds = {a["kind"] for a in d["actors"] if a["alive"]}
    assert {"controller", "shard", "checker", "coordinator"} <= kinds
    assert any(n["alive"] and n["head"] for n in d["nodes"])
    wait_for(lambda: len(get(server, "overview")[1]["throughput"]["t"]) >= 2,
             what="two throughput samples")


def test_topics_show_each_queue_its_offsets_and_the_groups_lag(server, scene):
    _status, d = get(server, "topics")
    queues = d["topics"][scene.topic]["queues"]
    assert sorted(q["queue"] for q in queues) == [0, 1]
    # the 20 sent were consumed and committed; the open transaction's record is not
    assert sum(q["max_offset"] for q in queues) >= 20
    assert all(q["min_offset"] == 0 for q in queues)
    consumed = [q["max_offset"] - q["lag"][scene.group] for q in queues if scene.group in q["lag"]]
    assert sum(consumed) == 20  # (a queue the group never committed on has no lag entry)
    assert f"in:topic:{scene.topic}" in d["throughput"]


def test_a_message_is_found_by_id_and_by_key_with_its_trace(server, scene):
    sent = scene.sent[4]
    status, d = get(server, f"message?id={sent.msg_id}")
    assert status == 200 and d["found"] == 1
    [m] = d["messages"]
    assert m["topic"] == scene.topic and m["key"] == "k1"
    assert m["body"] == {"kind": "text", "text": "order 4", "bytes": 7, "truncated": False}
    steps = {(s["step"], s.get("group")) for s in m["trace"]}
    assert {("sent", None), ("stored", None), ("delivered", scene.group)} <= steps
    _status, by_key = get(server, f"message?topic={scene.topic}&key=k1")
    assert sorted(x["body"]["text"] for x in by_key["messages"]) == \
        sorted(f"order {i}" for i in range(20) if i % 3 == 1)


def test_the_dead_letter_is_traced_to_its_group(server, scene):
    letter = scene.dead_letter
    _status, d = get(server, f"message?id={letter.msg_id}")
    [m] = d["messages"]
    dead = [s for s in m["trace"] if s["step"] == "dead letter"]
    assert dead and "RuntimeError" in dead[0]["detail"]


def test_halves_transactions_timers_and_groups_show_the_scene(server, scene):
    _s, halves = get(server, "halves")
    assert scene.half_id in {h["id"] for h in halves["pending"] + halves["expired"]}
    _s, tx = get(server, "transactions")
    [mine] = [t for t in tx["transactions"] if t["transactional_id"] == scene.tid]
    assert mine["state"] == "ONGOING"
    assert any(h["transactional_id"] == scene.tid and h["behind"] >= 1 for h in tx["hanging"])
    _s, described = get(server, f"transactions/{scene.tid}")
    assert described["state"] == "ONGOING" and described["queues"]
    _s, timers = get(server, "timers")
    assert {b["due"]: b["count"] for b in timers["histogram"]}["next hour"] >= 1
    assert scene.timer_id in {t["msg_id"] for t in timers["soonest"]}
    _s, groups = get(server, "groups")
    assert groups["groups"][scene.group]["lag"] >= 0
    _s, dl = get(server, f"groups/dl{scene.topic}/dead-letters")
    assert [m["stored_id"] for m in dl["dead_letters"]] == [scene.dead_letter.stored_id]
    assert "RuntimeError" in dl["dead_letters"][0]["reason"]


def test_the_charted_figures_are_on_each_nodes_prometheus_endpoint(server, scene):
    """Ray exports RayMQ's metrics (``ray_raymq_*``) on each node's metrics port: the
    shards' gauges (reported every few seconds) and the clients' counters."""
    import urllib.request
    _s, d = get(server, "overview")
    [node] = [n for n in d["nodes"] if n["alive"]]
    url = f"http://{node['address']}:{node['metrics_port']}/metrics"
    wanted = ["ray_raymq_messages_stored", "ray_raymq_halves_pending",
              "ray_raymq_kafka_transactions_open", "ray_raymq_timers_scheduled",
              "ray_raymq_timer_delivery_lag_ms", "ray_raymq_messages_sent_total"]

    def lag_of_the_group():
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        lines = [line for line in text.splitlines() if line.startswith(
            "ray_raymq_consumer_lag{") and f'group="{scene.group}"' in line]
        return all(w in text for w in wanted) and lines
    lag = wait_for(lag_of_the_group, timeout_s=90, what="RayMQ's metrics on the node's endpoint")
    assert float(lag[0].rsplit(" ", 1)[1]) >= 0


@pytest.mark.parametrize("path", ["message?id=zzz", "message?id=00000000000000000001ff",
                                  "message", "transactions/no-such-id", "nosuch"])
def test_bad_ids_and_paths_are_a_4xx_with_one_line(server, path):
    status, d = get(server, path)
    assert 400 <= status < 500 and d["error"] and "\n" not in d["error"]


def test_actions_need_the_token(server, scene):
    for path in (f"halves/{scene.half_id}/commit", f"transactions/{scene.tid}/abort",
                 f"timers/{scene.timer_id}/cancel", f"groups/dl{scene.topic}/dead-letters/resend"):
        status, d = post(server, path, token=None)
        assert status == 401 and "token" in d["error"]
        status, d = post(server, path, token="wrong")
        assert status == 403 and "wrong access token" in d["error"]


def test_a_read_only_console_refuses_every_action_even_with_a_token(read_only, scene):
    _s, session = get(read_only, "session")
    assert session["read_only"]
    for path in (f"halves/{scene.half_id}/commit", f"transactions/{scene.tid}/abort",
                 f"timers/{scene.timer_id}/cancel", f"groups/dl{scene.topic}/dead-letters/resend"):
        status, d = post(read_only, path)
        assert status == 403 and "read-only" in d["error"]
    _s, halves = get(read_only, "halves")  # nothing was done
    assert scene.half_id in {h["id"] for h in halves["pending"] + halves["expired"]}


def test_actions_with_the_token_do_what_the_cli_does(server, scene, mq):
    """(Runs after the refusals above: file order.)"""
    status, d = post(server, "halves/nonsense/commit")
    assert status == 400 and "\n" not in d["error"]
    status, d = post(server, f"halves/{scene.half_id}/promote")
    assert status == 404
    # (first the open transaction: it holds its queue's last stable offset back)
    status, d = post(server, f"transactions/{scene.tid}/abort")
    assert status == 200 and d["result"] == "COMPLETE_ABORT"
    assert get(server, f"transactions/{scene.tid}")[1]["state"] == "COMPLETE_ABORT"

    status, d = post(server, f"halves/{scene.half_id}/commit")
    assert status == 200, d
    reader = mq.consumer(f"check{scene.topic}", [scene.topic], read_only=True)
    bodies = wait_for(lambda: [m.body for m in reader.poll(100, 0.5) if m.body == b"undecided"],
                      what="the committed half delivered")
    reader.close()
    assert bodies == [b"undecided"]
    status, d = post(server, f"halves/{scene.half_id}/rollback")  # decided already
    assert 400 <= status < 500 and "\n" not in d["error"]

    status, d = post(server, f"timers/{scene.timer_id}/cancel")
    assert status == 200 and d["result"] == "cancelled"
    assert post(server, f"timers/{scene.timer_id}/cancel")[1]["result"] == "already cancelled"
    assert post(server, f"timers/{scene.sent[0].msg_id}/cancel")[0] == 404  # never a timer

    group = f"dl{scene.topic}"
    status, d = post(server, f"groups/{group}/dead-letters/resend", body={"ids": "x"})
    assert status == 400
    status, d = post(server, f"groups/{group}/dead-letters/resend",
                     body={"ids": [scene.dead_letter.stored_id]})
    assert status == 200 and d["resent"] == [scene.dead_letter.stored_id]


def test_a_groups_offsets_are_reset_and_a_topic_deleted_with_the_token(server, mq):
    """(issue 35) The console's retention actions: token-gated, as the CLI does them."""
    import uuid
    from raymq import Message
    topic = f"cr{uuid.uuid4().hex[:8]}"
    mq.create_topic(topic, 1)
    p = mq.producer()
    for i in range(5):
        p.send(Message(topic, b"m%d" % i))
    path = f"groups/g{topic}/reset-offsets"
    assert post(server, path, token=None, body={"topic": topic, "to": "latest"})[0] == 401
    assert post(server, path, body={"to": "latest"})[0] == 400
    status, d = post(server, path, body={"topic": topic, "to": "latest", "dry_run": True})
    assert status == 200 and d["offsets"] == [{"queue": f"{topic}/0", "before": -1, "after": 5}]
    assert mq.shard(mq.routes_for({topic})[topic][0]).call(
        "get_offsets", f"g{topic}", [(topic, 0)], timeout_s=30) == {(topic, 0): -1}
    status, d = post(server, path, body={"topic": topic, "to": "offset", "value": 2})
    assert status == 200 and d["offsets"][0]["after"] == 2
    assert post(server, path, body={"topic": topic, "to": "sideways"})[0] == 400
    _s, topics = get(server, "topics")
    assert topics["topics"][topic]["retention_ms"] == 3 * 24 * 3600_000
    assert post(server, f"topics/{topic}/delete", token="wrong")[0] == 403
    status, d = post(server, f"topics/{topic}/delete")
    assert status == 200 and d["topic"] == topic
    assert post(server, f"topics/{topic}/delete")[0] == 404
    assert topic not in get(server, "topics")[1]["topics"]
