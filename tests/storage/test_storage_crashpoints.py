"""Kill the production code at each named crash point and prove that nothing acknowledged
is lost: every acknowledged record is read back through its consume queue.

A child process (``tests/crash_writer.py``) runs with ``RAYMQ_STORAGE_CRASH_AT`` naming a
point of ``raymq.storage.faults.CRASH_POINTS``; it dies there with exit code
``CRASH_EXIT_CODE`` after writing the marker, which every test checks first: a kill
that did not land where it claims would prove nothing.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from raymq.storage import MessageStore
from raymq.storage.faults import CRASH_ENV, CRASH_EXIT_CODE, CRASH_MARKER, CRASH_POINTS
from tests.crash_writer import CHECKPOINT_EVERY, POINTS_CONFIG, plan_puts, put_body
from tests.helpers import ROOT, put_starts, store_whose_queues_must_be_rebuilt

SEED, PUTS = 7, 60

#: (point, hit) at which the writer is killed: every fsync, rename and delete of a put,
#: a checkpoint and a segment roll, after some puts were acknowledged.
WRITER_KILLS = [
    ("put.partly_appended", 3), ("put.appended", 20), ("put.indexed", 20),
    ("log.fsync.after", 20), ("queue.created", 3), ("segment.sealed", 2),
    ("segment.created", 2), ("segment.header_synced", 2),
    ("checkpoint.queues_synced", 4), ("checkpoint.before_rename", 4), ("checkpoint.renamed", 4),
]
#: Points of opening a store that must rebuild its consume queues: the first checkpoint
#: write of that process marks the rebuild, the second ends it.
REBUILD_KILLS = [
    ("checkpoint.queues_synced", 1), ("checkpoint.before_rename", 1), ("checkpoint.renamed", 1),
    ("rebuild.marked", 1), ("rebuild.deleting", 1), ("rebuild.deleted", 1),
    ("rebuild.reindexed", 1), ("checkpoint.queues_synced", 2),
    ("checkpoint.before_rename", 2), ("checkpoint.renamed", 2),
]


def run_child(args: list[str], point: str | None, hit: int = 1) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(CRASH_ENV, None)
    if point:
        env[CRASH_ENV] = f"{point}:{hit}"
    return subprocess.run([sys.executable, "-m", "tests.crash_writer", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def assert_killed_at(proc: subprocess.CompletedProcess, point: str, hit: int) -> None:
    """The child died at ``point`` (its ``hit``-th time there), not elsewhere."""
    assert proc.returncode == CRASH_EXIT_CODE, (
        f"the child was not killed at {point}:{hit} (exit {proc.returncode}): "
        f"{proc.stderr[-2000:]}")
    assert f"{CRASH_MARKER} {point} {hit}\n" in proc.stderr


def acknowledged(proc: subprocess.CompletedProcess) -> dict[int, list[int]]:
    """put number -> queue offsets of its records, for every put acknowledged."""
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("ACK "):
            _, p, offsets = line.split()
            out[int(p)] = [int(x) for x in offsets.split(",")]
    return out


def check_store(directory: str, acks: dict[int, list[int]], plan) -> None:
    """Every acknowledged record is where its ack said; every visible put is whole."""
    with MessageStore(directory, POINTS_CONFIG, background=False) as store:
        for p, offsets in acks.items():
            n = len(plan[p])
            for i, ((topic, qid), qoff) in enumerate(zip(plan[p], offsets)):
                got = store.read_queue(topic, qid, qoff, 1)
                assert [m.body for m in got] == [put_body(p, i, n)], \
                    f"acknowledged record {i} of put {p} lost at {topic}/{qid}@{qoff}"
        seen: dict[int, int] = {}
        for topic, qid in store.queues():
            end = store.max_queue_offset(topic, qid)
            msgs = store.read_queue(topic, qid, 0, end + 1)
            assert [m.queue_offset for m in msgs] == list(range(end)), f"{topic}/{qid}"
            for m in msgs:
                p, _i, _n = (int(x) for x in m.body.split(b"|")[0][1:].decode().split("-"))
                seen[p] = seen.get(p, 0) + 1
        assert {p: k for p, k in seen.items() if k != len(plan[p])} == {}, "a put half visible"
        assert set(acks) <= set(seen)
        store.put(put_batch(len(plan), [("A", 0)]))  # and it takes writes again


def put_batch(p: int, keys):
    from raymq.storage import RecordBatch
    return RecordBatch([t for t, _ in keys], [q for _, q in keys],
                       [put_body(p, i, len(keys)) for i in range(len(keys))])


@pytest.mark.parametrize("point,hit", WRITER_KILLS, ids=[f"{p}:{h}" for p, h in WRITER_KILLS])
def test_a_kill_at_each_point_of_writing_keeps_every_acknowledged_record(tmp_path, point, hit):
    directory = str(tmp_path / "store")
    proc = run_child(["points", directory, str(SEED), str(PUTS)], point, hit)
    assert_killed_at(proc, point, hit)
    acks = acknowledged(proc)
    assert len(acks) >= 2 and "DONE" not in proc.stdout
    check_store(directory, acks, plan_puts(SEED, PUTS))


def test_a_kill_while_recovery_cuts_a_half_written_put_keeps_every_acknowledged_record(tmp_path):
    directory = str(tmp_path / "store")
    proc = run_child(["points", directory, str(SEED), str(PUTS)], "put.partly_appended", 3)
    assert_killed_at(proc, "put.partly_appended", 3)
    opened = run_child(["open", directory], "recovery.put_cut", 1)
    assert_killed_at(opened, "recovery.put_cut", 1)
    check_store(directory, acknowledged(proc), plan_puts(SEED, PUTS))


@pytest.mark.parametrize("point,hit", REBUILD_KILLS, ids=[f"{p}:{h}" for p, h in REBUILD_KILLS])
def test_a_kill_at_any_step_of_a_consume_queue_rebuild_keeps_every_acknowledged_record(
        tmp_path, point, hit):
    directory = str(tmp_path / "store")
    expected = store_whose_queues_must_be_rebuilt(directory, POINTS_CONFIG)
    proc = run_child(["open", directory], point, hit)
    assert_killed_at(proc, point, hit)
    with MessageStore(directory, POINTS_CONFIG, background=False) as store:
        assert {q: [m.body for m in store.read_queue(*q, 0, 100)] for q in expected} == expected
    opened = run_child(["open", directory], None)  # and a clean open after that agrees
    assert opened.returncode == 0 and "OPENED" in opened.stdout, opened.stderr[-2000:]
    with MessageStore(directory, POINTS_CONFIG, background=False) as store:
        assert {q: [m.body for m in store.read_queue(*q, 0, 100)] for q in expected} == expected


#: Points of a replica's cut below its checkpoint (``cut_store``): queues cut, then the
#: checkpoint moved (its three steps), then the log cut.
CUT_KILLS = [("cut.queues", 1), ("checkpoint.queues_synced", 1),
             ("checkpoint.before_rename", 1), ("checkpoint.renamed", 1)]


@pytest.mark.parametrize("point,hit", CUT_KILLS, ids=[f"{p}:{h}" for p, h in CUT_KILLS])
def test_a_kill_at_any_step_of_a_replicas_cut_keeps_the_puts_before_it(tmp_path, point, hit):
    """Killed while it cuts its store below the checkpoint, a replica opens with every put
    before the cut whole and each queue without a gap; the cut done again ends with
    exactly those puts, and the store takes writes."""
    directory = str(tmp_path / "store")
    written = run_child(["points", directory, str(SEED), str(PUTS)], None)
    plan = plan_puts(SEED, PUTS)
    acks = acknowledged(written)
    with MessageStore(directory, POINTS_CONFIG, background=False) as store:
        starts = put_starts(store)
        cut, _producers = starts[len(starts) // 2]
        before = {p for p in acks if any(m.phys_offset < cut for (t, q), o in
                                          zip(plan[p], acks[p])
                                          for m in store.read_queue(t, q, o, 1))}
    assert 5 < len(before) < len(acks)
    killed = run_child(["cut", directory, str(cut)], point, hit)
    assert_killed_at(killed, point, hit)
    check_store(directory, {p: acks[p] for p in before}, plan)
    done = run_child(["cut", directory, str(cut)], None)
    assert done.returncode == 0 and "CUT" in done.stdout, done.stderr[-2000:]
    with MessageStore(directory, POINTS_CONFIG, background=False) as store:
        assert store.max_phys_offset == cut
    check_store(directory, {p: acks[p] for p in before}, plan)
    with MessageStore(directory, POINTS_CONFIG, background=False) as store:
        visible = {int(m.body.split(b"|")[0][1:].decode().split("-")[0])
                   for t, q in store.queues() for m in store.read_queue(t, q, 0, 100_000)}
    assert visible >= before and all(p in before or p == len(plan) for p in visible)


def test_a_kill_while_retention_deletes_segments_leaves_a_consistent_log_start(tmp_path):
    """Killed after the first of the segments it chose is deleted, a store opens with a
    log start in every queue and each queue readable, without a gap, from it to its end;
    retention run again finishes, and the store takes writes."""
    directory = str(tmp_path / "store")
    written = run_child(["points", directory, str(SEED), str(PUTS)], None)
    assert written.returncode == 0, written.stderr[-2000:]
    killed = run_child(["retain", directory], "retention.deleted_one", 1)
    assert_killed_at(killed, "retention.deleted_one", 1)

    def consistent() -> dict:
        with MessageStore(directory, POINTS_CONFIG, background=False) as store:
            starts = {}
            for topic, qid in store.queues():
                start, end = store.retention.log_start(topic, qid), store.max_queue_offset(topic, qid)
                msgs = store.read_queue(topic, qid, start, end - start + 1)
                assert [m.queue_offset for m in msgs] == list(range(start, end))
                starts[(topic, qid)] = start
            return starts

    half = consistent()
    assert any(half.values())
    done = run_child(["retain", directory], None)
    assert done.returncode == 0 and "RETAINED" in done.stdout, done.stderr[-2000:]
    full = consistent()
    assert all(full[q] >= half[q] for q in half) and full != half
    with MessageStore(directory, POINTS_CONFIG, background=False) as store:
        assert len(store.segments()) == 1
        store.put(put_batch(len(plan_puts(SEED, PUTS)), [("A", 0)]))


def test_an_unkilled_rebuild_and_writer_run_to_their_end(tmp_path):
    """Without a crash point the same runs end normally (so the kills above are the cause)."""
    directory = str(tmp_path / "store")
    expected = store_whose_queues_must_be_rebuilt(directory, POINTS_CONFIG)
    opened = run_child(["open", directory], None)
    assert opened.returncode == 0 and "rebuilding" in opened.stderr, opened.stderr[-2000:]
    with MessageStore(directory, POINTS_CONFIG, background=False) as store:
        assert {q: [m.body for m in store.read_queue(*q, 0, 100)] for q in expected} == expected
    written = run_child(["points", str(tmp_path / "w"), str(SEED), str(PUTS)], None)
    assert written.returncode == 0 and "DONE" in written.stdout
    assert len(acknowledged(written)) == PUTS
    assert PUTS // CHECKPOINT_EVERY >= 4 and len(os.listdir(tmp_path / "w" / "commitlog")) >= 3


#: Points of the timer wheel: a shard delivering a due burst across bucket boundaries.
TIMER_KILLS = [("timer.checkpoint.before_rename", 1), ("timer.checkpoint.renamed", 1),
               ("timer.checkpoint.renamed", 2)]

_TIMER_CHILD = """
import sys, time
from raymq.actors.shard import BrokerShard
from raymq.actors.protocol import Prop
from raymq.storage import RecordBatch
sh = BrokerShard(0, {"data_dir": sys.argv[1], "num_shards": 1, "timer_bucket_ms": 1000},
                 background=False)
