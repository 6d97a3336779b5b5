"""The command line against the session cluster (Ray already initialised here); the
replicated groups' views and elections without Ray, over ``tests.replica_fakes``."""
from __future__ import annotations

import json

import pytest

from raymq import LocalTransactionState as S
from raymq import Message, TransactionListener
from raymq.tools.cli import main
from tests.helpers import wait_for
from tests.helpers import ROOT

pytestmark = pytest.mark.ray


def test_topic_send_consume_status_msg(mq, name, capsys):
    assert main(["topic", "create", name, "--queues", "2"]) == 0
    assert f"topic {name}: 2 queues" in capsys.readouterr().out
    assert main(["topic", "list"]) == 0
    assert name in capsys.readouterr().out
    assert main(["send", name, "hello", "world", "--key", "k1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("SEND_OK") for line in lines)
    msg_id = lines[0].split("\t")[1]
    assert main(["consume", name, "--group", f"g{name}", "--max", "2", "--timeout", "20"]) == 0
    out = capsys.readouterr().out
    assert "hello" in out and "world" in out
    assert main(["msg", "show", msg_id]) == 0
    assert '"body": "hello"' in capsys.readouterr().out
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "shards: 2" in out and name in out and f"g{name}" in out
    assert "pending halves" in out
    assert main(["up"]) == 0  # deploying again is harmless
    assert "RayMQ is up: controller + 2 shards" in capsys.readouterr().out


def test_cli_errors_are_clear(mq, name, capsys):
    assert main(["send", f"{name}-nope", "x"]) == 1
    assert "TOPIC_NOT_EXIST" in capsys.readouterr().err
    assert main(["msg", "show", "zz"]) == 1
    assert "not a RayMQ message id" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["topic"])  # an action is required


class Undecided(TransactionListener):
    """Never decides: its transactions are left to check-backs, which it cannot answer."""

    def execute_local_transaction(self, msg, arg):
        return S.UNKNOW

    def check_local_transaction(self, msg):
        return S.UNKNOW


def test_half_list_and_operator_rollback(mq, name, capsys):

    mq.create_topic(name, queues=1)
    tp = mq.transaction_producer(f"p{name}", Undecided())
    res = tp.send_in_transaction(Message(name, b"x"), None)
    tp.close()  # nobody left to answer: the half waits, uncounted
    def listed():
        assert main(["half", "list"]) == 0
        return [x for x in capsys.readouterr().out.splitlines() if res.msg_id in x]
    # (a round may have checked it once while the producer was still live)
    [line] = wait_for(lambda: [x for x in listed() if "waiting: no live producer" in x],
                      what="the half shown waiting for a producer")
    assert f"group=p{name}" in line and f"topic={name}" in line and "\tage=" in line
    assert "checks=0" in line or "checks=1" in line
    assert main(["half", "rollback", res.msg_id]) == 0
    assert capsys.readouterr().out.strip() == "ROLLED_BACK"
    assert main(["half", "list"]) == 0
    assert res.msg_id not in capsys.readouterr().out
    assert main(["half", "commit", "zz"]) == 1
    assert "not a RayMQ message id" in capsys.readouterr().err


def test_an_operator_end_that_conflicts_is_refused_saying_what_the_half_became(mq, name, capsys):
    """Rolling back a half already committed is not a silent NOOP like a duplicate."""
    mq.create_topic(name, queues=1)
    tp = mq.transaction_producer(f"p{name}", Undecided())
    res = tp.send_in_transaction(Message(name, b"x"), None)
    tp.close()
    assert main(["half", "commit", res.msg_id]) == 0
    assert capsys.readouterr().out.strip() == "COMMITTED"
    assert main(["half", "commit", res.msg_id]) == 0  # a duplicate: nothing happens
    assert capsys.readouterr().out.strip() == "NOOP"
    assert main(["half", "rollback", res.msg_id]) == 1
    err = capsys.readouterr().err.strip()
    assert "already COMMITTED" in err and res.msg_id in err and len(err.splitlines()) == 1


def test_expired_half_listed_and_committed_by_an_operator(mq, name, capsys):

    mq.create_topic(name, queues=1)
    tp = mq.transaction_producer(f"p{name}", Undecided())  # live, never decides
    res = tp.send_in_transaction(Message(name, b"stuck"), None)

    def expired_line():
        assert main(["half", "list", "--expired"]) == 0
        return [x for x in capsys.readouterr().out.splitlines() if res.msg_id in x]
    [line] = wait_for(expired_line, what="the half expired after the maximum checks")
    assert "EXPIRED" in line and f"checks={mq.config.txn_max_checks}" in line
    assert main(["half", "commit", res.msg_id]) == 0
    assert capsys.readouterr().out.strip() == "COMMITTED"
    assert main(["half", "commit", res.msg_id]) == 0  # again: nothing more happens
    assert capsys.readouterr().out.strip() == "NOOP"
    assert expired_line() == []
    assert main(["consume", name, "--group", f"g{name}", "--max", "1", "--timeout", "20"]) == 0
    assert capsys.readouterr().out.count("stuck") == 1
    tp.close()


def test_bench_storage_prints_only_json_lines_on_stdout(tmp_path):
    import json
    import subprocess
    import sys
    root = ROOT
    proc = subprocess.run([sys.executable, "-m", "raymq.tools.cli", "bench", "storage", "--scale",
                           "0.02", "--workdir", str(tmp_path)], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    names = {d["metric"] for d in lines}
    assert {"storage.append_sync_b1", "storage.append_sync_b100", "storage.append_sync_b1000",
            "storage.raw_write_fsync_b1000", "storage.append_sync_ratio", "storage.append_async",
            "storage.read_cq"} <= names
    assert all(set(d) == {"metric", "value", "unit", "params"} for d in lines)
    assert "[bench]" in proc.stderr


def test_bench_machine_cpu_counts_the_work_it_times():
    import sys
    import time

    from raymq.tools.bench import MachineCpu
    if not sys.platform.startswith("linux"):
        return  # /proc/stat only; elsewhere the figures are left out
    cpu = MachineCpu()

    def spin():
        end = time.thread_time() + 0.3  # 0.3 s of this thread's own CPU, however slow the host
        while time.thread_time() < end:
            pass
    dt = cpu.timed(spin)
    assert cpu.busy_s >= 0.25 and dt >= 0.3
    params = cpu.params(1000, dt)
    assert params["cpu_us_per_msg"] == round(cpu.busy_s / 1000 * 1e6, 1) >= 250
    assert 0 <= params["steal_pct"] <= 100
    assert MachineCpu().params(1000, 1.0) == {}  # nothing timed: nothing claimed


@pytest.mark.slow
def test_bench_txmsg_prints_its_figures(tmp_path):
    """The issue's metric names, a check-back that settled, and a ratio of its own figures.
    (Its own local Ray in a subprocess: the bench deploys a RayMQ of its own.)"""
    import json
    import os
    import subprocess
    import sys
    root = ROOT
    proc = subprocess.run([sys.executable, "-m", "raymq.tools.cli", "bench", "txmsg", "--scale",
                           "0.02", "--workdir", str(tmp_path)], cwd=root, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {d["metric"]: d for d in map(json.loads, proc.stdout.splitlines())}
    assert {"txmsg.p1", "txmsg.p8", "txmsg.plain_p8", "txmsg.vs_plain_ratio",
            "txmsg.async_p1", "txmsg.checkback_resolution_ms"} <= set(got)
    for name in ("txmsg.p1", "txmsg.p8", "txmsg.plain_p8", "txmsg.async_p1"):
        assert got[name]["value"] > 0 and got[name]["unit"] == "msgs/s"
    ratio = got["txmsg.p8"]["value"] / got["txmsg.plain_p8"]["value"]
    assert got["txmsg.vs_plain_ratio"]["value"] == pytest.approx(ratio, abs=0.001)
    check = got["txmsg.checkback_resolution_ms"]
    # settled by a check-back: not before the transaction timeout, every one of them
    assert check["value"] >= check["params"]["txn_timeout_ms"] and check["params"]["n"] == 20
    assert got["txmsg.p8"]["params"]["requests"] > 0
    assert got["txmsg.p1_ratio"]["value"] == pytest.approx(
        got["txmsg.p1"]["value"] / got["txmsg.plain_p1"]["value"], abs=0.001)
    # Redis's outbox as the baseline where redis-server is installed (CI installs it)
    from raymq.tools.bench_redis import unavailable
    why = unavailable()
    if why:
        assert f"the Redis outbox baseline is skipped: {why}" in proc.stderr
        assert "txmsg.vs_redis_p1" not in got
    else:
        for k in ("1", "8"):
            base = got[f"txmsg.redis_outbox_p{k}"]
            assert base["value"] > 0 and base["params"]["appendfsync"] == "always"
            assert got[f"txmsg.vs_redis_p{k}"]["value"] == pytest.approx(
                got[f"txmsg.p{k}"]["value"] / base["value"], abs=0.001)


def _bench_figures(suite: str, tmp_path, scale: str) -> dict:
    """``raymq bench SUITE`` in a subprocess (its own local Ray: the bench deploys a RayMQ
    of its own); its figures by metric name."""
    import json
    import os
    import subprocess
    import sys
    root = ROOT
    proc = subprocess.run([sys.executable, "-m", "raymq.tools.cli", "bench", suite, "--scale",
                           scale, "--workdir", str(tmp_path)], cwd=root, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {d["metric"]: d for d in map(json.loads, proc.stdout.splitlines())}


@pytest.mark.slow
def test_bench_kafkatx_prints_the_issues_metric_names(tmp_path):
    got = _bench_figures("kafkatx", tmp_path, "0.02")
    for per_txn in (10, 100, 1000):
        tx, plain = got[f"kafkatx.b{per_txn}"], got[f"kafkatx.plain_b{per_txn}"]
        assert tx["unit"] == plain["unit"] == "msgs/s" and tx["value"] > 0
        assert got[f"kafkatx.b{per_txn}_ratio"]["value"] == pytest.approx(
            tx["value"] / plain["value"], abs=0.001)
    assert got["kafkatx.interval100ms_ratio"]["value"] > 0
    assert got["kafkatx.read_committed_ratio"]["value"] > 0
    p50, p99 = got["kafkatx.commit_p50_ms"], got["kafkatx.commit_p99_ms"]
    assert 0 < p50["value"] <= p99["value"] and p99["params"]["shards"] == 3
    # issue 27's figures: each a ratio of two figures of the same run
    for ratio, num, den in (("b100_3shards_ratio", "b100_3shards", "plain_b100_3shards"),
                            ("p1_latency_ratio", "p1_latency_ms", "plain_p1_latency_ms"),
                            ("eos_b100_ratio", "eos_b100", "plain_eos_b100")):
        assert got[f"kafkatx.{num}"]["value"] > 0 and got[f"kafkatx.{den}"]["value"] > 0
        assert got[f"kafkatx.{ratio}"]["value"] == pytest.approx(  # (figures printed
            got[f"kafkatx.{num}"]["value"] / got[f"kafkatx.{den}"]["value"], rel=0.01)  # rounded)
    assert got["kafkatx.b100_3shards"]["params"]["shards"] == 3


@pytest.mark.slow
@pytest.mark.spark
def test_bench_spark_prints_the_issues_metric_names(tmp_path):
    got = _bench_figures("spark", tmp_path, "0.001")
    committed, raw = got["spark.committed_rows_per_s"], got["spark.raw_rows_per_s"]
    assert committed["unit"] == raw["unit"] == "rows/s" and committed["params"]["n"] == 10_000
    assert got["spark.handoff_ratio"]["value"] == pytest.approx(
        committed["value"] / raw["value"], abs=0.001)
    assert got["spark.order_income_rows_per_s"]["value"] > 0


@pytest.mark.slow
def test_bench_console_prints_the_issues_metric_names(tmp_path):
    """Issue 28's figures: produce with and without a console (a process of its own)
    polling every page, and each page's time on a cluster of many topics and groups."""
    got = _bench_figures("console", tmp_path, "0.05")
    polled, alone = got["console.produce_polled"], got["console.produce_alone"]
    assert polled["value"] > 0 and alone["value"] > 0 and polled["params"]["page_reads"] > 0
    assert got["console.produce_ratio"]["value"] == pytest.approx(
        polled["value"] / alone["value"], rel=0.01)
    slowest = got["console.slowest_page_ms"]
    assert slowest["value"] > 0 and slowest["params"]["topics"] == 50
    assert slowest["params"]["groups"] == 10


# ------------------------------------------- replicated groups (no Ray: tests.replica_fakes)
def _on_scene(monkeypatch):
    from raymq.tools import cli
    from tests.replica_fakes import Scene
    scene = Scene()
    monkeypatch.setattr(cli, "_connect", lambda args: scene.mq)
    return scene


def test_status_shows_who_could_be_elected_and_why_not_for_shards_and_coordinators(
        monkeypatch, capsys):
    scene = _on_scene(monkeypatch)
    admin = scene.admin
    monkeypatch.setattr(admin, "status", lambda: {
        "transport": {"name": "ray", "why": "test"}, "shards": [], "topics": {},
        "groups": {}, "transactions": [], "replicas": admin.replicas(),
        "coordinator_replicas": admin.coordinator_replicas()})
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    for kind in ("shard", "coordinator"):
        assert f"    electable now: {kind}-0-r1; not: {kind}-0-r2 (not in sync)\n" in out
        node = f"node-{kind}-0-r2"[:12]  # (node ids are shown by their first characters)
        assert f"    {kind}-0-r2: follower node {node} alive  lag 300 bytes  (not in sync)\n" \
            in out
    assert "\ncoordinator replicas:\n  coordinator-0: leader on node" in out
    scene.lose_in_sync()
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    for kind in ("shard", "coordinator"):
        assert (f"    electable now: none; not: {kind}-0-r0 (not alive); {kind}-0-r1 (not "
                f"alive); {kind}-0-r2 (not in sync) -- `raymq {kind} elect 0 --unclean` "
                "elects an alive replica anyway") in out
    assert main(["status", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["coordinator_replicas"][0]["candidacy"] == {
        "coordinator-0-r0": "not alive", "coordinator-0-r1": "not alive",
        "coordinator-0-r2": "not in sync"}


def test_shard_and_coordinator_elect_refused_then_unclean_says_what_may_be_lost(
        monkeypatch, capsys):
    scene = _on_scene(monkeypatch)
    assert main(["shard", "elect", "0"]) == 0  # the in-sync follower
    assert capsys.readouterr().out == \
        "shard-0: leader on node node-shard-0 (shard-0-r1), epoch 2\n"
    assert main(["coordinator", "elect", "0", "--to", "node-coord"]) == 1  # three nodes so
    err = capsys.readouterr().err.strip()
    assert "no replica of coordinator-0 named 'node-coord'" in err and "\n" not in err
    assert main(["coordinator", "elect", "0", "--to", "coordinator-0-r1"]) == 0
    assert "coordinator-0: leader on node node-coordin (coordinator-0-r1), epoch 2" in \
        capsys.readouterr().out
    assert scene.forgotten == [("shard", 0), ("coordinator", 0)]
    scene.lose_in_sync()
    for kind in ("shard", "coordinator"):
        assert main([kind, "elect", "0"]) == 1  # nobody in sync alive: refused, saying why
        err = capsys.readouterr().err.strip()
        assert err.startswith("raymq: NOT_ENOUGH_REPLICAS") and "\n" not in err, err
        assert f"{kind}-0-r1: not alive; {kind}-0-r2: not in sync" in err
        assert main([kind, "elect", "0", "--unclean"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines == [
            f"{kind}-0: leader on node {f'node-{kind}-0-r2'[:12]} ({kind}-0-r2), epoch 3",
            f"unclean election: {kind}-0-r2 was not in sync; records acknowledged after it "
            f"fell behind (up to 300 bytes: its log ends at 200, the old leader's "
            f"({kind}-0-r1) at 500) may be lost"]
    assert main(["shard", "elect", "0", "--unclean"]) == 1  # r2 leads; nobody else alive
    capsys.readouterr()


def test_an_unclean_election_says_what_may_be_lost_in_one_line():
    from raymq.replica_view import unclean_note

    def group(leader, ends, candidacy):
        return {"leader": leader, "candidacy": candidacy,
                "replicas": [{"name": r, "log_end": e} for r, e in ends.items()]}
    assert unclean_note(group("a", {"a": 9, "b": 9}, {"a": "not alive", "b": "electable"}),
                        "b") == "unclean election: b was in sync; nothing acknowledged is lost"
    # no leader (a new disk took it): the most another replica reported
    note = unclean_note(group(None, {"a": 700, "b": 100, "c": None},
                              {"a": "not alive", "b": "its log lacks epoch 3 (holds up to "
                               "epoch 2: a new disk?)", "c": "not alive"}), "b")
    assert note == ("unclean election: b was not electable (its log lacks epoch 3 (holds up "
                    "to epoch 2: a new disk?)); records acknowledged after it fell behind (up "
                    "to 600 bytes: its log ends at 100, a's (the most another replica "
                    "reported) at 700) may be lost")
    note = unclean_note(group("b", {"a": None, "b": 5}, {"a": "not alive", "b": "not in "
                                                         "sync"}), "b")
    assert "how many is unknown" in note and "\n" not in note


def test_elect_help_explains_unclean_and_shows_the_defaults(monkeypatch):
    from raymq.tools.cli import build_parser, command_tree
    monkeypatch.setenv("COLUMNS", "300")  # (no line broken at a hyphen)
    helps = {path: " ".join(p.format_help().split())
             for path, p, _line in command_tree(build_parser())}
    for kind in ("shard", "coordinator"):
        text = helps[f"raymq {kind} elect"]
        assert "[--to NAME] [--unclean] I" in text
        assert "(default: None -- the in-sync replica" in text
        assert "may be lost (prints how many bytes at most) (default: False)" in text
    assert "coordinator elect" in helps["raymq"]


@pytest.mark.slow
def test_bench_kafka_prints_the_issues_metric_names(tmp_path):
    got = _bench_figures("kafka", tmp_path, "0.05")
    for ratio, num, den in (("produce_ratio", "produce_confluent", "produce_sdk"),
                            ("consume_ratio", "consume_confluent", "consume_sdk"),
                            ("eos_ratio", "eos_confluent", "eos_sdk")):
        assert got[f"kafka.{num}"]["value"] > 0 and got[f"kafka.{den}"]["value"] > 0
        assert got[f"kafka.{ratio}"]["value"] == pytest.approx(
            got[f"kafka.{num}"]["value"] / got[f"kafka.{den}"]["value"], abs=0.001)
    assert got["kafka.p99_send_ms"]["value"] >= got["kafka.p99_send_ms"]["params"]["p50_ms"] > 0
