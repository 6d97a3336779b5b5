"""The controller: topics, queue -> shard routing, consumer-group membership.

The name-server role.  A plain class (no Ray import), made an actor at the
edge.  Topic metadata is durable (an atomically rewritten JSON file);
membership is soft state rebuilt from heartbeats after a restart.

Queue ownership in a consumer group is leased: a queue moves to its new owner
only after the old owner released it (reported in its heartbeat that it no
longer holds it) or its session expired, so two members never consume the
same queue at the same time -- which is what ordered consumption needs.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field

from raymq.actors.config import ClusterConfig
from raymq.actors.protocol import check_group, check_user_topic, dlq_topic, retry_topic
from raymq.storage.clock import Clock, SystemClock
from raymq.storage.errors import InvalidMessageError, TopicExistsError, UnknownTopicError
from raymq.storage.fileutil import atomic_write

log = logging.getLogger("raymq.controller")

MAX_QUEUES = 1024


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


class Controller:
    def __init__(self, config: dict | ClusterConfig, *, clock: Clock | None = None,
                 restarted: bool = False):
        """``restarted``: this controller replaces one that died.  Group membership was
        soft state and is gone, so for a session timeout a queue nobody re-announces is not
        handed out: its holder may not have heartbeated yet."""
        self.config = config if isinstance(config, ClusterConfig) else ClusterConfig.from_dict(config)
        self.clock = clock or SystemClock()
        self._grace_until = self.clock.now_ms() + self.config.session_timeout_ms \
            if restarted else 0
        self.directory = os.path.join(self.config.resolved_data_dir(), "controller")
        os.makedirs(self.directory, exist_ok=True)
        self._path = os.path.join(self.directory, "meta.json")
        self._lock = threading.RLock()
        self._topics: dict[str, dict] = {}
        self._shard_nodes: dict[str, str] = {}
        self._groups: dict[str, Group] = {}
        self._load()

    # ----------------------------------------------------------- durable
    def _load(self) -> None:
        try:
            with open(self._path) as f:
                doc = json.load(f)
        except FileNotFoundError:
            return
        self._topics = doc.get("topics", {})
        self._shard_nodes = doc.get("shard_nodes", {})
        if doc.get("num_shards", self.config.num_shards) != self.config.num_shards:
            log.warning("controller: metadata was written for %s shards, config says %s; "
                        "keeping the routes on disk", doc.get("num_shards"), self.config.num_shards)

    def _save(self) -> None:
        doc = {"format": "raymq-controller", "version": 1, "num_shards": self.config.num_shards,
               "topics": self._topics, "shard_nodes": self._shard_nodes}
        atomic_write(self._path, json.dumps(doc, sort_keys=True, indent=1).encode())

    # ------------------------------------------------------------ topics
    def create_topic(self, name: str, queues: int | None = None, *, system: bool = False) -> dict:
        """Create a topic (idempotent for the same queue count); return its route."""
        if not system:
            check_user_topic(name)
        queues = self.config.default_queues if queues is None else queues
        if isinstance(queues, bool) or not isinstance(queues, int) or not 1 <= queues <= MAX_QUEUES:
            raise InvalidMessageError(f"queues must be 1..{MAX_QUEUES}, got {queues!r}")
        with self._lock:
            existing = self._topics.get(name)
            if existing is not None:
                if len(existing["routes"]) != queues:
                    raise TopicExistsError(f"topic {name!r} exists with "
                                           f"{len(existing['routes'])} queues, not {queues}")
                return self.describe_topic(name)
            n = self.config.num_shards
            if system and queues == n:
                routes = list(range(n))  # queue i on shard i (retry / dead-letter topics)
            else:
                first = len(self._topics) % n  # spread the first queues of topics
                routes = [(first + i) % n for i in range(queues)]
            self._topics[name] = {"routes": routes, "created_ms": self.clock.now_ms(),
                                  "system": system}
            self._save()
            log.info("controller: created topic %s with %d queues", name, queues)
            return self.describe_topic(name)

    def ensure_group_topics(self, group: str) -> None:
        """The retry and dead-letter topics of a consumer group (queue i on shard i)."""
        check_group(group)
        for topic in (retry_topic(group), dlq_topic(group)):
            if topic not in self._topics:
                self.create_topic(topic, self.config.num_shards, system=True)

    def describe_topic(self, name: str) -> dict:
        with self._lock:
            t = self._topics.get(name)
            if t is None:
                raise UnknownTopicError(f"topic {name!r} does not exist")
            return {"topic": name, "queues": len(t["routes"]), "routes": list(t["routes"]),
                    "system": t.get("system", False), "created_ms": t["created_ms"]}

    def topics(self, *, include_system: bool = False) -> dict[str, dict]:
        with self._lock:
            return {name: self.describe_topic(name) for name in sorted(self._topics)
                    if include_system or not self._topics[name].get("system")}

    def routes(self, names: list[str]) -> dict[str, list[int] | None]:
        with self._lock:
            return {n: (list(self._topics[n]["routes"]) if n in self._topics else None)
                    for n in names}

    def shard_routes(self, shard: int) -> list[tuple[str, int]]:
        with self._lock:
            return [(name, qid) for name, t in self._topics.items()
                    for qid, s in enumerate(t["routes"]) if s == shard]

    # ------------------------------------------------------------- nodes
    def shard_node(self, shard: int) -> str | None:
        with self._lock:
            return self._shard_nodes.get(str(shard))

    def set_shard_node(self, shard: int, node: str) -> None:
        with self._lock:
            if self._shard_nodes.get(str(shard)) != node:
                self._shard_nodes[str(shard)] = node
                self._save()

    # ------------------------------------------------------------ groups
    def heartbeat(self, group: str, member_id: str, topics: list[str],
                  held: list[tuple[str, int]], client: str = "") -> dict:
        """A consumer's heartbeat: returns the queues it may own now and those to release.

        ``held`` are the queues the member holds right now; a queue it no
        longer reports is free for its next owner.
        """
        check_group(group)
        now = self.clock.now_ms()
        with self._lock:
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
            settling = now < self._grace_until
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
                if now - info.last_seen_ms > self.config.session_timeout_ms]
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
            t = self._topics.get(topic)
            if t is None:
                continue
            queues = [(topic, q) for q in range(len(t["routes"]))]
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

    def ping(self) -> dict:
        return {"controller": True, "pid": os.getpid(), "num_shards": self.config.num_shards}

    def get_config(self) -> dict:
        """The cluster's configuration (clients adopt it: delay levels, limits...)."""
        return self.config.to_dict()
