"""Consumer-group membership: members by heartbeat, queues allocated and leased to them.

Soft state (rebuilt from heartbeats after a controller restart).  Queue
ownership is leased: a queue moves to its new owner only after the old owner
released it (reported in its heartbeat that it no longer holds it) or its
session expired, so two members never consume the same queue at the same
time -- which is what ordered consumption needs.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

from raymq.actors.protocol import check_group
from raymq.storage.clock import Clock
from raymq.storage.errors import QuotaExceededError

log = logging.getLogger("raymq.controller")


@dataclass
class Member:
    member_id: str
    topics: tuple[str, ...]
    last_seen_ms: int
    client: str = ""


@dataclass
class Group:
    members: dict[str, Member] = field(default_factory=dict)
    owners: dict[tuple[str, int], str] = field(default_factory=dict)
    generation: int = 0
    announced: set[tuple[str, int]] = field(default_factory=set)  # held by someone since start


def allocate(queues: list[tuple[str, int]], members: list[str]) -> dict[str, list[tuple[str, int]]]:
    """RocketMQ's averaged allocation: contiguous blocks, the first members get one more."""
    out: dict[str, list[tuple[str, int]]] = {m: [] for m in members}
    if not members:
        return out
    n, k = len(queues), len(members)
    start = 0
    for i, m in enumerate(sorted(members)):
        size = n // k + (1 if i < n % k else 0)
        out[m] = queues[start:start + size]
        start += size
    return out


class Membership:
    """The consumer groups' members and queue owners; ``queues_of(topic)`` says how many
    queues a topic has (None: unknown topic)."""

    def __init__(self, clock: Clock, session_timeout_ms: int,
                 queues_of: Callable[[str], int | None], *, restarted: bool = False,
                 max_groups: int = 10_000):
        """``restarted``: this replaces a controller that died.  Membership was soft
        state and is gone, so for a session timeout a queue nobody re-announces is not
        handed out: its holder may not have heartbeated yet."""
        self.clock = clock
        self.session_timeout_ms = session_timeout_ms
        self._queues_of = queues_of
        self._grace_until_ms = clock.now_ms() + session_timeout_ms if restarted else 0
        self._lock = threading.RLock()
        self._groups: dict[str, Group] = {}
        self.max_groups = max_groups  # groups with members; empty ones make room

    def heartbeat(self, group: str, member_id: str, topics: list[str],
                  held: list[tuple[str, int]], client: str = "") -> dict:
        """A consumer's heartbeat: returns the queues it may own now and those to release.

        ``held`` are the queues the member holds right now; a queue it no
        longer reports is free for its next owner.
        """
        check_group(group)
        now = self.clock.now_ms()
        with self._lock:
            if group not in self._groups:
                self._make_room(now)
            g = self._groups.setdefault(group, Group())
            if member_id not in g.members:
                g.generation += 1
            g.members[member_id] = Member(member_id, tuple(sorted(set(topics))), now, client)
            self._expire(g, now)
            held_set = {(t, int(q)) for t, q in held}
            for q, owner in list(g.owners.items()):
                if owner == member_id and q not in held_set:
                    del g.owners[q]  # released
            for q in held_set:  # after a controller restart, holders re-announce
                g.owners.setdefault(q, member_id)
            desired = self._desired(group, g)
            mine = set(desired.get(member_id, []))
            settling = now < self._grace_until_ms
            if settling:
                g.announced |= held_set
            for q in mine:  # while settling, a queue nobody announced may have a silent holder
                if g.owners.get(q) == member_id or (
                        q not in g.owners and (not settling or q in g.announced)):
                    g.owners[q] = member_id
            granted = sorted(q for q, o in g.owners.items() if o == member_id and q in mine)
            # whatever it holds and does not own goes: moved to another member, or owned
            # by another already (a controller restart, a heartbeat after its expiry)
            release = sorted(q for q in held_set if q not in granted)
            return {"granted": granted, "release": release, "generation": g.generation,
                    "members": sorted(g.members)}

    def _make_room(self, now: int) -> None:
        """Room for one more group: groups left with no member and no queue are dropped;
        ``QuotaExceededError`` when ``max_groups`` still have members."""
        if len(self._groups) < self.max_groups:
            return
        for name, g in list(self._groups.items()):
            self._expire(g, now)
            if not g.members and not g.owners:
                del self._groups[name]
        if len(self._groups) >= self.max_groups:
            raise QuotaExceededError(f"{len(self._groups)} consumer groups have members, the "
                                     f"most the cluster takes (max_groups): a new group "
                                     f"waits until one has none")

    def leave(self, group: str, member_id: str) -> None:
        with self._lock:
            g = self._groups.get(group)
            if g is None:
                return
            if g.members.pop(member_id, None) is not None:
                g.generation += 1
            for q, owner in list(g.owners.items()):
                if owner == member_id:
                    del g.owners[q]

    def _expire(self, g: Group, now: int) -> None:
        dead = [m for m, info in g.members.items()
                if now - info.last_seen_ms > self.session_timeout_ms]
        for m in dead:
            log.info("controller: member %s expired", m)
            del g.members[m]
            g.generation += 1
            for q, owner in list(g.owners.items()):
                if owner == m:
                    del g.owners[q]

    def _desired(self, group: str, g: Group) -> dict[str, list[tuple[str, int]]]:
        by_topic: dict[str, list[str]] = {}
        for m in g.members.values():
            for t in m.topics:
                by_topic.setdefault(t, []).append(m.member_id)
        out: dict[str, list[tuple[str, int]]] = {}
        for topic, members in by_topic.items():
            n = self._queues_of(topic)
            if n is None:
                continue
            queues = [(topic, q) for q in range(n)]
            for m, qs in allocate(queues, members).items():
                out.setdefault(m, []).extend(qs)
        return out

    def groups(self) -> dict[str, dict]:
        now = self.clock.now_ms()
        with self._lock:
            out = {}
            for name, g in self._groups.items():
                self._expire(g, now)
                out[name] = {"generation": g.generation,
                             "members": {m: {"topics": list(i.topics), "client": i.client,
                                             "queues": sorted(q for q, o in g.owners.items()
                                                              if o == m)}
                                         for m, i in g.members.items()}}
            return out
