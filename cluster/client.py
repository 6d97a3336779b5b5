"""``connect()`` and the ``RayMQ`` handle: topics, routes, the clock and transport the
client's producers and consumers share, and ``Admin`` (look-ups, operator actions).

Every call to an actor goes through ``raymq.rpc``'s clients; the data path
through ``raymq.transport``.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from raymq import deploy as deployment
from raymq import replica_view, rpc
from raymq.actors.config import ClusterConfig
from raymq.actors.protocol import check_group
from raymq.clock import ClientClock, client_clock
from raymq.consumer import Consumer
from raymq.message import MessageExt, parse_msg_id
from raymq.producer import Producer
from raymq.transport import make_transport
from raymq.storage.clock import Clock
from raymq.storage.errors import InvalidMessageError, UnknownTopicError

log = logging.getLogger("raymq.client")


def connect(address: str | None = None, *, deploy: bool | None = None,
            config: dict | None = None, transport: str | None = None,
            clock: Clock | None = None, **overrides: Any) -> "RayMQ":
    """Attach to RayMQ on a Ray cluster.

    Ray (``raymq.rpc.init``): the one this process is attached to already; else
    ``address`` (or ``$RAY_ADDRESS``); else the cluster started on this machine
    (Ray's address file); else an embedded local Ray started here -- also when
    that file names a cluster that stopped without cleaning up.  A cluster that
    does not answer, or refuses this process (token authentication), is a
    one-line ``RayUnreachableError`` / ``RayAuthError`` within seconds.

    RayMQ: with ``deploy=None`` (default) it is deployed when missing only into
    an embedded Ray, one this process started, where nobody else can have
    deployed or stopped it -- so ``connect()`` works out of the box.  On a
    cluster it joined, RayMQ must be running (``raymq up``), else
    ``NotDeployedError`` says so: a client starting does not undo an operator's
    ``raymq down``.  ``deploy=True`` deploys what is missing on any cluster,
    ``deploy=False`` never deploys.  The settings (``config``, ``overrides``)
    are used by a first deploy only: a running RayMQ keeps its own (a difference
    is logged as a warning).

    ``transport`` ("direct" or "ray") picks how this client's producers and
    consumers reach the shards (default: the cluster's ``transport`` setting;
    see ``raymq.transport``).  ``clock`` is the time of every producer and
    consumer made through the handle (default: the system's; ``raymq.clock``).
    """
    asked = {**(config or {}), **overrides}
    cfg = ClusterConfig.from_dict(asked)
    rpc.init(address)  # (attached already: stays so)
    if deploy is None:
        deploy = rpc.embedded()
    if deploy:
        controller, shards = deployment.deploy(cfg)
    else:
        controller, shards = deployment.find_deployed()
    mq = RayMQ(controller, shards, transport=transport, clock=clock)
    diff = deployment.differences(mq.config, asked)
    if diff:
        log.warning("RayMQ runs with its own settings, not those given to connect(): %s",
                    "; ".join(diff))
    return mq


class RayMQ:
    def __init__(self, controller, shards: list, *, transport: str | None = None,
                 clock: Clock | None = None):
        #: the controller's Ray handle (``control`` calls it)
        self.controller = controller
        self.control = rpc.ControllerClient(controller)
        self._shards = shards if isinstance(shards, deployment.ShardLeaders) else list(shards)
        #: the time of this client's producers and consumers
        self.clock: ClientClock = client_clock(clock)
        self.config = ClusterConfig.from_dict(self.control.call("get_config", timeout_s=60))
        #: how producers and consumers reach the shards (``raymq.transport``)
        self.transport = make_transport(transport or self.config.transport, self.shard_handle,
                                        self.forget_leader)
        self._transport_kind = transport or self.config.transport
        self._coordinator_transport = None
        self._coordinator_leaders = None
        self._routes: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._clients: list = []
        self.admin = Admin(self)

    # ------------------------------------------------------------ routing
    def shard_handle(self, i: int):
        """Shard ``i``'s Ray handle."""
        return self._shards[i]

    def forget_leader(self, i: int) -> None:
        """Shard ``i``'s leader changed (or died): ask the controller next time."""
        if isinstance(self._shards, deployment.ShardLeaders):
            self._shards.forget(i)

    def shard(self, i: int) -> rpc.ShardClient:
        """Calls to shard ``i`` through Ray (the data path goes through ``transport``)."""
        return rpc.ShardClient(self._shards[i])

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    def routes_for(self, topics) -> dict[str, list[int]]:
        """queue -> shard of each topic; unknown topics are created if configured, else an error."""
        routes = self._routes
        if len(topics) == 1:
            for t in topics:
                r = routes.get(t)
                if r is not None:
                    return {t: r}
        with self._lock:
            missing = [t for t in topics if t not in self._routes]
        if missing:
            got = self.control.call("routes", missing, timeout_s=30)
            for t in missing:
                if got[t] is None:
                    if not self.config.auto_create_topics:
                        raise UnknownTopicError(f"topic {t!r} does not exist (create it with "
                                                "create_topic / `raymq topic create`)")
                    got[t] = self.create_topic(t)["routes"]
            with self._lock:
                self._routes.update(got)
        with self._lock:
            return {t: self._routes[t] for t in topics}

    # ------------------------------------------------------------- topics
    def create_topic(self, name: str, queues: int | None = None, *,
                     retention_ms: int | None = None,
                     retention_bytes: int | None = None) -> dict:
        """Create a topic of ``queues`` queues (the cluster's ``default_queues``), keeping its
        messages ``retention_ms`` and at most ``retention_bytes`` per queue (None: the
        cluster's ``retention_ms`` / ``retention_bytes``).  A name deleted lately is
        refused (``BrokerUnavailableError``, retriable) until every shard dropped the old
        topic: it would continue at the old offsets."""
        info = self.control.call("create_topic", name, queues, retention_ms=retention_ms,
                                 retention_bytes=retention_bytes, timeout_s=30)
        with self._lock:
            self._routes[name] = info["routes"]
        return info

    def alter_topic(self, name: str, *, retention_ms: int | None = None,
                    retention_bytes: int | None = None, queues: int | None = None) -> dict:
        """Change a topic's own retention (a setting left None stays as it is), or grow it
        to ``queues`` queues (never fewer; consumers get the new queues at their next
        heartbeat, producers that know the topic use them once they ask again:
        ``refresh_routes``)."""
        info = self.control.call("alter_topic", name, retention_ms=retention_ms,
                                 retention_bytes=retention_bytes, queues=queues, timeout_s=30)
        with self._lock:
            self._routes[name] = info["routes"]
        return info

    def learn_routes(self, routes: dict[str, list[int]]) -> None:
        """Routes of topics just read from the controller (``topics()``): kept as known."""
        with self._lock:
            self._routes.update(routes)

    def refresh_routes(self, topics) -> dict[str, list[int]]:
        """``routes_for``, asked of the controller again (a topic grown since)."""
        with self._lock:
            for t in topics:
                self._routes.pop(t, None)
        return self.routes_for(topics)

    def delete_topic(self, name: str) -> dict:
        """Delete a topic: its routes go at once (sends and polls get ``UnknownTopicError``),
        each shard drops its queues, its groups' offsets and its pending halves, and its
        records are given back with their segments.  Created again, it starts empty.
        Refused for RayMQ's own topics, and on a shard while an open Kafka-style
        transaction writes to it (that shard drops it once the transaction ended; the name
        is not created again before: ``info["pending"]``)."""
        info = self.control.call("delete_topic", name, timeout_s=30)
        with self._lock:
            self._routes.pop(name, None)
        shards = sorted(set(info["routes"]))
        calls = [self.shard(s).submit("drop_topic", name) for s in shards]
        results = rpc.wait_all(calls, 60)
        failed = {s: r for s, r in zip(shards, results) if isinstance(r, Exception)}
        info["pending"] = {f"shard-{s}": str(r) for s, r in failed.items()}
        for s, r in failed.items():
            log.warning("topic %s: shard-%d drops it later (%s)", name, s, r)
        try:  # (the controller lets the name be created again once every shard dropped it)
            self.control.call("topic_dropped", name, [s for s in shards if s not in failed],
                              info.get("deletion"), why={s: str(r) for s, r in failed.items()},
                              timeout_s=30)
        except Exception as err:  # (best effort: the shards' janitors confirm it then)
            log.warning("topic %s: its drops not confirmed to the controller yet: %s", name,
                        err)
        return info

    def topics(self) -> dict[str, dict]:
        return self.control.call("topics", timeout_s=30)

    def describe_topic(self, name: str) -> dict:
        return self.control.call("describe_topic", name, timeout_s=30)

    def ensure_group_topics(self, group: str) -> None:
        self.control.call("ensure_group_topics", group, timeout_s=30)

    # ------------------------------------------------------------ clients
    def producer(self, group: str = "default", *, acks: str = "all") -> Producer:
        """A producer of ``group``; ``acks`` (``"all"`` or ``"leader"``): ``Producer``."""
        p = Producer(self, group, clock=self.clock, acks=acks)
        self._clients.append(p)
        return p

    def transaction_producer(self, group: str, listener, **kwargs):
        """A RocketMQ-style transaction producer (see ``raymq.transaction_producer``)."""
        from raymq.transaction_producer import TransactionProducer
        kwargs.setdefault("clock", self.clock)
        p = TransactionProducer(self, group, listener, **kwargs)
        self._clients.append(p)
        return p

    def transactional_producer(self, transactional_id: str, *, timeout_ms: int | None = None):
        """A Kafka-style transactional producer (see ``raymq.kafka_producer``); a second
        one with the same id fences the first.  ``timeout_ms``: its transactions' timeout
        (default ``kafka_txn_timeout_ms``)."""
        from raymq.kafka_producer import TransactionalProducer
        p = TransactionalProducer(self, transactional_id, timeout_ms=timeout_ms)
        self._clients.append(p)
        return p

    def coordinator_handle(self, index: int):
        """The Ray handle of transaction coordinator ``index``: its leading replica's,
        cached until ``forget_coordinator``."""
        if self._coordinator_leaders is None:
            self._coordinator_leaders = deployment.ShardLeaders(self.controller, self.config,
                                                                "coordinator")
        return self._coordinator_leaders[index]

    def forget_coordinator(self, index: int) -> None:
        if self._coordinator_leaders is not None:
            self._coordinator_leaders.forget(index)

    @property
    def coordinator_transport(self):
        """How transactional producers reach the coordinators (``raymq.transport``, by
        coordinator index: their data channels, as shards'; following leader changes)."""
        with self._lock:
            if self._coordinator_transport is None:
                self._coordinator_transport = make_transport(
                    self._transport_kind, self.coordinator_handle, self.forget_coordinator)
            return self._coordinator_transport

    def registry_handle(self, group: str):
        """The Ray handle of the registry of producer group ``group``."""
        from raymq.actors.rocketmq_tx.checker import registry_for
        return deployment.get_registry(registry_for(group, self.config.num_registries))

    def checker_handles(self) -> list:
        """The Ray handles of the check-back workers."""
        return [deployment.get_checker(i) for i in range(self.config.num_checkers)]

    def consumer(self, group: str, topics: list[str] | str, *, isolation: str = "read_committed",
                 tags=None, ordered: bool = False, start_from: str = "earliest",
                 read_only: bool = False, auto_commit: bool = True,
                 auto_offset_reset: str = "earliest") -> Consumer:
        """A consumer of ``group`` (``read_only``: a peek that never commits;
        ``auto_commit=False``: commits only when asked; ``auto_offset_reset``: where a queue
        whose offset aged out goes on; see ``Consumer``)."""
        c = Consumer(self, group, topics, isolation=isolation, tags=tags, ordered=ordered,
                     start_from=start_from, clock=self.clock, read_only=read_only,
                     auto_commit=auto_commit, auto_offset_reset=auto_offset_reset)
        self._clients.append(c)
        return c

    def cancel_scheduled(self, msg_id: str) -> str:
        """Cancel a delayed or timer message before it is delivered (the id its send gave):
        'cancelled' (never delivered, also after a restart) or 'already cancelled';
        ``AlreadyDeliveredError`` once it was delivered, ``NotScheduledError`` for a
        message that never waited for a time."""
        shard, phys = self.admin._located(msg_id)
        return self.shard(shard).call("cancel_scheduled", phys, timeout_s=60)

    def kafka_bootstrap(self) -> str:
        """``bootstrap.servers`` for Kafka clients: the Kafka listener of each node
        (``kafka_port``), ``HOST:PORT`` comma-separated; "" when none runs."""
        from raymq.wire.actor import LISTENER_PREFIX
        names = [n for n in rpc.named_actors() if n.startswith(LISTENER_PREFIX)]
        pending = [rpc.Pending(rpc.get_actor(n).address.remote()) for n in names]
        # (one not listening, or gone meanwhile, is left out)
        return ",".join("%s:%d" % tuple(a) for a in rpc.wait_all(pending, timeout_s=60)
                        if not isinstance(a, Exception))

    def close(self) -> None:
        """Close the producers and consumers made here (the cluster keeps running)."""
        for c in reversed(self._clients):
            try:
                c.close()
            except Exception as err:  # closing the rest matters more
                log.warning("closing %s failed: %s", type(c).__name__, err)
        self._clients.clear()
        self.transport.close()
        if self._coordinator_transport is not None:
            self._coordinator_transport.close()


class Admin:
    """Look-ups and operator actions that do not consume."""

    def __init__(self, mq: RayMQ):
        self._mq = mq

    def find(self, msg_id: str | None = None, *, topic: str | None = None,
             key: str | None = None) -> list[MessageExt]:
        """A message by id, or the messages of ``topic`` with ``key``."""
        if msg_id is not None:
            shard, phys = self._located(msg_id)
            m = self._mq.shard(shard).call("get_message", phys, timeout_s=30)
            return [MessageExt.from_stored(shard, m)]
        if topic is None or key is None:
            raise InvalidMessageError("find needs a message id, or a topic and a key")
        shards = sorted(set(self._mq.routes_for({topic})[topic]))
        calls = [self._mq.shard(s).submit("find_by_key", topic, key) for s in shards]
        out = []
        for s, found in zip(shards, rpc.wait_all(calls, 60)):
            if isinstance(found, Exception):
                raise found
            out += [MessageExt.from_stored(s, m) for m in found]
        return out

    def replicas(self) -> list[dict]:
        """Per shard, its group of replicas (``raymq.replica_view.group_doc``): ``shard``,
        ``leader`` and ``leader_node`` (a Ray node id), ``epoch``, ``in_sync`` (node ids),
        ``electable`` and ``candidacy`` (who could be elected now, and why the others
        could not) and ``replicas`` (each ``name``, ``node``, ``role``, ``alive``,
        ``log_end``, ``lag_bytes``: how far behind the leader's log end it was at its
        last heartbeat, and ``candidacy``).  A shard that is not replicated is a group of
        one."""
        return [replica_view.group_doc(g, "shard")
                for g in self._mq.control.call("replicas", timeout_s=30)]

    def coordinator_replicas(self) -> list[dict]:
        """Per transaction coordinator, its group of replicas as ``replicas()`` gives a
        shard's (``coordinator``: its index)."""
        return [replica_view.group_doc(g, "coordinator")
                for g in self._mq.control.call("coordinator_replicas", timeout_s=30)]

    def elect(self, shard: int, to_node: str | None = None, *, unclean: bool = False,
              kind: str = "shard") -> dict:
        """Move the leadership of shard ``shard`` (``kind="coordinator"``: of that
        transaction coordinator) to the replica ``to_node`` names (its name, or its Ray
        node id or the id's first characters), else to the best other in-sync replica
        (Kafka's preferred leader election).  ``unclean``: when no in-sync replica is
        alive (or may lead), an alive one out of the in-sync set is elected -- records
        acknowledged after it fell behind may be lost.  Refused (NotEnoughReplicasError)
        with each replica's candidacy.  Returns the group as ``replicas()`` gives it;
        with ``unclean``, its ``unclean`` says in one line what may have been lost."""
        mq = self._mq
        counts = {"shard": mq.num_shards, "coordinator": mq.config.num_coordinators}
        if kind not in counts:
            raise InvalidMessageError(f"no kind of replicated group {kind!r} "
                                      f"({', '.join(replica_view.KINDS)})")
        if isinstance(shard, bool) or not isinstance(shard, int) or \
                not 0 <= shard < counts[kind]:
            raise InvalidMessageError(f"no {kind} {shard!r} (0..{counts[kind] - 1})")
        if mq.config.replication_factor == 1 and not unclean:
            raise InvalidMessageError(
                f"{kind}s are not replicated (replication_factor 1): {kind}-{shard} is a "
                "group of one, with no other replica to lead (--unclean makes it lead what "
                "its disk holds, when its disk was lost)")
        groups = self.replicas if kind == "shard" else self.coordinator_replicas
        before = next(g for g in groups() if g[kind] == shard)
        to = replica_view.replica_named(before, to_node) if to_node else None
        mq.control.call("replica_elect", shard, to, bool(unclean), kind, timeout_s=30)
        (mq.forget_leader if kind == "shard" else mq.forget_coordinator)(shard)
        after = next(g for g in groups() if g[kind] == shard)
        if unclean:
            after["unclean"] = replica_view.unclean_note(before, after["leader"])
        return after

    def dlq_list(self, group: str, max_per_shard: int = 100) -> list[MessageExt]:
        out = []
        for s in range(self._mq.num_shards):
            for m in self._mq.shard(s).call("dlq_list", group, 0, max_per_shard,
                                            timeout_s=30):
                out.append(MessageExt.from_stored(s, m))
        return out

    def dlq_resend(self, group: str, ids: list[str] | None = None) -> list[str]:
        """Resend dead letters (all not resent yet, or those ids) to the group's retry topic."""
        self._mq.ensure_group_topics(group)
        resent = []
        if ids is None:
            for s in range(self._mq.num_shards):
                resent += self._mq.shard(s).call("dlq_resend", group, None, timeout_s=60)
            return resent
        by_shard: dict[int, list[int]] = {}
        for i in ids:
            shard, phys = self._located(i)
            by_shard.setdefault(shard, []).append(phys)
        for s, phys in by_shard.items():
            resent += self._mq.shard(s).call("dlq_resend", group, phys, timeout_s=60)
        return resent

    def half_list(self, *, expired: bool = False) -> list[dict]:
        """Pending (or expired) half messages of every shard: id, group, age, checks..."""
        out = []
        for s in range(self._mq.num_shards):
            out += self._mq.shard(s).call("half_list", expired=expired, timeout_s=60)
        return out

    def timer_list(self, due_before_ms: int, limit: int = 100) -> list[dict]:
        """Timer messages not yet delivered that are due before ``due_before_ms`` (epoch
        ms), soonest first: msg_id, topic, queue_id, due_ms, key, tags, shard."""
        if isinstance(due_before_ms, bool) or not isinstance(due_before_ms, int):
            raise InvalidMessageError(f"due_before_ms must be epoch ms, got {due_before_ms!r}")
        out = []
        for s in range(self._mq.num_shards):
            out += self._mq.shard(s).call("timer_list", due_before_ms, limit, timeout_s=60)
        return sorted(out, key=lambda t: (t["due_ms"], t["msg_id"]))[:limit]

    def half_resolve(self, half_id: str, state: str) -> str:
        """An operator commits ('commit') or rolls back ('rollback') a pending or expired half."""
        wanted = {"commit": "COMMIT_MESSAGE", "rollback": "ROLLBACK_MESSAGE"}.get(state)
        if wanted is None:
            raise InvalidMessageError("state must be 'commit' or 'rollback'")
        shard, phys = self._located(half_id)
        return self._mq.shard(shard).call("resolve_half", phys, wanted, timeout_s=60)

    # ------------------------------------------- Kafka-style transactions (KIP-664)
    def _coordinators(self):
        for j in range(self._mq.config.num_coordinators):  # (each leader as it is now)
            self._mq.forget_coordinator(j)
        return [rpc.CoordinatorClient(self._mq.coordinator_handle(j))
                for j in range(self._mq.config.num_coordinators)]

    def tx_list(self) -> list[dict]:
        """Every transactional id the coordinators know: state, epoch, age, queues."""
        out = []
        for c in self._coordinators():
            out += c.call("list_transactions", timeout_s=60)
        return sorted(out, key=lambda t: t["transactional_id"])

    def _coordinator_of(self, transactional_id: str):
        from raymq.actors.kafka_tx.coordinator import coordinator_for
        j = coordinator_for(transactional_id, self._mq.config.num_coordinators)
        self._mq.forget_coordinator(j)  # (its leader as it is now)
        return rpc.CoordinatorClient(self._mq.coordinator_handle(j))

    def tx_describe(self, transactional_id: str) -> dict:
        return self._coordinator_of(transactional_id).call("describe_transaction",
                                                           transactional_id, timeout_s=60)

    def tx_abort(self, transactional_id: str) -> str:
        """Abort an open transaction (its final state)."""
        return self._coordinator_of(transactional_id).call("abort_transaction",
                                                           transactional_id, timeout_s=120)

    def tx_hanging(self) -> list[dict]:
        """Open transactions holding back a queue's last stable offset: per queue, the
        producer, how far behind its end the LSO is held, and the transactional id."""
        by_pid = {t["producer_id"]: t for t in self.tx_list()}
        out = []
        for s in range(self._mq.num_shards):
            for held in self._mq.shard(s).call("ktx_status", timeout_s=60):
                meta = by_pid.get(held["producer_id"], {})
                for queue, where in held["queues"].items():
                    out.append({"queue": queue, "shard": s, "producer_id": held["producer_id"],
                                "epoch": held["epoch"], "age_ms": held["age_ms"],
                                "lso": where["first"], "end": where["end"],
                                "behind": where["end"] - where["first"],
                                "transactional_id": meta.get("transactional_id"),
                                "state": meta.get("state")})
        return sorted(out, key=lambda h: -h["behind"])

    # ------------------------------------------------------ offsets by time
    def _bounds(self, queues: list[tuple[str, int]], times: list | None = None) -> dict:
        """``queue_bounds`` of each queue, asked of the shards that hold them at once."""
        routes = self._mq.routes_for({t for t, _q in queues})
        by_shard: dict[int, list[int]] = {}
        for i, (t, q) in enumerate(queues):
            if not (isinstance(q, int) and 0 <= q < len(routes[t])):
                raise InvalidMessageError(f"topic {t!r} has no queue {q!r}")
            by_shard.setdefault(routes[t][q], []).append(i)
        shards = sorted(by_shard)
        calls = [self._mq.shard(s).submit(
            "queue_bounds", [queues[i] for i in by_shard[s]],
            None if times is None else [times[i] for i in by_shard[s]]) for s in shards]
        out = {}
        for found in rpc.wait_all(calls, 60):
            if isinstance(found, Exception):
                raise found
            out.update(found)
        return out

    def offsets_for_times(self, times: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """Kafka's ``offsetsForTimes``: for each queue, the first offset whose message was
        stored at or after its time (ms since the epoch) -- the log start when that aged
        out, the queue's end when no message is that recent."""
        queues = list(times)
        got = self._bounds(queues, [int(times[q]) for q in queues])
        return {q: got[q][2] for q in queues}

    def reset_offsets(self, group: str, topic: str, *, to: str, value: int | None = None,
                      dry_run: bool = False) -> dict[tuple[str, int], tuple[int, int]]:
        """Move a consumer group's committed offsets on every queue of ``topic`` (Kafka's
        ``kafka-consumer-groups --reset-offsets``): ``to`` is ``earliest`` (each queue's
        log start), ``latest`` (its end), ``datetime`` (``value``: ms since the epoch: the
        first message stored then or later), ``duration`` (``value`` ms before now) or
        ``offset`` (``value``, kept within the log start and the end).  Refused in one line
        while the group has live members (they would commit over it).  Returns
        ``{queue: (committed before, after)}`` (-1: none before); ``dry_run``: only that."""
        check_group(group)
        modes = ("earliest", "latest", "datetime", "duration", "offset")
        if to not in modes:
            raise InvalidMessageError(f"reset to one of {modes}, got {to!r}")
        if to in ("datetime", "duration", "offset") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise InvalidMessageError(f"reset to {to} needs a value >= 0, got {value!r}")
        members = self._mq.control.call("groups", timeout_s=30).get(group, {}).get("members")
        if members and not dry_run:
            names = ", ".join(sorted(members))[:200]
            raise InvalidMessageError(
                f"group {group!r} has {len(members)} live member(s) ({names}): stop its "
                f"consumers first (they would commit over the reset)")
        routes = self._mq.routes_for({topic})[topic]
        queues = [(topic, q) for q in range(len(routes))]
        at = {"datetime": value, "duration": None if value is None else
              int(time.time() * 1000) - value}.get(to)
        bounds = self._bounds(queues, None if at is None else [at] * len(queues))
        before: dict[tuple[str, int], int] = {}
        for s in sorted(set(routes)):
            mine = [q for q in queues if routes[q[1]] == s]
            before.update(self._mq.shard(s).call("get_offsets", group, mine, timeout_s=30))
        plan = {}
        for q in queues:
            start, end, by_time = bounds[q]
            new = {"earliest": start, "latest": end, "offset": min(max(value or 0, start), end)
                   }.get(to, by_time)
            plan[q] = (before[q], new)
        if not dry_run:
            for s in sorted(set(routes)):
                mine = {q: new for q, (_b, new) in plan.items() if routes[q[1]] == s}
                self._mq.shard(s).call("commit_offsets", group, mine, timeout_s=30)
        return plan

    def _located(self, msg_id: str) -> tuple[int, int]:
        """(shard, physical offset) of a message id naming a shard of this cluster."""
        shard, phys = parse_msg_id(msg_id)
        if shard >= self._mq.num_shards:
            raise InvalidMessageError(f"no such message: {msg_id} names shard {shard}, the "
                                      f"cluster has {self._mq.num_shards}")
        return shard, phys

    def check_now(self) -> list[dict]:
        """Run a check-back round on every checker now; returns checks sent per group."""
        return [rpc.CheckerClient(c).call("run_round", timeout_s=120)
                for c in self._mq.checker_handles()]

    def status(self) -> dict:
        mq = self._mq
        for s in range(mq.num_shards):  # (each shard's leader as it is now)
            mq.forget_leader(s)
        # every call to every shard sent before any answer is awaited: one round, not four
        calls = [[mq.shard(s).submit(method) for s in range(mq.num_shards)]
                 for method in ("queue_info", "node_id", "transaction_status", "disk_bytes")]
        infos, nodes, tx, disk = (rpc.wait_all(c, 30) for c in calls)
        return {"topics": mq.topics(), "groups": mq.control.call("groups", timeout_s=30),
                # which transport this client uses and why (``raymq.transport``)
                "transport": {"name": mq.transport.name, "why": mq.transport.why},
                "transactions": [t if not isinstance(t, Exception) else {"error": str(t)}
                                 for t in tx],
                "shards": [{"shard": s, "node": n if not isinstance(n, Exception) else None,
                            "info": i if not isinstance(i, Exception) else {"error": str(i)},
                            "disk_bytes": d if not isinstance(d, Exception) else None}
                           for s, (i, n, d) in enumerate(zip(infos, nodes, disk))],
                "replicas": self.replicas(),
                "coordinator_replicas": self.coordinator_replicas()}
