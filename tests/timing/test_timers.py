"""Timer messages (any deliver-at time) on one shard, in-process with an injected clock:
never early, ordered, exactly once across restarts, cancellable, bounded wheel.  No Ray."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import helpers
from raymq.actors.timing import timers as timers_mod
from raymq.actors.protocol import make_msg_id
from raymq.message import Message, Prop
from raymq.storage import RecordBatch
from raymq.storage.clock import ManualClock
from raymq.storage.errors import (AlreadyDeliveredError, ConfigError, InvalidMessageError,
                                  NotScheduledError)
from raymq.storage.timerwheel import TimerWheel

DAY = 86_400_000


def open_shard(tmp_path, clock, **cfg):
    return helpers.open_shard(tmp_path, [("t", 0), ("t", 1)], clock=clock, **cfg)


def at(due: int) -> dict:
    return {Prop.DELIVER_AT: str(due)}


def after(ms: int) -> dict:
    return {Prop.DELIVER_AFTER: str(ms)}


def delivered(sh, queue: int = 0) -> list:
    return sh.store.read_queue("t", queue, 0, 1_000_000)


def bodies(sh, queue: int = 0) -> list[bytes]:
    return [m.body for m in delivered(sh, queue)]


def test_random_times_are_never_delivered_early_and_each_exactly_once(tmp_path):
    rng = random.Random(15)
    clock = ManualClock()
    sh = open_shard(tmp_path, clock)
    t0 = clock.now_ms()
    due = {}  # when each is due: its time, or when it was sent if that is later
    seen_at: dict[bytes, int] = {}

    def deliver():  # what the shard's timer thread does, at the clock's time
        sh.deliver_due()
        for q in (0, 1):
            for m in delivered(sh, q):
                seen_at.setdefault(m.body, clock.now_ms())
    for n in range(40):  # sends at growing times, some due before others sent earlier
        props, body = [], []
        for k in range(10):
            b = f"m{n}-{k}".encode()
            if rng.random() < 0.5:
                d = t0 + rng.randrange(-2_000, 3 * 3_600_000)
                props.append(at(d))
            else:
                wait = rng.randrange(0, 2 * 3_600_000)
                props.append(after(wait))
                d = clock.now_ms() + wait
            due[b] = max(d, clock.now_ms())
            body.append(b)
        sh.send(RecordBatch("t", [k % 2 for k in range(10)], body, properties=props))
        deliver()
        clock.advance(rng.randrange(0, 60_000))
        deliver()
    while len(seen_at) < len(due):
        clock.advance(rng.choice([1, 7, 500, 30_000, 600_000]))
        deliver()
        assert clock.now_ms() < t0 + 4 * 3_600_000, "everything is due within 3 hours"
    early = {b: (due[b], t) for b, t in seen_at.items() if t < due[b]}
    assert not early
    for q in (0, 1):
        got = bodies(sh, q)
        assert len(got) == len(set(got))  # no second copy
        dues = [due[b] for b in got]
        assert dues == sorted(dues)  # delivered in due order per queue
    assert sum(len(bodies(sh, q)) for q in (0, 1)) == len(due)
    sh.close()


def test_a_same_millisecond_burst_comes_in_scheduling_order_with_the_delay_levels(tmp_path):
    clock = ManualClock()
    sh = open_shard(tmp_path, clock)
    due = clock.now_ms() + 5_000
    sent = []
    for n in range(20):  # 20 sends of 100, all due at the same millisecond, both queues
        batch = [f"b{n:02d}-{k:03d}".encode() for k in range(100)]
        sh.send(RecordBatch("t", [k % 2 for k in range(100)], batch,
                            properties=[at(due)] * 100))
        sent += batch
    sh.send(RecordBatch("t", 0, [b"level"], properties=[{Prop.DELAY: "2"}]))  # 5 s too
    clock.advance(4_999)
    sh.deliver_due()
    assert bodies(sh) == [] and bodies(sh, 1) == []
    clock.advance(1)
    sh.deliver_due()
    got0, got1 = bodies(sh, 0), bodies(sh, 1)
    assert b"level" in got0  # the delay level was not held back by the burst
    assert [b for b in got0 if b != b"level"] == sent[0::2]
    assert got1 == sent[1::2]
    sh.close()


def test_past_times_deliver_now_and_far_ones_wait_their_day(tmp_path):
    clock = ManualClock()
    sh = open_shard(tmp_path, clock)
    now = clock.now_ms()
    reply = sh.send(RecordBatch("t", 0, [b"past", b"zero-wait", b"far", b"max"],
                                properties=[at(now - DAY), after(0), at(now + 39 * DAY),
                                            after(40 * DAY)]))
    assert reply.queue_offsets[:2] == [0, 1] and reply.queue_offsets[2:] == [-1, -1]
    assert bodies(sh) == [b"past", b"zero-wait"]
    clock.advance(39 * DAY - 1)
    sh.deliver_due()
    assert bodies(sh) == [b"past", b"zero-wait"]
    clock.advance(1)
    sh.deliver_due()
    assert bodies(sh) == [b"past", b"zero-wait", b"far"]
    clock.advance(DAY)
    sh.deliver_due()
    assert bodies(sh)[-1] == b"max"
    m = delivered(sh)[2]
    assert m.properties[Prop.DELIVER_AT] == str(now + 39 * DAY)
    assert Prop.REAL_TOPIC not in m.properties
    sh.close()


def test_more_than_the_maximum_delay_is_refused_by_client_and_shard(tmp_path):
    clock = ManualClock()
    sh = open_shard(tmp_path, clock, max_delay_ms=DAY)
    now = clock.now_ms()
    reply = sh.send(RecordBatch("t", 0, [b"ok", b"too-far", b"too-long", b"both"],
                                properties=[after(DAY), at(now + 2 * DAY), after(DAY + 1),
                                            {**at(now), **after(5)}]))
    assert reply.queue_offsets[0] == -1 and reply.phys[0] >= 0
    assert set(reply.refused) == {1, 2, 3}
    assert "max_delay_ms" in reply.refused[1] and "max_delay_ms" in reply.refused[2]
    with pytest.raises(InvalidMessageError, match="max_delay_ms"):
        Message("t", b"x", deliver_after_ms=DAY + 1).validate(1024, 18, DAY)
    with pytest.raises(InvalidMessageError, match="max_delay_ms"):
        Message("t", b"x", deliver_at_ms=int(time.time() * 1000) + 2 * DAY).validate(1024, 18, DAY)
    with pytest.raises(InvalidMessageError, match="one of"):
        Message("t", b"x", deliver_at_ms=5, deliver_after_ms=5).validate(1024, 18)
    with pytest.raises(InvalidMessageError, match="non-negative"):
        Message("t", b"x", deliver_after_ms=-1).validate(1024, 18)
    sh.close()


def test_cancel_before_due_is_never_delivered_also_after_a_restart(tmp_path):
    clock = ManualClock()
    sh = open_shard(tmp_path, clock)
    now = clock.now_ms()
    reply = sh.send(RecordBatch("t", 0, [b"keep", b"cancel", b"level-cancel", b"due-soon"],
                                properties=[after(60_000), after(60_000), {Prop.DELAY: "3"},
                                            after(10)]))
    keep, cancel, level, soon = reply.phys
    assert sh.cancel_scheduled(cancel) == "cancelled"
    assert sh.cancel_scheduled(cancel) == "already cancelled"
    assert sh.cancel_scheduled(level) == "cancelled"
    clock.advance(10)
    sh.deliver_due()
    with pytest.raises(AlreadyDeliveredError, match="already delivered"):
        sh.cancel_scheduled(soon)
    plain = sh.send(RecordBatch("t", 0, [b"plain"])).phys[0]
    with pytest.raises(NotScheduledError):
        sh.cancel_scheduled(plain)
    sh.close()
    sh = open_shard(tmp_path, clock)  # the cancellations are on disk
    assert [m["msg_id"] for m in sh.timer_list(now + DAY)] == [
        m["msg_id"] for m in sh.timer_list(now + DAY) if m["due_ms"] == now + 60_000]
    assert len(sh.timer_list(now + DAY)) == 1
    clock.advance(120_000)
    sh.deliver_due()
    assert bodies(sh) == [b"due-soon", b"plain", b"keep"]
    with pytest.raises(AlreadyDeliveredError):
        sh.cancel_scheduled(keep)
    assert sh.queue_info()["timers"]["cancelled"] == 0  # passed: forgotten
    sh.close()
    sh = open_shard(tmp_path, clock)  # and still forgotten after the next restart
    assert sh.queue_info()["timers"]["cancelled"] == 0
    clock.advance(DAY)
    sh.deliver_due()
    assert bodies(sh) == [b"due-soon", b"plain", b"keep"]
    sh.close()


@pytest.mark.parametrize("fail", ["before_put", "after_put"])
def test_a_crash_in_the_middle_of_a_due_burst_loses_and_repeats_nothing(tmp_path, monkeypatch,
                                                                        fail):
    clock = ManualClock()
    sh = open_shard(tmp_path, clock)
    sent = [f"m{i:04d}".encode() for i in range(600)]
    for lo in range(0, 600, 100):
        sh.send(RecordBatch("t", 0, sent[lo:lo + 100], properties=[after(1_000)] * 100))
    monkeypatch.setattr(timers_mod, "DELIVERY_MAX_BYTES", 100 * 80)  # ~100 a put
    puts = []
    real_put = sh.store.put

    def crashing_put(batch, **kw):
        if kw.get("producer_id") == timers_mod.TIMER_PID:
            puts.append(len(batch))
            if len(puts) == 3 and fail == "before_put":
                raise SystemExit("killed before the third delivery")
            res = real_put(batch, **kw)
            if len(puts) == 3:
                raise SystemExit("killed after the third delivery")
            return res
        return real_put(batch, **kw)
    monkeypatch.setattr(sh.store, "put", crashing_put)
    clock.advance(1_000)
    with pytest.raises(SystemExit):
        sh.deliver_due()
    assert 0 < len(bodies(sh)) < 600
    sh.store.close()  # the process is gone; its files stay
    sh = open_shard(tmp_path, clock)
    sh.deliver_due()
    assert bodies(sh) == sent
    sh.close()


def test_a_transactional_timer_counts_from_the_commit_and_a_rollback_never_arrives(tmp_path):
    clock = ManualClock()
    sh = open_shard(tmp_path, clock)
    tx = {Prop.TRAN_MSG: "true", Prop.PRODUCER_GROUP: "g"}
    sent = sh.send(RecordBatch("t", 0, [b"commit", b"rollback"],
                               properties=[{**tx, Prop.TRANSACTION_ID: "a", **after(5_000)},
                                           {**tx, Prop.TRANSACTION_ID: "b", **after(5_000)}]))
    clock.advance(10_000)  # long past 5 s after the send: nothing, it is not committed
    sh.deliver_due()
    assert bodies(sh) == []
    sh.end_transactions([("g", "a", [sent.phys[0]], "COMMIT_MESSAGE"),
                         ("g", "b", [sent.phys[1]], "ROLLBACK_MESSAGE")])
    clock.advance(4_999)
    sh.deliver_due()
    assert bodies(sh) == []
    clock.advance(1)
    sh.deliver_due()
    assert bodies(sh) == [b"commit"]
    clock.advance(DAY)
    sh.deliver_due()
    assert bodies(sh) == [b"commit"]
    sh.close()


def test_a_retry_after_any_delay_uses_the_timer(tmp_path):
    clock = ManualClock()
    sh = open_shard(tmp_path, clock)
    sh.set_routes([("t", 0), ("t", 1), ("%RETRY%g", 0)])
    phys = sh.send(RecordBatch("t", 0, [b"job"])).phys[0]
    out = sh.send_back("g", phys, reason="busy", retry_after_ms=2_500)
    assert out["topic"] == "%RETRY%g"
    clock.advance(2_499)
    sh.deliver_due()
    assert sh.store.read_queue("%RETRY%g", 0, 0, 10) == []
    clock.advance(1)
    sh.deliver_due()
    [copy] = sh.store.read_queue("%RETRY%g", 0, 0, 10)
    assert copy.body == b"job" and copy.reconsume_count == 1
    with pytest.raises(InvalidMessageError, match="retry_after_ms"):
        sh.send_back("g", phys, retry_after_ms=41 * DAY)
    sh.close()


def test_status_counts_what_is_due_by_bucket_and_the_lag(tmp_path):
    clock = ManualClock()
    sh = open_shard(tmp_path, clock)
    sh.send(RecordBatch("t", 0, [b"a", b"b", b"c", b"d", b"e"],
                        properties=[after(100), after(30 * 60_000), after(3_600_000 + 120_000),
                                    after(10 * 3_600_000), after(3 * DAY)]))
    st = sh.queue_info()["timers"]
    assert (st["next_minute"], st["next_hour"], st["next_day"], st["later"]) == (1, 1, 2, 1)
    assert st["scheduled"] == 5 and st["lag_ms"] == 0
    clock.advance(1_100)  # due 1 s ago, not yet delivered
    assert sh.queue_info()["timers"]["lag_ms"] == 1_000
    sh.deliver_due()
    st = sh.queue_info()["timers"]
    assert st["lag_ms"] == 0 and st["scheduled"] == 4 and st["max_lateness_ms"] == 1_000
    listed = sh.timer_list(clock.now_ms() + 2 * 3_600_000)
    assert [m["due_ms"] - clock.now_ms() for m in listed] == [
        30 * 60_000 - 1_100, 3_600_000 + 120_000 - 1_100]
    sh.close()


def test_the_wheel_holds_one_bucket_in_memory_and_drops_finished_ones(tmp_path):
    clock = ManualClock()
    sh = open_shard(tmp_path, clock)
    now = clock.now_ms()
    n = 20_000
    dues = now + 1 + np.arange(n) * (DAY // n)  # one a few seconds, over a day
    for lo in range(0, n, 5_000):
        sh.send(RecordBatch("t", 0, [b"x"] * 5_000,
                            properties=[at(int(d)) for d in dues[lo:lo + 5_000]]))
    sh.deliver_due()
    wheel = sh.timers.wheel
    assert sum(wheel.counts.values()) == n
    assert len(sh.timers._loaded) <= n // 1440 + 2  # one minute's worth, not the day
    clock.advance(DAY // 2)
    sh.deliver_due()
    assert len(bodies(sh)) == int((dues <= clock.now_ms()).sum())
    assert min(wheel.keys()) >= wheel.key_of(clock.now_ms())  # finished buckets deleted
    sh.close()


def test_a_bucket_file_with_a_torn_tail_and_repeated_pairs_loads_each_once(tmp_path):
    wheel = TimerWheel(str(tmp_path), 1_000)
    wheel.add(np.array([5, 5, 6]), np.array([1, 2, 3]), np.array([5_500, 5_100, 6_000]))
    wheel.add(np.array([5]), np.array([1]), np.array([5_500]))  # indexed again after a crash
    with open(wheel._path(5), "ab") as f:
        f.write(b"\x01\x02\x03")  # a torn pair
    again = TimerWheel(str(tmp_path), 1_000)
    assert again.load(5).tolist() == [(2, 5_100), (1, 5_500)]
    again.add(np.array([5]), np.array([4]), np.array([5_999]))
    assert again.load(5).tolist() == [(2, 5_100), (1, 5_500), (4, 5_999)]
    again.write_checkpoint({"indexed": 5})
    assert TimerWheel(str(tmp_path), 1_000).read_checkpoint() == {"indexed": 5}
    again.drop(5)
    assert again.keys() == [6] and again.load(5).tolist() == []


_SCHEDULER_RSS = """
import json, os, sys, time
from raymq.actors.protocol import Prop
from raymq.actors.shard import BrokerShard
from raymq.storage import RecordBatch

