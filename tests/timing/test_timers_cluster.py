"""Timer messages through the SDK on the session's cluster: never early, cancel by id,
operators' list and status, a shard killed in the middle of a due burst."""
from __future__ import annotations

import time

import ray

from raymq import AlreadyDeliveredError, Message
from raymq.storage.errors import InvalidMessageError
from tests.helpers import wait_for
from tests.client.test_cluster import drain, pids_of, wait_restarted


def now_ms() -> int:
    return int(time.time() * 1000)


def test_sdk_timers_arrive_on_time_and_a_cancelled_one_never(mq, name):
    mq.create_topic(name, queues=2)
    p = mq.producer("p")
    sent_at = now_ms()
    results = p.send_batch([Message(name, b"after", deliver_after_ms=1_500),
                            Message(name, b"at", deliver_at_ms=sent_at + 1_000),
                            Message(name, b"cancelled", deliver_after_ms=1_200),
                            Message(name, b"past", deliver_at_ms=sent_at - 60_000)])
    assert mq.cancel_scheduled(results[2].msg_id) == "cancelled"
    c = mq.consumer(f"g{name}", [name])
    got = drain(c, 3, timeout_s=30)
    seen = {m.body: (now_ms(), m) for m in got}
    assert set(seen) == {b"after", b"at", b"past"}
    assert seen[b"at"][1].msg_id == results[1].msg_id  # the id its producer was given
    for body, (_t, m) in seen.items():
        assert m.store_ms >= int(m.properties["DELIVER_AT_MS"]), body  # never early
    assert seen[b"after"][1].store_ms >= sent_at + 1_500
    assert drain(c, 1, timeout_s=2) == []  # the cancelled one stays away
    try:
        mq.cancel_scheduled(results[0].msg_id)
        raise AssertionError("cancelling a delivered message must fail")
    except AlreadyDeliveredError as err:
        assert "already delivered" in str(err)
    c.close()


def test_operators_list_timers_and_see_them_in_status(mq, name, capsys):
    from raymq.tools.cli import main
    mq.create_topic(name, queues=1)
    p = mq.producer("p")
    r = p.send(Message(name, b"later", key="k1", deliver_after_ms=30 * 60_000))
    p.send(Message(name, b"tomorrow", deliver_after_ms=30 * 3_600_000))
    capsys.readouterr()
    assert main(["timer", "list", "--due-before", "+1h"]) == 0
    out = capsys.readouterr().out.splitlines()
    mine = [ln for ln in out if f"\t{name}/0\t" in ln]
    assert len(mine) == 1 and mine[0].startswith(r.msg_id) and "key=k1" in mine[0]
    info = mq.admin.status()
    total = {k: sum(s["info"]["timers"][k] for s in info["shards"])
             for k in ("next_hour", "later", "scheduled")}
    assert total["next_hour"] >= 1 and total["later"] >= 1
    assert main(["status"]) == 0
    assert "timers:" in capsys.readouterr().out
    assert main(["timer", "cancel", r.msg_id]) == 0
    assert capsys.readouterr().out.strip() == "cancelled"
    assert main(["timer", "list", "--due-before", "+1h"]) == 0
    assert not [ln for ln in capsys.readouterr().out.splitlines() if f"\t{name}/0\t" in ln]
    try:
        p.send(Message(name, b"x", deliver_after_ms=41 * 24 * 3_600_000))
        raise AssertionError("past max_delay_ms must be refused")
    except InvalidMessageError as err:
        assert "max_delay_ms" in str(err)


def test_a_shard_killed_during_a_due_burst_delivers_each_exactly_once(mq, name):
    mq.create_topic(name, queues=4)
    p = mq.producer("p")
    n = 4_000
    due0 = now_ms() + 2_000
    sent = []
    for lo in range(0, n, 500):
        batch = [Message(name, f"m{i:05d}".encode(), key=str(i % 16),
                         deliver_at_ms=due0 + (i * 1_500) // n) for i in range(lo, lo + 500)]
        sent += [m.body for m in batch]
        p.send_batch(batch)
    shards = sorted(set(mq.routes_for({name})[name]))
    before = pids_of(mq, shards)
    c = mq.consumer(f"g{name}", [name])
    got = drain(c, 1, timeout_s=30)  # the burst has begun
    for s in shards:
        ray.kill(mq.shard_handle(s), no_restart=False)
    wait_restarted(mq, before)
    got += drain(c, n - len(got), timeout_s=60)
    got += drain(c, 1, timeout_s=2)  # nothing more: no second copy
    bodies = [m.body for m in got]
    assert sorted(bodies) == sorted(sent) and len(bodies) == len(set(bodies)) == n
    for m in got:
        assert m.store_ms >= int(m.properties["DELIVER_AT_MS"])
    by_key: dict[str, list] = {}
    for m in sorted(got, key=lambda m: (m.queue_id, m.queue_offset)):
        by_key.setdefault(m.key, []).append(m.body)
    for key, seq in by_key.items():  # per queue (key), in order of scheduling
        assert seq == sorted(seq), key
    wait_for(lambda: all(s["info"]["timers"]["lag_ms"] == 0
                         for s in mq.admin.status()["shards"]), 30, "no delivery lag")
    c.close()