sh.set_routes([("t", 0)])
if sys.argv[2] == "schedule":
    now = int(time.time() * 1000)
    sh.send(RecordBatch("t", 0, [b"m%03d" % i for i in range(300)],
                        properties=[{Prop.DELIVER_AT: str(now + 300 + 8 * i)} for i in range(300)]))
while sh.store.max_queue_offset("t", 0) < 300:  # what the timer thread does
    time.sleep(max(1, sh.deliver_due()) / 1000)
sh.deliver_due()  # (a second copy would show here)
print("DELIVERED", sh.store.max_queue_offset("t", 0), flush=True)
"""


@pytest.mark.parametrize("point,hit", TIMER_KILLS)
def test_a_kill_at_a_timer_checkpoint_delivers_each_due_message_once(tmp_path, point, hit):
    """A shard killed while its timer wheel checkpoints a finished second (2.4 s of due
    messages, 1 s buckets) delivers every message exactly once after its restart."""
    env = dict(os.environ)
    env[CRASH_ENV] = f"{point}:{hit}"
    first = subprocess.run([sys.executable, "-c", _TIMER_CHILD, str(tmp_path), "schedule"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert_killed_at(first, point, hit)
    with MessageStore(os.path.join(str(tmp_path), "shard-0"), POINTS_CONFIG,
                      background=False) as store:  # killed in the burst, not after it
        assert store.max_queue_offset("t", 0) < 300
    env.pop(CRASH_ENV)
    again = subprocess.run([sys.executable, "-c", _TIMER_CHILD, str(tmp_path), "resume"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    with MessageStore(os.path.join(str(tmp_path), "shard-0"), POINTS_CONFIG,
                      background=False) as store:
        got = [m.body for m in store.read_queue("t", 0, 0, 1000)]
    assert got == [b"m%03d" % i for i in range(300)]


def test_every_crash_point_is_killed_at_by_a_test():
    """The tests above cover every point, and every point the code names is listed."""
    covered = {p for p, _ in WRITER_KILLS + REBUILD_KILLS + TIMER_KILLS + CUT_KILLS}
    covered |= {"retention.deleted_one"} | {"recovery.put_cut"}
    # tests/kafka_tx/test_ktx_forever.py, test_kafka_transactions.py and test_fast_commit.py kill there
    covered |= {"ktx.markers_durable", "coordinator.add_logged"}
    covered |= {"coordinator.one_phase_decided"}  # tests/kafka_tx/test_fast_commit.py
    covered |= {"ktx.batch_committed", "coordinator.batch_committed"}  # test_one_request.py
    assert covered == set(CRASH_POINTS)
    named = set()
    for name in [os.path.join(d, f) for top in ("storage", "actors")
                 for d, _dirs, files in os.walk(os.path.join(ROOT, top)) for f in files]:
        if name.endswith(".py"):
            text = open(name).read()
            named |= set(re.findall(r'crash_point\("([a-z_.]+)"\)', text))
            named |= {f"{label}.{step}" for label in re.findall(r'label="([a-z_.]+)"', text)
                      for step in ("before_rename", "renamed")}
    assert named == set(CRASH_POINTS)
