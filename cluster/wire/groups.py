"""Kafka's classic consumer-group protocol, as a group coordinator runs it: members join,
the coordinator picks a protocol every member supports and a leader, the leader's
assignment is handed out by SyncGroup, heartbeats keep members and tell them of a new
rebalance.  Pure Python (threads and a monotonic clock): no sockets, no Ray.

States (Kafka's ``GroupCoordinator``): *Empty*; *PreparingRebalance* (JoinGroups are held
until every member known has joined again, or the largest rebalance timeout passed:
the ones that did not are dropped); *CompletingRebalance* (the new generation is out,
waiting for the leader's assignment); *Stable*.  A member silent for its session
timeout is dropped and the others rebalance.  An empty group waits
``initial_delay_s`` for more members before its first generation (Kafka's
``group.initial.rebalance.delay.ms``).
"""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

# Kafka's error codes of the group protocol.
NONE = 0
ILLEGAL_GENERATION, INCONSISTENT_GROUP_PROTOCOL = 22, 23
UNKNOWN_MEMBER_ID, INVALID_SESSION_TIMEOUT, REBALANCE_IN_PROGRESS = 25, 26, 27
#: The session timeouts a member may ask (Kafka's group.min/max.session.timeout.ms, the
#: least lowered for tests) and the longest rebalance timeout taken.
SESSION_MS = (1_000, 1_800_000)
MEMBER_ID_REQUIRED = 79

EMPTY, PREPARING, COMPLETING, STABLE = "Empty", "PreparingRebalance", \
    "CompletingRebalance", "Stable"


@dataclass
class Member:
    id: str
    protocols: list  # [(name, metadata)]
    session_ms: int
    rebalance_ms: int
    seen_s: float
    joined: bool = True  # (joined this rebalance)
    assignment: bytes = b""


@dataclass
class Group:
    id: str
    state: str = EMPTY
    generation: int = 0
    protocol_type: str | None = None
    protocol: str | None = None
    leader: str | None = None
    members: dict[str, Member] = field(default_factory=dict)
    deadline_s: float = 0.0
    emptied_s: float = 0.0  # when its last member left or ran out of session


@dataclass(frozen=True)
class Joined:
    error: int
    member_id: str
    generation: int = -1
    protocol: str | None = None
    leader: str = ""
    members: tuple = ()  # ((member id, metadata),) for the leader; () for the others


#: How often a join sweeps out the groups whose members all died (``ClassicGroups._sweep``),
#: and how long an empty group is kept (its generations go on if it is joined again).
SWEEP_S, EMPTY_KEPT_S = 60.0, 86_400.0