def rss_anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

sh = BrokerShard(0, {"data_dir": sys.argv[1], "num_shards": 1, "flush_mode": "async"},
                 background=False)
sh.set_routes([("t", q) for q in range(4)])
now = int(time.time() * 1000)
body = b"x" * 64
marks = {}
for lo in range(0, 220_000, 5_000):
    dues = [now + 60_000 + (i * 86_400_000) // 220_000 for i in range(lo, lo + 5_000)]
    sh.send(RecordBatch("t", [i % 4 for i in range(5_000)], [body] * 5_000,
                        properties=[{Prop.DELIVER_AT: str(d)} for d in dues]))
    sh.deliver_due()  # index them into the wheel, as the timer thread does
    if lo + 5_000 in (20_000, 220_000):
        import gc; gc.collect()
        marks[lo + 5_000] = rss_anon_kib()
print(json.dumps({"rss": marks, "scheduled": sh.queue_info()["timers"]["scheduled"],
                  "loaded": len(sh.timers._loaded)}))
sh.close()
"""


def test_two_hundred_thousand_scheduled_messages_do_not_grow_the_shard(tmp_path):
    """The wheel lives on disk: scheduling 200k more messages over a day grows the shard
    process's anonymous memory by a few MiB (an in-memory tracker holding an object per
    message, as Pulsar's did, needs tens: ~100 bytes each)."""
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"}
    out = subprocess.run([sys.executable, "-c", _SCHEDULER_RSS, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["scheduled"] == 220_000
    assert res["loaded"] <= 220_000 // 1440 + 2  # one minute of them in memory
    growth_mib = (res["rss"]["220000"] - res["rss"]["20000"]) / 1024
    assert growth_mib < 8, f"RssAnon grew {growth_mib:.1f} MiB for 200k scheduled messages"


def test_a_cancellation_the_disk_did_not_confirm_in_time_is_a_retriable_timeout(tmp_path,
                                                                                   monkeypatch):
    from raymq.storage.errors import RequestTimeoutError
    from raymq.storage.store import PutStatus
    clock = ManualClock()
    sh = open_shard(tmp_path, clock)
    phys = sh.send(RecordBatch("t", 0, [b"later"], properties=[after(60_000)])).phys[0]
    real_put = sh.store.put

    def slow_disk(batch, **kw):  # written, but the fsync did not come within the timeout
        res = real_put(batch, **kw)
        res.status = PutStatus.FLUSH_DISK_TIMEOUT
        return res
    monkeypatch.setattr(sh.store, "put", slow_disk)
    with pytest.raises(RequestTimeoutError, match="retry") as err:
        sh.cancel_scheduled(phys)
    assert err.value.retriable
    monkeypatch.setattr(sh.store, "put", real_put)
    assert sh.cancel_scheduled(phys) == "cancelled"  # the retry
    sh.close()


def test_a_timer_just_sent_is_listed_before_the_timer_thread_indexed_it(tmp_path):
    """The timer thread indexes a far-off send only on its next tick; an operator's list
    right after the send still shows it (CI caught the list empty in that gap)."""
    clock = ManualClock()
    sh = open_shard(tmp_path, clock)  # (no background thread: nothing indexes by itself)
    reply = sh.send(RecordBatch("t", 0, [b"later", b"tomorrow"], keys=["k1", None],
                                properties=[after(30 * 60_000), after(30 * 3_600_000)]))
    listed = sh.timer_list(clock.now_ms() + 3_600_000)
    assert [(x["msg_id"], x["key"], x["topic"], x["queue_id"]) for x in listed] == \
        [(make_msg_id(0, reply.phys[0]), "k1", "t", 0)]
    sh.close()


def test_a_cancelled_timer_stays_cancelled_after_the_clock_stepped_back_and_a_restart(
        tmp_path):
    """Issue 25 (10): sent after the wall clock stepped back, a timer is indexed late
    (into the current bucket); its cancellation must survive the restart's purge."""
    clock = ManualClock()
    sh = open_shard(tmp_path, clock)
    sh.send(RecordBatch("t", 0, [b"before"], properties=[after(10)]))
    sh.deliver_due()
    clock.advance(120_000)
    sh.deliver_due()  # a bucket finished: the wheel has a checkpoint
    assert bodies(sh) == [b"before"]
    assert sh.timers.wheel.read_checkpoint()["current"] > sh.timers.wheel.key_of(
        clock.now_ms() - 3_600_000)  # (what the step back below goes behind)
    clock.step_wall(-3_600_000)  # an hour back
    reply = sh.send(RecordBatch("t", 0, [b"cancelled", b"kept"],
                                properties=[after(30_000), after(30_000)]))
    sh.deliver_due()  # indexed: due in a bucket before the current one
    assert sh.cancel_scheduled(reply.phys[0]) == "cancelled"
    sh.close()
    sh = open_shard(tmp_path, clock)
    clock.advance(30_001)
    sh.deliver_due()
    assert bodies(sh) == [b"before", b"kept"]
    sh.close()


def test_a_changed_timer_bucket_size_is_refused_in_one_line(tmp_path):
    """Issue 25 (9): the wheel's bucket keys are in the units it was written with."""
    clock = ManualClock()
    sh = open_shard(tmp_path, clock)
    sh.send(RecordBatch("t", 0, [b"later"], properties=[after(3_600_000)]))
    sh.deliver_due()
    sh.close()
    with pytest.raises(ConfigError) as e:
        open_shard(tmp_path, clock, timer_bucket_ms=1000)
    assert "timer_bucket_ms" in str(e.value) and "\n" not in str(e.value)
    sh = open_shard(tmp_path, clock)  # set back: everything is still there
    clock.advance(3_600_000)
    sh.deliver_due()
    assert bodies(sh) == [b"later"]
    sh.close()
