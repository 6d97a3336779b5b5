"""The controller's group assignment, in-process (no Ray)."""
from __future__ import annotations

from raymq.actors.controller import Controller
from raymq.storage.clock import ManualClock

CONFIG = {"num_shards": 1, "heartbeat_interval_ms": 200, "session_timeout_ms": 1500}


def beat(c, member, held):
    return c.heartbeat("g", member, ["T"], sorted(held))


def settle(c, held: dict[str, set], rounds: int = 4) -> dict[str, set]:
    """Members heartbeat in turn, dropping what they are told to release and taking what
    they are granted, as consumers do."""
    for _ in range(rounds):
        for m in sorted(held):
            res = beat(c, m, held[m])
            held[m] -= {tuple(q) for q in res["release"]}
            held[m] |= {tuple(q) for q in res["granted"]}
    return held


def test_a_restarted_controller_never_lets_two_members_hold_a_queue(tmp_path):
    clock = ManualClock()
    first = Controller({**CONFIG, "data_dir": str(tmp_path)}, clock=clock)
    first.create_topic("T", 4)
    held = settle(first, {"a": set(), "b": set()})
    assert sorted(held["a"] | held["b"]) == [("T", q) for q in range(4)]
    assert not held["a"] & held["b"]

    # the controller dies; its successor knows the topics, not who holds what.  The
    # member that heartbeats first must not be handed the other's queues meanwhile.
    second = Controller({**CONFIG, "data_dir": str(tmp_path)}, clock=clock, restarted=True)
    order = sorted(held, key=lambda m: -len(held[m]))  # the busier member re-announces last
    for m in reversed(order):
        res = beat(second, m, held[m])
        held[m] -= {tuple(q) for q in res["release"]}
        held[m] |= {tuple(q) for q in res["granted"]}
        assert not held["a"] & held["b"]
    for _ in range(3):
        clock.advance(600)
        settle(second, held, rounds=1)
        assert not held["a"] & held["b"]
    assert sorted(held["a"] | held["b"]) == [("T", q) for q in range(4)]  # all taken again


def test_a_member_told_of_a_queue_owned_by_another_releases_it(tmp_path):
    clock = ManualClock()
    c = Controller({**CONFIG, "data_dir": str(tmp_path)}, clock=clock)
    c.create_topic("T", 2)
    held = settle(c, {"a": set()})
    assert held["a"] == {("T", 0), ("T", 1)}
    clock.advance(2000)  # a is silent past its session: expired, its queues go to b
    held["b"] = set()
    beat(c, "b", set())
    held["b"] = {tuple(q) for q in beat(c, "b", set())["granted"]}
    assert held["b"] == {("T", 0), ("T", 1)}
    res = beat(c, "a", held["a"])  # a's late heartbeat: what it holds is b's now
    assert {tuple(q) for q in res["release"]} == {("T", 0), ("T", 1)}
    assert {tuple(q) for q in res["granted"]} == set()