class ClassicGroups:
    """Every classic group of one coordinator."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 initial_delay_s: float = 0.3):
        self.clock = clock
        self.initial_delay_s = initial_delay_s
        self._cond = threading.Condition()
        self._groups: dict[str, Group] = {}
        self._swept_s = clock()

    # ------------------------------------------------------------------ join
    def join(self, group_id: str, member_id: str, protocol_type: str, protocols: list,
             session_ms: int, rebalance_ms: int, *, client_id: str = "member",
             require_known_id: bool = False) -> Joined:
        """A JoinGroup: held until the rebalance it is part of completes."""
        if not SESSION_MS[0] <= session_ms <= SESSION_MS[1]:
            return Joined(INVALID_SESSION_TIMEOUT, member_id)
        rebalance_ms = min(max(rebalance_ms, 1), SESSION_MS[1])
        with self._cond:
            if self.clock() - self._swept_s > SWEEP_S:  # (groups whose members all died)
                self._sweep()
            g = self._groups.setdefault(group_id, Group(group_id, emptied_s=self.clock()))
            self._expire(g)
            if not member_id:
                member_id = f"{client_id}-{uuid.uuid4()}"
                if require_known_id:  # (v4+: the client joins again with it)
                    return Joined(MEMBER_ID_REQUIRED, member_id)
            if g.members and g.protocol_type != protocol_type or not protocols or \
                    (g.members and not self._common(list(g.members.values()), protocols)):
                return Joined(INCONSISTENT_GROUP_PROTOCOL, member_id)
            now = self.clock()
            m = g.members.get(member_id)
            if m is not None and m.protocols == list(protocols) and (
                    g.state == COMPLETING or (g.state == STABLE and member_id != g.leader)):
                # (a join sent again, unchanged -- its client gave up waiting for the answer:
                # the current generation, no new rebalance; Kafka's GroupCoordinator)
                m.seen_s = now
                return self._joined(g, member_id)
            if m is None:
                m = g.members[member_id] = Member(member_id, list(protocols), session_ms,
                                                  rebalance_ms, now)
            m.protocols, m.session_ms, m.rebalance_ms, m.seen_s = list(protocols), \
                session_ms, rebalance_ms, now
            g.protocol_type = protocol_type
            if g.state != PREPARING:
                self._prepare(g, first=g.generation == 0 or g.state == EMPTY)
            m.joined = True
            start = g.generation
            while True:
                self._expire(g)  # (one that died meanwhile holds it for its session only)
                self._maybe_complete(g)
                if g.generation != start or member_id not in g.members:
                    break
                self._cond.wait(max(0.01, min(g.deadline_s, self._next_expiry(g))
                                    - self.clock()))
            if member_id not in g.members:
                return Joined(UNKNOWN_MEMBER_ID, member_id)
            return self._joined(g, member_id)

    @staticmethod
    def _joined(g: Group, member_id: str) -> Joined:
        """(locked) The answer of a join of the current generation (the members and their
        metadata only for the leader)."""
        members = tuple((mid, dict(x.protocols)[g.protocol])
                        for mid, x in g.members.items()) if g.leader == member_id else ()
        return Joined(NONE, member_id, g.generation, g.protocol, g.leader, members)

    def _prepare(self, g: Group, *, first: bool) -> None:
        """(locked) A rebalance begins: every member must join again."""
        g.state = PREPARING
        for m in g.members.values():
            m.joined = False
        longest = max((m.rebalance_ms for m in g.members.values()), default=0) / 1000.0
        g.deadline_s = self.clock() + (min(self.initial_delay_s, longest) if first else longest)
        self._cond.notify_all()

    def _maybe_complete(self, g: Group) -> None:
        """(locked) Complete the rebalance once every member joined again or its time is
        up (those that did not are dropped): the next generation."""
        if g.state != PREPARING:
            return
        everyone = all(m.joined for m in g.members.values())
        if self.clock() < g.deadline_s and not (everyone and not self._first_wait(g)):
            return
        for mid in [mid for mid, m in g.members.items() if not m.joined]:
            del g.members[mid]
        if not g.members:
            g.state, g.leader, g.protocol = EMPTY, None, None
            g.emptied_s = self.clock()
            self._cond.notify_all()
            return
        g.generation += 1
        g.protocol = self._common(list(g.members.values()))
        if g.leader not in g.members:
            g.leader = next(iter(g.members))
        for m in g.members.values():
            m.assignment = b""
        g.state = COMPLETING
        self._cond.notify_all()

    def _first_wait(self, g: Group) -> bool:
        """Whether a group's first generation still waits out the initial delay."""
        return g.generation == 0 and self.clock() < g.deadline_s

    @staticmethod
    def _common(members: list[Member], extra: list | None = None) -> str | None:
        """The first protocol (in the first member's order) every member supports."""
        sets = [{n for n, _m in m.protocols} for m in members]
        if extra is not None:
            sets.append({n for n, _m in extra})
        order = [n for n, _m in (members[0].protocols if members else extra or [])]
        return next((n for n in order if all(n in s for s in sets)), None)

    # ------------------------------------------------------------------ sync
    def sync(self, group_id: str, generation: int, member_id: str,
             assignments: dict[str, bytes]) -> tuple[int, bytes]:
        """A SyncGroup: the leader's hands the assignment out; each member waits for it."""
        with self._cond:
            g = self._groups.get(group_id)
            error = self._check(g, generation, member_id)
            if error:
                return error, b""
            g.members[member_id].seen_s = self.clock()
            if g.state == PREPARING:
                return REBALANCE_IN_PROGRESS, b""
            if member_id == g.leader and g.state == COMPLETING:
                for mid, m in g.members.items():
                    m.assignment = assignments.get(mid, b"")
                g.state = STABLE
                self._cond.notify_all()
            deadline = self.clock() + g.members[member_id].rebalance_ms / 1000.0
            while g.state == COMPLETING and g.generation == generation and \
                    member_id in g.members and self.clock() < deadline:
                self._cond.wait(max(0.01, deadline - self.clock()))
            if member_id not in g.members or g.generation != generation:
                return ILLEGAL_GENERATION, b""
            if g.state != STABLE:
                return REBALANCE_IN_PROGRESS, b""
            return NONE, g.members[member_id].assignment

    # ------------------------------------------------------- heartbeat, leave
    def heartbeat(self, group_id: str, generation: int, member_id: str) -> int:
        with self._cond:
            g = self._groups.get(group_id)
            if g is not None:
                self._expire(g)
            error = self._check(g, generation, member_id)
            if error:
                return error
            g.members[member_id].seen_s = self.clock()
            return REBALANCE_IN_PROGRESS if g.state == PREPARING else NONE

    def leave(self, group_id: str, member_ids: list[str]) -> list[int]:
        """Members leave (each: NONE or UNKNOWN_MEMBER_ID); the others rebalance."""
        with self._cond:
            g = self._groups.get(group_id)
            out = []
            for mid in member_ids:
                if g is None or mid not in g.members:
                    out.append(UNKNOWN_MEMBER_ID)
                    continue
                del g.members[mid]
                out.append(NONE)
            if g is not None and NONE in out:
                g.emptied_s = self.clock()
                self._rebalance_or_empty(g)
            return out

    def check_commit(self, group_id: str, generation: int, member_id: str, *,
                     transactional: bool = False) -> int:
        """Whether an OffsetCommit of this generation and member is taken (a commit of
        generation -1: a consumer outside the group protocol, taken while it is empty);
        not while the assignment is handed out (REBALANCE_IN_PROGRESS, as Kafka's),
        unless ``transactional`` (a TxnOffsetCommit: its generation is checked only)."""
        with self._cond:
            g = self._groups.get(group_id)
            if generation < 0:
                return NONE if g is None or not g.members else ILLEGAL_GENERATION
            error = self._check(g, generation, member_id)
            if not error:
                g.members[member_id].seen_s = self.clock()
                if g.state == COMPLETING and not transactional:
                    return REBALANCE_IN_PROGRESS
            return error

    def describe(self, group_id: str) -> dict | None:
        """A group as its members alive now make it (None: no such group)."""
        with self._cond:
            g = self._seen(group_id)
            if g is None:
                return None
            return {"state": g.state, "generation": g.generation, "protocol": g.protocol,
                    "protocol_type": g.protocol_type, "leader": g.leader,
                    "members": sorted(g.members)}

    def listed(self) -> list[tuple[str, str | None, str]]:
        """Every group with a member alive: ``(id, protocol type, state)``."""
        with self._cond:
            self._sweep()
            return [(g.id, g.protocol_type, g.state) for g in self._groups.values()]

    def members_of(self, group_id: str) -> list[tuple[str, bytes, bytes]]:
        """The members of a group: ``(member id, its metadata of the group's protocol, its
        assignment)``."""
        with self._cond:
            g = self._seen(group_id)
            if g is None:
                return []
            return [(m.id, dict(m.protocols).get(g.protocol, b""), m.assignment)
                    for m in g.members.values()]

    def _seen(self, group_id: str) -> Group | None:
        """(locked) A group after its members past their session were dropped (a member
        that dies never leaves: before, views showed it Stable with its dead members)."""
        g = self._groups.get(group_id)
        if g is not None:
            self._expire(g)
        return g

    def _sweep(self) -> None:
        """(locked) ``_seen`` of every group, and those empty for ``EMPTY_KEPT_S`` are
        forgotten (a join starts one again): what the coordinator keeps is bounded by the
        groups alive lately, not by every group id ever joined."""
        now = self._swept_s = self.clock()
        for group_id in list(self._groups):
            g = self._seen(group_id)
            if not g.members and g.state == EMPTY and now - g.emptied_s > EMPTY_KEPT_S:
                del self._groups[group_id]

    # ---------------------------------------------------------------- inside
    def _check(self, g: Group | None, generation: int, member_id: str) -> int:
        if g is None or member_id not in g.members:
            return UNKNOWN_MEMBER_ID
        if generation != g.generation:
            return ILLEGAL_GENERATION
        return NONE

    def _expire(self, g: Group) -> None:
        """(locked) Drop members silent past their session timeout; the others rebalance."""
        now = self.clock()
        gone = [mid for mid, m in g.members.items()
                if now - m.seen_s > m.session_ms / 1000.0 and not
                (g.state == PREPARING and m.joined)]
        ends = [g.members[mid].seen_s + g.members[mid].session_ms / 1000.0 for mid in gone]
        for mid in gone:
            del g.members[mid]
        if gone:
            g.emptied_s = max(ends)  # (when it became empty, if it did)
            self._rebalance_or_empty(g)

    @staticmethod
    def _next_expiry(g: Group) -> float:
        """(locked) When the first member that did not join again yet runs out of session."""
        return min((m.seen_s + m.session_ms / 1000.0 for m in g.members.values()
                    if not m.joined), default=g.deadline_s)

    def _rebalance_or_empty(self, g: Group) -> None:
        if g.members:
            if g.state != PREPARING:
                self._prepare(g, first=False)
        else:
            g.state, g.leader, g.protocol = EMPTY, None, None
        self._cond.notify_all()
