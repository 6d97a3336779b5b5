"""ProducerGroupRegistry: live transaction producers per group, and the check channel.

Every live producer instance registers and heartbeats (a lease).  A
check-back request for a group is queued here and taken by *any* live
instance of the group: instances long-poll ``poll_checks`` -- so a new
process started after the original producer died answers the checks of the
transactions the dead one left, in the application's process where its
database connection lives.

A plain class (no Ray), made an actor at the edge; thread-safe.  Soft state:
after a restart producers re-register with their next heartbeat, and the
checker asks again in its next round.
"""
from __future__ import annotations

import os
import threading
from collections import deque

from raymq.actors.protocol import CheckRequest
from raymq.storage.clock import Clock, SystemClock


class ProducerGroupRegistry:
    def __init__(self, lease_ms: int = 6000, *, clock: Clock | None = None,
                 max_queued_per_group: int = 100_000):
        self.lease_ms = lease_ms
        self.clock = clock or SystemClock()
        self.max_queued = max_queued_per_group
        self._cv = threading.Condition()
        self._instances: dict[str, dict[str, int]] = {}  # group -> instance -> lease end
        self._checks: dict[str, deque] = {}
        self._queued_keys: dict[str, set] = {}
        self._pruned_ms = self.clock.now_ms()

    def heartbeat(self, group: str, instance: str) -> int:
        """Register or renew an instance's lease; returns the lease in ms.  Idempotent."""
        with self._cv:
            self._renew(group, instance)
            return self.lease_ms

    def _renew(self, group: str, instance: str) -> None:
        """(locked) ``instance``'s lease from now; at most once a lease, instances whose
        lease ran out are forgotten (a process that crashed never unregisters: each one
        stayed for good), and groups left with none, with their queued checks (the
        checker asks again, in its next round, once an instance is back)."""
        now = self.clock.now_ms()
        if now - self._pruned_ms > self.lease_ms:
            self._pruned_ms = now
            for g in list(self._instances):
                inst = self._instances[g]
                for i in [i for i, end in inst.items() if end <= now]:
                    del inst[i]
                if not inst:
                    del self._instances[g]
                    self._checks.pop(g, None)
                    self._queued_keys.pop(g, None)
        self._instances.setdefault(group, {})[instance] = now + self.lease_ms

    register = heartbeat

    def unregister(self, group: str, instance: str) -> None:
        with self._cv:
            self._instances.get(group, {}).pop(instance, None)

    def live(self, group: str) -> list[str]:
        now = self.clock.now_ms()
        with self._cv:
            return sorted(i for i, end in self._instances.get(group, {}).items() if end > now)

    def live_groups(self) -> list[str]:
        now = self.clock.now_ms()
        with self._cv:
            return sorted(g for g, inst in self._instances.items()
                          if any(end > now for end in inst.values()))

    def push_checks(self, group: str, requests: list[CheckRequest]) -> list[tuple[int, int, int]]:
        """Queue check requests of a group; returns ``(shard, origin, checks)`` of those it
        did not queue, for the checker to take back (a check nobody will be asked must
        not count): all of them when no instance of the group holds a lease any more,
        else those already queued (an earlier check of the same half is still waiting
        to be taken) or past ``max_queued_per_group``."""
        now = self.clock.now_ms()
        with self._cv:
            if not any(end > now for end in self._instances.get(group, {}).values()):
                return [(r.shard, r.origin, r.checks) for r in requests]
            q = self._checks.setdefault(group, deque())
            keys = self._queued_keys.setdefault(group, set())
            refused = []
            for r in requests:
                key = (r.shard, r.origin)
                if key in keys or len(q) >= self.max_queued:
                    refused.append((r.shard, r.origin, r.checks))
                    continue
                keys.add(key)
                q.append(r)
            if len(refused) < len(requests):
                self._cv.notify_all()
            return refused

    def poll_checks(self, group: str, instance: str, max_requests: int = 100,
                    wait_ms: int = 1000) -> list[CheckRequest]:
        """Take up to ``max_requests`` checks of the group, waiting up to ``wait_ms``.

        Also renews the caller's lease.  A taken request that is never answered
        is asked again by a later check round.
        """
        deadline = self.clock.monotonic_ms() + wait_ms
        with self._cv:
            self._renew(group, instance)
            while True:
                q = self._checks.get(group)
                if q:
                    out = [q.popleft() for _ in range(min(max_requests, len(q)))]
                    keys = self._queued_keys[group]
                    for r in out:
                        keys.discard((r.shard, r.origin))
                    return out
                remaining = deadline - self.clock.monotonic_ms()
                if remaining <= 0:
                    return []
                self._cv.wait(remaining / 1000.0)

    def status(self) -> dict:
        now = self.clock.now_ms()
        with self._cv:
            return {g: {"live": sorted(i for i, e in inst.items() if e > now),
                        "queued_checks": len(self._checks.get(g, ()))}
                    for g, inst in self._instances.items()}

    def ping(self) -> dict:
        return {"registry": True, "pid": os.getpid()}
