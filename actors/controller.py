"""The controller: topics, queue -> shard routing, the cluster config, group membership.

The name-server role.  A plain class (no Ray import), made an actor at the
edge.  Topic metadata is durable (an atomically rewritten JSON file);
consumer-group membership is ``membership.Membership`` (soft state).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time

from raymq.actors.config import ClusterConfig
from raymq.actors.groups.membership import Membership
from raymq.actors.replication.groups import ReplicaGroups
from raymq.actors.protocol import (check_group, check_retention, check_user_topic, dlq_topic,
                                   retry_topic)
from raymq.storage.clock import Clock, SystemClock
from raymq.storage.errors import (BrokerUnavailableError, ControllerRecoveringError,
                                  InvalidMessageError,
                                  QuotaExceededError, TopicExistsError, UnknownTopicError)
from raymq.storage.fileutil import atomic_write
from raymq.storage.retention import TopicRetention

log = logging.getLogger("raymq.controller")

MAX_QUEUES = 1024


class Controller:
    def __init__(self, config: dict | ClusterConfig, *, clock: Clock | None = None,
                 restarted: bool = False):
        """``restarted``: this controller replaces one that died.  Group membership was
        soft state and is gone, so for a session timeout a queue nobody re-announces is not
        handed out: its holder may not have heartbeated yet."""
        self.config = config if isinstance(config, ClusterConfig) else ClusterConfig.from_dict(config)
        self.clock = clock or SystemClock()
        self.directory = os.path.join(self.config.resolved_data_dir(), "controller")
        os.makedirs(self.directory, exist_ok=True)
        self._path = os.path.join(self.directory, "meta.json")
        self._lock = threading.RLock()
        self._topics: dict[str, dict] = {}
        self._shard_nodes: dict[str, str] = {}
        self._replica_groups: dict = {}
        self._coordinator_groups: dict = {}
        #: topics and nodes change this (kept by every replica: ``mirror``)
        self._meta_version = 0
        self._deleted: list[str] = []  # topics deleted lately (the last 1000), oldest first
        #: deleted topics some shard has not confirmed dropping (not created again before)
        self._deleting = DeletingTopics(self.config.num_shards)
        self._meta_on_disk = False
        self._meta_wanted = 0  # a newer version a replica keeps (this controller lost it)
        self._meta_kept: dict[str, int] = {}  # replica -> the metadata version it keeps
        self._kept_cv = threading.Condition()
        self._load()
        #: the shards' groups of replicas (of one when not replicated): leaders, epochs,
        #: in-sync sets
        self.replica_groups = ReplicaGroups(
            self.config.num_shards, self.config.replication_factor,
            self.config.replica_lease_ms, self.clock, self._save, self._replica_groups,
            known=False)  # (a group not on record: taken from what its replicas keep)
        #: the transaction coordinators' groups, replicated as shards are
        self.coordinator_groups = ReplicaGroups(
            self.config.num_coordinators, self.config.replication_factor,
            self.config.replica_lease_ms, self.clock, self._save, self._coordinator_groups,
            kind="coordinator", known=False)
        self.membership = Membership(self.clock, self.config.session_timeout_ms,
                                     self._queue_count, restarted=restarted,
                                     max_groups=self.config.max_groups)

    # ----------------------------------------------------------- durable
    def _load(self) -> None:
        try:
            with open(self._path) as f:
                doc = json.load(f)
        except FileNotFoundError:
            return
        self._topics = doc.get("topics", {})
        self._shard_nodes = doc.get("shard_nodes", {})
        self._replica_groups = doc.get("replica_groups", {})
        self._coordinator_groups = doc.get("coordinator_groups", {})
        self._deleted = list(doc.get("deleted_topics", []))
        self._deleting = DeletingTopics(self.config.num_shards, doc.get("deleting_topics"))
        self._meta_version = int(doc.get("meta_version", 0))
        self._meta_on_disk = True
        if doc.get("num_shards", self.config.num_shards) != self.config.num_shards:
            log.warning("controller: metadata was written for %s shards, config says %s; "
                        "keeping the routes on disk", doc.get("num_shards"), self.config.num_shards)

    def _save(self) -> None:
        doc = {"format": "raymq-controller", "version": 1, "num_shards": self.config.num_shards,
               "topics": self._topics, "shard_nodes": self._shard_nodes,
               "meta_version": self._meta_version, "deleted_topics": self._deleted,
               "deleting_topics": self._deleting.entries}
        groups = getattr(self, "replica_groups", None)
        if groups is not None:
            doc["replica_groups"] = groups.to_doc()
            doc["coordinator_groups"] = self.coordinator_groups.to_doc()
        atomic_write(self._path, json.dumps(doc, sort_keys=True, indent=1).encode())

    # ------------------------------------------------------------ topics
    def create_topic(self, name: str, queues: int | None = None, *, system: bool = False,
                     retention_ms: int | None = None, retention_bytes: int | None = None) -> dict:
        """Create a topic (idempotent for the same queue count); return its route.  Its own
        ``retention_ms`` / ``retention_bytes`` (None: the cluster's)."""
        if not system:
            check_user_topic(name)
        retention = check_retention(retention_ms, retention_bytes)
        queues = self.config.default_queues if queues is None else queues
        if isinstance(queues, bool) or not isinstance(queues, int) or not 1 <= queues <= MAX_QUEUES:
            raise InvalidMessageError(f"queues must be 1..{MAX_QUEUES}, got {queues!r}")
        with self._lock:
            self._check_meta_known()
            existing = self._topics.get(name)
            if existing is not None:
                if len(existing["routes"]) != queues:
                    raise TopicExistsError(f"topic {name!r} exists with "
                                           f"{len(existing['routes'])} queues, not {queues}")
            else:
                self._deleting.refuse(name, self.config.retention_check_ms)
                self._add_topic(name, queues, system, retention)
            version = self._meta_version  # (asked again: it may not be kept yet)
        self._wait_kept(version, f"topic {name!r}")
        return self.describe_topic(name)

    def _add_topic(self, name: str, queues: int, system: bool, retention: dict) -> None:
        """(under the lock) A new topic's routes, saved."""
        if not system:
            user = sum(1 for t in self._topics.values() if not t.get("system"))
            if user >= self.config.max_topics:
                raise QuotaExceededError(f"cannot create topic {name!r}: the cluster holds "
                                         f"{user} topics, its max_topics")
        n = self.config.num_shards
        if system and queues == n:
            routes = list(range(n))  # queue i on shard i (retry / dead-letter topics)
        else:
            first = len(self._topics) % n  # spread the first queues of topics
            routes = [(first + i) % n for i in range(queues)]
        self._topics[name] = {"routes": routes, "created_ms": self.clock.now_ms(),
                              "system": system, **retention}
        self._meta_version += 1
        self._save()
        log.info("controller: created topic %s with %d queues", name, queues)

    def _wait_kept(self, version: int, what: str) -> None:
        """(a replicated cluster) Return once a majority of a group's size of replicas keep
        metadata ``version`` (they take it with their next heartbeat): a controller that
        loses its node and files after this takes it back.  ``BrokerUnavailableError``
        (retriable: asking again waits again) when they did not within two leases."""
        if self.config.replication_factor == 1:
            return
        need = self.config.replication_factor // 2 + 1
        deadline = time.monotonic() + 2 * self.config.replica_lease_ms / 1000
        with self._kept_cv:
            while sum(1 for v in self._meta_kept.values() if v >= version) < need:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrokerUnavailableError(
                        f"{what} is saved by the controller, but fewer than {need} replicas "
                        f"took it within {2 * self.config.replica_lease_ms} ms: ask again")
                self._kept_cv.wait(left)

    def ensure_group_topics(self, group: str) -> None:
        """The retry and dead-letter topics of a consumer group (queue i on shard i)."""
        check_group(group)
        for topic in (retry_topic(group), dlq_topic(group)):
            if topic not in self._topics:
                self.create_topic(topic, self.config.num_shards, system=True)

    def describe_topic(self, name: str) -> dict:
        with self._lock:
            self._check_meta_known()
            t = self._topics.get(name)
            if t is None:
                raise UnknownTopicError(f"topic {name!r} does not exist")
            retention = TopicRetention(self.config.retention_ms,
                                       self.config.retention_bytes).over(t)
            return {"topic": name, "queues": len(t["routes"]), "routes": list(t["routes"]),
                    "system": t.get("system", False), "created_ms": t["created_ms"],
                    "retention_ms": retention.ms, "retention_bytes": retention.bytes}

    def alter_topic(self, name: str, *, retention_ms: int | None = None,
                    retention_bytes: int | None = None, queues: int | None = None) -> dict:
        """Set a topic's own retention (a setting left None stays as it is), or grow it to
        ``queues`` queues (a topic never shrinks: each queue keeps its messages and
        offsets; the new ones are spread over the shards after the last)."""
        retention = check_retention(retention_ms, retention_bytes)
        if queues is not None and (isinstance(queues, bool) or not isinstance(queues, int)
                                   or not 1 <= queues <= MAX_QUEUES):
            raise InvalidMessageError(f"queues must be 1..{MAX_QUEUES}, got {queues!r}")
        with self._lock:
            self._check_meta_known()
            t = self._topics.get(name)
            if t is None:
                raise UnknownTopicError(f"topic {name!r} does not exist")
            have = len(t["routes"])
            if queues is not None and (queues < have or t.get("system")):
                raise InvalidMessageError(
                    f"topic {name!r} is RayMQ's own: its queues are fixed" if t.get("system")
                    else f"topic {name!r} has {have} queues: a topic grows, never shrinks")
            t.update(retention)
            if queues is not None and queues > have:
                n = self.config.num_shards
                t["routes"] = t["routes"] + [(t["routes"][-1] + 1 + i) % n
                                             for i in range(queues - have)]
            self._meta_version += 1
            self._save()
            version = self._meta_version
        self._wait_kept(version, f"topic {name!r}")
        log.info("controller: topic %s now %s%s", name, retention,
                 f", {queues} queues" if queues else "")
        return self.describe_topic(name)

    def delete_topic(self, name: str) -> dict:
        """Delete a user topic: its routes go at once (sends and pulls get
        ``UnknownTopicError``); each shard then drops what it holds of it (the client asks
        them at once, and a shard's janitor finds it in ``topic_settings`` too).  A topic
        created again with the name is a new, empty one."""
        check_user_topic(name)
        with self._lock:
            self._check_meta_known()
            t = self._topics.pop(name, None)
            if t is None:
                raise UnknownTopicError(f"topic {name!r} does not exist")
            self._deleted = [d for d in self._deleted if d != name][-999:]
            self._deleted.append(name)
            self._meta_version += 1
            version = self._meta_version
            self._deleting.add(name, t["routes"], version)
            self._save()
        self._wait_kept(version, f"the deletion of topic {name!r}")
        log.warning("controller: deleted topic %s (%d queues)", name, len(t["routes"]))
        return {"topic": name, "queues": len(t["routes"]), "routes": list(t["routes"]),
                "deletion": version}

    def topic_dropped(self, name: str, shards: list[int], deletion: int | None = None,
                      why: dict | None = None) -> None:
        """Shards ``shards`` dropped deleted topic ``name`` (``DeletingTopics.confirm``:
        ``deletion`` is ``delete_topic``'s answer; ``why``: why others refused for now)."""
        with self._lock:
            if self._deleting.confirm(name, shards, deletion, why):
                self._meta_version += 1  # (the replicas' mirror follows)
                self._save()

    def topic_settings(self, shard: int | None = None, dropped: dict | None = None) -> dict:
        """What shards need of the topics beyond their routes: each topic's own retention,
        the topics deleted lately (a shard drops what it still holds of them), and of
        those the ones some shards have not confirmed dropping (``deleting``).  A shard's
        janitor confirms with its next call: ``dropped`` (deleted topic -> its
        ``deletion``) are those shard ``shard`` dropped."""
        for name, deletion in (dropped or {}).items() if shard is not None else ():
            self.topic_dropped(name, [shard], deletion)
        with self._lock:
            deleted = [d for d in self._deleted if d not in self._topics]
            deleted += [d for d in self._deleting.entries  # (pending past the cap too)
                        if d not in deleted and d not in self._topics]
            return {"deleted": deleted, "deleting": self._deleting.for_shards(),
                    "topics": {n: {k: t[k] for k in ("retention_ms", "retention_bytes")
                                   if t.get(k) is not None}
                               for n, t in self._topics.items()
                               if t.get("retention_ms") is not None
                               or t.get("retention_bytes") is not None}}

    def topics(self, *, include_system: bool = False) -> dict[str, dict]:
        with self._lock:
            self._check_meta_known()
            return {name: self.describe_topic(name) for name in sorted(self._topics)
                    if include_system or not self._topics[name].get("system")}

    def routes(self, names: list[str]) -> dict[str, list[int] | None]:
        with self._lock:
            self._check_meta_known()
            return {n: (list(self._topics[n]["routes"]) if n in self._topics else None)
                    for n in names}

    def shard_routes(self, shard: int) -> list[tuple[str, int]]:
        with self._lock:
            self._check_meta_known()
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
                self._meta_version += 1
                self._save()

    # ------------------------------------------------------ replica groups
    def replica_heartbeat(self, shard: int, name: str, node: str, epoch: int, log_end: int,
                          in_sync: list[str] | None = None, fresh: bool = False,
                          reported: dict | None = None) -> dict:
        """A shard replica lives (``ReplicaGroups.heartbeat``: ``reported`` holds its
        ``log_epoch``, ``isr_version`` and ``kept``): its group's assignment."""
        reported = dict(reported or {})
        mirror = {k: reported.pop(k, None) for k in ("meta_version", "meta")}
        with self._lock:
            doc = self._groups_of(name).heartbeat(shard, name, node, epoch, log_end,
                                                  in_sync, fresh, **reported)
            out = {**doc, **self._mirror(**mirror)}
        if mirror["meta_version"] is not None:
            with self._kept_cv:
                self._meta_kept[name] = int(mirror["meta_version"])
                self._kept_cv.notify_all()
        return out

    # ---------------------------------------------------- mirrored metadata
    def _mirror(self, meta_version: int | None, meta: dict | None) -> dict:
        """(under the lock) Every replica keeps the controller's topics and nodes: a
        heartbeat says which version it keeps (and brings it when asked); the answer says
        this controller's, and carries it to a replica keeping an older one.  A controller
        that lost its files takes the newest a replica keeps (and creates no topic before
        it looked)."""
        if meta is not None and int(meta.get("meta_version", 0)) > self._meta_version:
            log.warning("controller: took the topics and routes a replica keeps (version "
                        "%s; this controller had %s: its files were lost?)",
                        meta["meta_version"], self._meta_version)
            self._topics = dict(meta.get("topics", {}))
            self._shard_nodes = dict(meta.get("shard_nodes", {}))
            self._deleting = DeletingTopics(self.config.num_shards, meta.get("deleting"))
            self._meta_version = int(meta["meta_version"])
            self._save()
        if meta_version is not None and int(meta_version) > self._meta_version:
            self._meta_wanted = max(self._meta_wanted, int(meta_version))
            return {"meta_version": self._meta_version, "send_meta": True}
        if self._meta_wanted <= self._meta_version:
            self._meta_wanted = 0
        out = {"meta_version": self._meta_version}
        if meta_version is not None and int(meta_version) < self._meta_version:
            out["meta"] = self.metadata()
        return out

    def metadata(self) -> dict:
        """What replicas keep of this controller: topics, routes and nodes, versioned;
        the deleted topics shards have not dropped yet (a controller that takes them back
        does not create such a name again early)."""
        return {"topics": self._topics, "shard_nodes": self._shard_nodes,
                "deleting": self._deleting.entries, "meta_version": self._meta_version}

    def _check_meta_known(self) -> None:
        """(a replicated cluster) Before a change of topics: this controller holds the
        newest metadata -- its own file, or, without one, what the replicas keep."""
        if self.config.replication_factor == 1 or self._meta_on_disk:
            return
        if self._meta_wanted or not all(g["known"] for g in self.replica_groups.groups.values()):
            raise ControllerRecoveringError(
                "the controller is taking back its topics from the shards' replicas (its "
                "files were lost, or it is new): try again in a few seconds")

    def _groups_of(self, replica: str) -> ReplicaGroups:
        return self.coordinator_groups if str(replica).startswith("coordinator-") \
            else self.replica_groups

    def replica_alter_isr(self, shard: int, name: str, epoch: int, in_sync: list[str],
                          version: int | None = None) -> tuple[bool, dict]:
        with self._lock:
            return self._groups_of(name).alter_isr(shard, name, epoch, in_sync, version)

    def replica_elect(self, shard: int, to: str | None = None, unclean: bool = False,
                      kind: str = "shard") -> dict:
        """An operator moves a shard's (``kind="coordinator"``: a coordinator's)
        leadership (``raymq shard elect``, ``raymq coordinator elect``)."""
        with self._lock:
            groups = self.coordinator_groups if kind == "coordinator" else self.replica_groups
            return groups.elect(shard, to=to, unclean=unclean)

    def replica_leaders(self) -> dict[int, tuple[str | None, int]]:
        """Each shard's leading replica and epoch (elections whose lease ran out first)."""
        with self._lock:
            self.replica_groups.tick()
            return {i: self.replica_groups.leader(i) for i in range(self.config.num_shards)}

    def coordinator_leaders(self) -> dict[int, tuple[str | None, int]]:
        """Each replicated coordinator's leading replica and epoch."""
        with self._lock:
            self.coordinator_groups.tick()
            return {i: self.coordinator_groups.leader(i)
                    for i in range(self.config.num_coordinators)}

    def coordinator_replicas(self) -> list[dict]:
        with self._lock:
            self.coordinator_groups.tick()
            return self.coordinator_groups.describe()

    def replicas(self) -> list[dict]:
        with self._lock:
            self.replica_groups.tick()
            return self.replica_groups.describe()

    # ------------------------------------------------------------ groups
    def heartbeat(self, group: str, member_id: str, topics: list[str],
                  held: list[tuple[str, int]], client: str = "") -> dict:
        """A consumer's heartbeat (``Membership.heartbeat``)."""
        return self.membership.heartbeat(group, member_id, topics, held, client)

    def leave(self, group: str, member_id: str) -> None:
        self.membership.leave(group, member_id)

    def groups(self) -> dict[str, dict]:
        return self.membership.groups()

    def _queue_count(self, topic: str) -> int | None:
        with self._lock:
            t = self._topics.get(topic)
            return None if t is None else len(t["routes"])

    def ping(self) -> dict:
        return {"controller": True, "pid": os.getpid(), "num_shards": self.config.num_shards}

    def get_config(self) -> dict:
        """The cluster's configuration (clients adopt it: delay levels, limits...)."""
        return self.config.to_dict()


class DeletingTopics:
    """The deleted topics some shard of their routes has not confirmed dropping yet (an
    open Kafka-style transaction writes to it there, or the shard was not reached):
    name -> {"shards": [...], "version": the deletion's meta version, "why": {shard:
    reason}}.  As Kafka's "marked for deletion": the name is not created again before
    (a shard would keep the old queues, offsets and records, and the new topic would
    continue at the old offsets).  An entry goes once its last shard confirmed."""

    def __init__(self, num_shards: int, entries: dict | None = None):
        self.num_shards = num_shards
        self.entries: dict[str, dict] = {}
        for name, d in (entries or {}).items():  # (a shard this cluster no longer has
            # drops nothing and never confirms: not waited for)
            shards = [int(s) for s in d["shards"] if 0 <= int(s) < num_shards]
            if len(shards) < len(d["shards"]):
                log.warning("controller: deleted topic %s: shards %s no longer exist, not "
                            "waited for", name, sorted(set(d["shards"]) - set(shards)))
            if shards:
                self.entries[name] = {**d, "shards": shards}

    def add(self, name: str, routes: list[int], version: int) -> None:
        shards = {s for s in routes if 0 <= s < self.num_shards}
        if name in self.entries:  # (an older deletion not confirmed: waited for too)
            shards |= set(self.entries[name]["shards"])
        if shards:
            self.entries[name] = {"shards": sorted(shards), "version": version}

    def confirm(self, name: str, shards: list[int], deletion: int | None,
                why: dict | None) -> bool:
        """Shards ``shards`` dropped ``name``; ``why``: shard -> why another refused for
        now.  A late confirmation of an earlier deletion of the name (``deletion``, its
        version) confirms nothing of a newer one.  Whether anything changed."""
        d = self.entries.get(name)
        if d is None or (deletion is not None and int(deletion) != d["version"]):
            return False
        done = {int(s) for s in shards}
        left = [s for s in d["shards"] if s not in done]
        reasons = {**d.get("why", {}), **{str(s): str(r)[:300] for s, r in (why or {}).items()}}
        reasons = {s: r for s, r in reasons.items() if int(s) in left}
        if left == d["shards"] and reasons == d.get("why", {}):
            return False
        if left:
            self.entries[name] = {**d, "shards": left, "why": reasons}
        else:
            del self.entries[name]
            log.info("controller: every shard dropped deleted topic %s", name)
        return True

    def refuse(self, name: str, check_ms: int) -> None:
        """``BrokerUnavailableError`` (retriable: the janitors retry the drop by themselves,
        every ``check_ms``) naming the shards ``name`` still waits for, and why."""
        d = self.entries.get(name)
        if d is None:
            return
        why = d.get("why", {})
        shards = ", ".join(f"shard-{s}" + (f" ({why[str(s)]})" if str(s) in why else "")
                           for s in d["shards"])
        raise BrokerUnavailableError(
            f"topic {name!r} is still being deleted: {shards} did not drop the old "
            f"topic's queues, offsets and records yet (an open Kafka-style transaction "
            f"writes to it, or the shard was not reached; its janitor retries every "
            f"{check_ms} ms): create it again once they did")

    def for_shards(self) -> dict:
        """What janitors are told: each name's shards still to drop it, and its version."""
        return {n: {"shards": list(d["shards"]), "version": d["version"]}
                for n, d in self.entries.items()}
