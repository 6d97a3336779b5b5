"""Replicated shards on a multi-node Ray cluster of this machine (``ray.cluster_utils``),
each scenario in a child process with a cluster of its own (``tests.replication_scenario``):
nodes are removed and added, processes paused; every check is printed and asserted."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
from tests.helpers import ROOT



def run(name: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "tests.replication_scenario", name], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_five_leader_node_losses_under_every_kind_of_load():
    out = run("failover_all")
    assert len(re.findall(r"^failover \d: epoch (\d+) -> (\d+)", out, re.M)) == 5
    assert re.search(r"^plain: acked \d+ lost 0 duplicates 0 ordered True", out, re.M)
    assert re.search(r"^consumer g: missing 0 redelivered 0", out, re.M)
    m = re.search(r"^rocket: committed seen once (\d+)/(\d+) rolled back seen 0", out, re.M)
    assert m and m.group(1) == m.group(2)
    m = re.search(r"^kafka: committed seen once (\d+)/(\d+) aborted seen 0", out, re.M)
    assert m and m.group(1) == m.group(2)
    m = re.search(r"^timers: delivered once (\d+)/(\d+) early 0", out, re.M)
    assert m and m.group(1) == m.group(2)


@pytest.mark.slow
def test_followers_lost_then_not_enough_replicas_then_they_copy_back_and_rejoin():
    out = run("follower_loss")
    assert "one follower lost: acked 200/200" in out
    line = re.search(r"^two lost: NotEnoughReplicasError: (.*)$", out, re.M).group(1)
    assert "shard-0" in line and "min_insync_replicas is 2" in line
    assert re.search(r"^back: in sync 3, acked 300/300", out, re.M)
    assert "lost 0 duplicates 0 ordered True" in out


@pytest.mark.slow
def test_a_paused_leader_acknowledges_nothing_and_its_write_is_cut_away():
    out = run("paused_leader")
    answer = re.search(r"^paused leader's answer: (\S+)", out, re.M).group(1)
    assert answer != "SEND_OK"
    assert "lost 0 duplicates 0 held write delivered False" in out
    assert re.search(r"^elected back: True epoch \d+", out, re.M)
    # `raymq status`'s replica lines: the leader and two followers, all alive
    assert re.search(r"^  shard-0: leader on node \S+  epoch \d+  in sync 3/3", out, re.M)
    roles = re.findall(r"^    shard-0-r\d: (leader|follower) +node \S+ +alive", out, re.M)
    assert sorted(roles) == ["follower", "follower", "leader"]


@pytest.mark.slow
def test_a_half_message_whose_leader_is_lost_is_checked_by_the_new_leader_once():
    out = run("half_check")
    assert "half after failover: delivered 1 time(s)" in out


@pytest.mark.slow
def test_down_and_up_restarts_every_replica_with_its_files():
    out = run("down_up")
    assert re.search(r"^after down and up: epoch \d+ -> \d+, in sync 3, acked 400/400, "
                     r"lost 0 duplicates 0 ordered True", out, re.M)
    # the web console's overview of the replicated cluster: each group's leader and two
    # followers, every RayMQ actor answering (replicas included), the four nodes
    assert re.search(r"^console: shard-0 roles follower follower leader in sync 3", out, re.M)
    assert re.search(r"^console: alive kinds .*shard replica.*; not answering \[\]; nodes 4",
                     out, re.M)


@pytest.mark.slow
def test_the_coordinators_leader_node_lost_twice_under_kafka_style_transactions():
    out = run("coordinator_loss")
    assert len(re.findall(r"^coordinator failover \d: epoch (\d+) -> (\d+)", out, re.M)) == 2
    m = re.search(r"^kafka after coordinator failovers: committed seen once (\d+)/(\d+) "
                  r"aborted seen 0 left open 0", out, re.M)
    assert m and m.group(1) == m.group(2)


@pytest.mark.slow
def test_the_controllers_node_lost_with_its_files_it_restarts_from_what_replicas_keep():
    out = run("controller_node_lost")
    assert "controller on the raymq_controller node: True" in out
    assert "controller's node removed: process gone True, files wiped True" in out
    assert re.search(r"^controller restarted on the fresh node: True, new process True", out,
                     re.M)
    m = re.search(r"^sent while the controller was lost and restarted: acked (\d+)/(\d+)",
                  out, re.M)
    assert m and int(m.group(1)) > 0
    assert re.search(r"^topics after: \['t'\]", out, re.M)
    assert re.search(r"^after the controller's restart: in sync 3, SEND_OK", out, re.M)
    m = re.search(r"^leader's node lost: epoch (\d+) -> (\d+), [\d.]+ s to SEND_OK", out, re.M)
    assert m and int(m.group(2)) > int(m.group(1))
    assert re.search(r"^after: in sync 3, acked again 50/50, acked \d+/\d+ lost 0 duplicates "
                     r"0 ordered True", out, re.M)


@pytest.mark.slow
def test_the_controllers_files_wiped_between_down_and_up_it_takes_them_from_replicas():
    out = run("controller_files_wiped")
    assert "controller's directory wiped: True" in out
    assert re.search(r"^topics after: \['t'\]", out, re.M)
    assert re.search(r"^after the controller's files were wiped: epoch \d+ -> \d+, in sync 3, "
                     r"acked again 100/100, acked 400/400 lost 0 duplicates 0 ordered True",
                     out, re.M)


@pytest.mark.slow
def test_the_leaders_directory_wiped_between_down_and_up_it_does_not_lead_and_copies_back():
    out = run("leader_dir_wiped")
    assert "wiped the leader's directory: True" in out
    m = re.search(r"^leader after up: wiped one leads False, epoch \d+; once in sync: wiped "
                  r"one leads False; wiped replica's log end (\d+) \(leader's (\d+)\)", out, re.M)
    assert m and int(m.group(1)) > 0  # (copied back: in sync holding what the leader does)
    assert re.search(r"^after the leader's directory was wiped: in sync 3, acked again "
                     r"100/100, acked 400/400 lost 0 duplicates 0 ordered True", out, re.M)


@pytest.mark.slow
def test_every_in_sync_replica_paused_the_first_follower_back_leads():
    out = run("all_in_sync_paused")
    m = re.search(r"^one follower resumed: it leads True, epoch (\d+) -> (\d+), [\d.]+ s to "
                  r"SEND_OK, acked 50/50 more with the others paused", out, re.M)
    assert m and int(m.group(2)) > int(m.group(1))
    assert re.search(r"^all resumed: in sync 3, epoch \d+, acked again 50/50, acked \d+/\d+ "
                     r"lost 0 duplicates 0 ordered True", out, re.M)


@pytest.mark.slow
def test_the_controllers_node_lost_right_after_a_topic_was_created_keeps_the_topic():
    # the replicas keep the controller's topics from their next heartbeat on: a topic
    # created (and written to) just before the controller's node and files are lost
    out = run("controller_node_lost_new_topic")
    assert re.search(r"^controller restarted \(old process gone True\): in sync 3, topics "
                     r"after: \['t'\]", out, re.M)
    assert re.search(r"^after: acked again 50/50 errors \[\], acked 100/\d+ lost 0 ", out,
                     re.M)


@pytest.mark.slow
def test_retention_on_a_group_of_three_survives_a_wiped_follower_and_a_lost_leader():
    """(issue 35) Segments the leader deletes go on the followers; a replica on a fresh
    node copies from the leader's log start; a new leader keeps the log start."""
    out = run("retention_replicated")
    m = re.search(r"^leader deleted (\d+) log start (\d+) t/0 from (\d+)", out, re.M)
    assert m and int(m.group(1)) >= 2 and int(m.group(3)) > 0
    assert re.search(r"^back: in sync 3", out, re.M)
    m2 = re.search(r"^new leader: log start (\d+) \(was (\d+)\) t/0 from (\d+)", out, re.M)
    assert m2 and int(m2.group(1)) >= int(m2.group(2))
    assert re.search(r"^read from \d+ to 130: gaps False bodies True", out, re.M)


@pytest.mark.slow
def test_an_idempotent_kafka_producer_through_a_leader_failover_loses_and_repeats_nothing():
    """(issue 36) librdkafka's idempotent producer over the Kafka listener; the shard's
    leader node lost in the middle: its resends are stored once, nothing is missing."""
    out = run("kafka_idempotent_failover")
    sent = int(re.search(r"^the leader's node removed after (\d+) of 4000 sent", out, re.M)
               .group(1))
    assert 0 < sent < 4000
    m = re.search(r"^failover: epoch (\d+) -> (\d+); produced 4000, failed 0", out, re.M)
    assert m and int(m.group(2)) > int(m.group(1))
    for q in (0, 1):
        assert f"partition {q}: read 2000/2000 duplicates 0 in order True complete True" in out
