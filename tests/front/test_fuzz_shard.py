"""A seeded fuzz of the shard's public calls (issue 12 E): every answer is a result or a
RayMQ error, the shard stays up, and what was acknowledged before is delivered as written.

In-process (no Ray): these are the calls the data channel and the actor serve.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from raymq.actors.protocol import (CHECK_EXPIRED_TOPIC, HALF_TOPIC, OP_TOPIC, SCHEDULE_TOPIC,
                                   Prop, dlq_topic, retry_topic)
from raymq.actors.shard import BrokerShard
from raymq.storage import RecordBatch
from raymq.storage.errors import RayMQError

TOPICS = ["orders", HALF_TOPIC, OP_TOPIC, SCHEDULE_TOPIC, CHECK_EXPIRED_TOPIC, retry_topic("g"),
          dlq_topic("g"), "nope", "", "a\n", None, 7, "x" * 300]
PROPS = list(vars(Prop).values()) + ["user", "", "a\x01b", "\ud800"]
ODD = [None, -1, 0, 1, 2**63, -2**63, 2**64 + 5, 1.5, float("nan"), True, "1", b"1", [], {},
       (), [1, 2], {"a": 1}, object()]


def odd(rng):
    return rng.choice(ODD)


def some_number(rng):
    return rng.choice([0, 1, 5, -1, 10**12, 2**62, 2**63 - 1, rng.randrange(10**6)] + ODD[:9])


def some_props(rng):
    if rng.random() < 0.2:
        return odd(rng)
    return {rng.choice(PROPS): rng.choice(["1", "0", "x", "true", "-5", "9" * 30, "", "g",
                                           "\ud800", "a\x02"]) for _ in range(rng.randrange(4))}


def some_batch(rng):
    if rng.random() < 0.1:
        return odd(rng)
    n = rng.randrange(0, 4)
    pick = lambda f: [f() for _ in range(n)] if rng.random() < 0.7 else f()  # noqa: E731
    try:
        return RecordBatch(
            pick(lambda: rng.choice(TOPICS)), pick(lambda: rng.choice([0, 1, -1, 2**40, None])),
            [rng.choice([b"x", b"", "text", None, b"y" * 1000]) for _ in range(n)],
            keys=pick(lambda: rng.choice([None, "k", "k" * 2000, "\ud800", 5])) if rng.random() < 0.5 else None,
            tags=pick(lambda: rng.choice([None, "t", 3])) if rng.random() < 0.3 else None,
            properties=[some_props(rng) for _ in range(n)] if rng.random() < 0.6 else None,
            flags=rng.choice([0, 1, -1, 2**40]), born_ms=some_number(rng),
            reconsume=rng.choice([0, -1, 2**40]), prepared_offsets=rng.choice([-1, 0, 2**63]),
            tag_codes=[some_number(rng) for _ in range(n)] if rng.random() < 0.2 else None)
    except RayMQError:
        return None


def some_call(rng, sh, acked_phys):
    phys = rng.choice(acked_phys + [some_number(rng)])
    q = (rng.choice(TOPICS), rng.choice([0, 1, -1, None, "0"]))
    calls = [
        lambda: sh.send(some_batch(rng), some_number(rng), some_number(rng),
                        rng.choice([None, [], [odd(rng)], [("g", "t", [phys], "COMMIT")],
                                    [("g", "t", odd(rng), odd(rng))]])),
        lambda: sh.pull([(q[0], q[1], some_number(rng), some_number(rng))],
                        rng.choice([0, 1, -5, None]), rng.choice([None, {}, odd(rng)])),
        lambda: sh.pull(odd(rng)),
        lambda: sh.commit_offsets(rng.choice(["g", "dlq-resend@g@0", "", None, "g\n"]),
                                  rng.choice([{q: some_number(rng)}, odd(rng)])),
        lambda: sh.get_offsets(rng.choice(["g", None]), rng.choice([[q], odd(rng)])),
        lambda: sh.end_transactions(rng.choice([[("g", "t", [phys], "COMMIT_MESSAGE")],
                                                [odd(rng)], odd(rng)])),
        lambda: sh.get_message(phys),
        lambda: sh.resolve_half(phys, rng.choice(["COMMIT", "ROLLBACK", "X", None])),
        lambda: sh.send_back(rng.choice(["g", "", None]), phys, reason=rng.choice(["", "r", None])),
        lambda: sh.dlq_resend(rng.choice(["g", None]), rng.choice([None, [phys], odd(rng)])),
        lambda: sh.dlq_list(rng.choice(["g", None]), some_number(rng), some_number(rng)),
        lambda: sh.find_by_key(rng.choice(TOPICS), rng.choice(["k", None]), rng.choice([10, -1])),
        lambda: sh.uncount_checks(rng.choice([[(phys, 1)], odd(rng)])),
        lambda: sh.half_list(expired=rng.choice([True, False]), limit=rng.choice([1, -1, 10])),
        lambda: sh.ktx_register(some_number(rng), some_number(rng),
                                rng.choice([[q], odd(rng), [odd(rng)]]),
                                rng.choice([["g"], [odd(rng)], odd(rng), ()])),
        lambda: sh.ktx_send(some_batch(rng), some_number(rng), some_number(rng),
                            some_number(rng), rng.choice([0, 1, -1, None, 10**9])),
        lambda: sh.ktx_offsets(some_number(rng), some_number(rng), rng.choice(["g", None]),
                               rng.choice([{q: some_number(rng)}, odd(rng)])),
        lambda: sh.ktx_end(some_number(rng), some_number(rng),
                           rng.choice(["COMMIT", "ABORT", "X", None, 5])),
        lambda: sh.cancel_scheduled(phys),
        lambda: sh.timer_list(some_number(rng), some_number(rng)),
    ]
    return rng.choice(calls)


def valid_calls(rng, acked_phys: list[int], timer_phys: int, pid: int) -> list[tuple]:
    """Well-formed calls with good arguments, (method, args) in an order that makes each
    valid: each must be answered with a result -- never an error, and never the
    "malformed request" line a slip deeper down would turn into one."""
    return rng.choice([
        [("send", (RecordBatch("orders", 0, [b"ok"]), 0, 0))],
        [("pull", ([("orders", 0, 0, 10)], 0))],
        [("commit_offsets", ("g", {("orders", 0): 1}))],
        [("get_offsets", ("g", [("orders", 0)]))],
        [("end_transactions", ([("g", "t", [rng.choice(acked_phys)], "COMMIT_MESSAGE")],))],
        [("ktx_register", (pid, 0, [("orders", 1)], ["g"])),
         ("ktx_send", (RecordBatch("orders", 1, [b"tx"]), pid, 0, 1)),
         ("ktx_offsets", (pid, 0, "g", {("orders", 0): 2})),
         ("ktx_end", (pid, 1, rng.choice(["COMMIT", "ABORT"])))],
        [("cancel_scheduled", (timer_phys,))],
        [("timer_list", (2**62, 10))],
        [("get_message", (rng.choice(acked_phys),))],
        [("dlq_list", ("g", 0, 10))],
        [("find_by_key", ("orders", "k1"))],
    ])


def a_timer(sh) -> int:
    """A timer message waiting an hour (what a valid cancel names)."""
    return sh.send(RecordBatch("orders", 0, [b"timer"],
                               properties=[{Prop.DELIVER_AFTER: "3600000"}])).phys[0]


@pytest.mark.parametrize("seed", range(3))
def test_fuzzed_calls_answer_a_result_or_a_raymq_error_and_lose_nothing(tmp_path, seed):
    rng = random.Random(seed)
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1, "txn_timeout_ms": 1},
                     background=False)
    sh.set_routes([("orders", 0), ("orders", 1), (retry_topic("g"), 0), (dlq_topic("g"), 0)])
    try:
        bodies = [f"acked-{i}".encode() for i in range(20)]
        acked = sh.send(RecordBatch("orders", 0, bodies, keys=[f"k{i}" for i in range(20)]),
                        77, 1)
        assert acked.status == "SEND_OK"
        timer = a_timer(sh)
        surprises, valid = [], 0
        for k in range(600):
            if k % 4 == 0:  # a valid call among the fuzz: answered, not refused
                for method, args in valid_calls(rng, list(acked.phys), timer, 1000 + k):
                    try:
                        getattr(sh, method)(*args)
                        valid += 1
                    except Exception as err:  # noqa: BLE001 -- what the test is looking for
                        surprises.append(f"valid {method}: {type(err).__name__}: {err}")
                continue
            call = some_call(rng, sh, list(acked.phys))
            try:
                call()
            except RayMQError as err:
                assert "\n" not in str(err), err  # one line
            except Exception as err:  # noqa: BLE001 -- what the test is looking for
                surprises.append(f"{type(err).__name__}: {err}")
        assert surprises == [] and valid >= 150
        [(_t, _q, batch, _n, _e)] = sh.pull([("orders", 0, 0, 100)])
        got = [(m.body, m.key) for m in batch.messages()]
        assert got[:20] == [(b, f"k{i}") for i, b in enumerate(bodies)]  # as written
        assert sh.send(RecordBatch("orders", 0, [b"after"])).status == "SEND_OK"  # still up
    finally:
        sh.close()
    reopened = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1}, background=False)
    try:  # and it starts again on what the fuzzing left
        reopened.set_routes([("orders", 0)])
        [(_t, _q, batch, _n, _e)] = reopened.pull([("orders", 0, 0, 20)])
        assert [m.body for m in batch.messages()] == bodies
    finally:
        reopened.close()
    assert np.int64  # numpy present (RecordBatch columns)
