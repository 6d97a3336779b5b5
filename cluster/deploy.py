"""What RayMQ deploys into a Ray cluster: its actor classes, names and options;
deploying them (idempotent), finding them by name (``find_deployed``, which deploys
nothing), checking asked settings against the running ones, stopping them.

Who deploys: ``raymq up`` (``settings_for_up`` first: a running RayMQ keeps its
settings), ``connect(deploy=True)``, and ``connect()`` on an embedded Ray it or its
process started.  Nothing else: an operator's ``raymq down`` stays down.

Talking to Ray is ``raymq.rpc``'s part.  Actors live in namespace ``raymq``,
detached, named, restartable (``max_restarts=-1``).  Every shard and transaction
coordinator is a group of ``replication_factor`` replicas (``ShardActor``,
``CoordinatorActor``: thin shells over ``raymq.actors.replication.replica``), led
as the controller says; with a factor of 1 a group of one.  A replicated group's
replicas are spread over distinct nodes by a placement group; a group of one is
pinned so that a restart finds its files: a shard by the custom resource
``raymq_shard_<i>`` when the cluster defines it (``ray_config.yaml`` does), else by
node affinity to the node it was first placed on (remembered by the controller); a
coordinator on the controller's node.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Any, Mapping

from raymq.actors.rocketmq_tx.checker import CheckerWorker
from raymq.actors.channel import DATA_METHODS, ChannelLimits, Endpoint
from raymq.actors.controller import Controller
from raymq.actors.faults import faults_named
from raymq.actors.kafka_tx.coordinator import TransactionCoordinator
from raymq.actors.rocketmq_tx.registry import ProducerGroupRegistry
from raymq.actors.replication.peers import PeerLinks
from raymq.actors.replication.replica import ShardReplica
from raymq.actors.replication.groups import replica_name
from raymq.actors.shard import BrokerShard
from raymq import rpc
from raymq.actors.config import ClusterConfig
from raymq.actors.metrics import replication_gauges, shard_gauges
from raymq.metrics import GaugeReporter, RayMetrics
from raymq.storage.fileutil import disk_usage
from raymq.storage.errors import (BrokerUnavailableError, ConfigError, ConfigMismatchError,
                                  NotDeployedError, NotLeaderError, RayMQError)

log = logging.getLogger("raymq.deploy")

NAMESPACE = rpc.NAMESPACE
CONTROLLER = "controller"


def shard_name(i: int) -> str:
    return f"shard-{i}"


def adopt_plain_directory(data_dir: str, kind: str, index: int) -> bool:
    """A shard (``kind``; or a coordinator) deployed before every one was a group kept
    its files in ``<kind>-<index>``; the one replica of its group of one takes them
    (renamed to its own name, once).  Whether it did."""
    old = os.path.join(data_dir, f"{kind}-{index}")
    new = os.path.join(data_dir, replica_name(index, 0, kind))
    if not os.path.isdir(old) or os.path.exists(new):
        return False
    os.rename(old, new)
    log.warning("%s-%d: its files move to %s (every %s is a group of replicas now)",
                kind, index, new, kind)
    return True


#: What a replica answers whatever its role.
_REPLICA_OWN = frozenset({"ping", "close", "node_id", "endpoint", "set_fault"})


def _leader_method(name: str, served: type):
    def method(self, *args, **kwargs):
        return self._replica.call(served, name, args, kwargs)
    method.__name__ = name
    method.__doc__ = getattr(served, name).__doc__
    return method


def _delegate(served: type, *classes: type) -> None:
    """Give ``classes`` each public method of ``served``, served while leading."""
    for name in dir(served):
        if not name.startswith("_") and name not in _REPLICA_OWN and \
                callable(getattr(served, name)) and not isinstance(
                    getattr(served, name), property):
            for cls in classes:
                setattr(cls, name, _leader_method(name, served))


#: What a replica's data channel serves: the clients' calls, and followers' fetches.
REPLICA_METHODS = DATA_METHODS | {"replica_fetch"}


class _LeaderCalls:
    """The served object's methods, while the replica leads (``NotLeaderError`` else),
    and the followers' calls: what the data channel serves."""

    def __init__(self, replica: ShardReplica):
        self._replica = replica

    def replica_fetch(self, *args) -> dict:
        return self._replica.replica_fetch(*args)


class _Replica:
    """One replica (``raymq.actors.replication.replica``) as a Ray actor: replica ``k``
    of its group, its files under its own node's data directory.  Subclasses say what a
    leader serves (``_kind``, ``_maker``, the channel's ``_methods``)."""

    _kind = "shard"
    _methods = REPLICA_METHODS
    _calls: type = _LeaderCalls

    def __init__(self, index: int, k: int, config: dict):
        cfg = ClusterConfig.from_dict(config)
        controller = rpc.ControllerClient(get_controller())
        node = rpc.node_id()
        kind = self._kind
        name = replica_name(index, k, kind)
        data_dir = cfg.resolved_data_dir(node)
        if cfg.replication_factor == 1:
            adopt_plain_directory(data_dir, kind, index)
            if kind == "shard":  # (a group of one is pinned there: ``_placements``)
                controller.call("set_shard_node", index, node, timeout_s=30)
        # followers fetch over the leader's data channel (a Ray call costs ~10 times as
        # much); Ray only tells where that channel is
        peers = PeerLinks(lambda other, timeout_s: rpc.call(
            rpc.get_actor(other, NAMESPACE).endpoint, timeout_s=timeout_s))
        self._peers = peers
        call_replica = peers.call
        self._replica = ShardReplica(
            index, name, cfg, os.path.join(data_dir, name),
            controller=lambda m, *a: controller.call(m, *a, timeout_s=10),
            call_replica=call_replica, make_shard=self._maker(index, cfg, controller),
            node=node)
        self._endpoint = Endpoint(self._calls(self._replica), host=rpc.node_ip(),
                                  methods=self._methods, limits=ChannelLimits.from_config(cfg))
        self._gauges = GaugeReporter(RayMetrics(**{self._kind: str(index)}),
                                     self._leader_gauges).start()
        log.info("%s up on node %s, data channel on %s:%d", name, node,
                 *self._endpoint.address)
        if cfg.replication_factor == 1:
            self._await_leading(60.0)

    def _await_leading(self, timeout_s: float) -> None:
        """(a group of one) Ready once its one replica leads -- as a plain shard was ready
        once recovered: a call Ray sends again after a restart finds it serving.  One the
        controller does not elect (its disk was lost) is ready after ``timeout_s``, for the
        operator's ``--unclean`` election."""
        deadline = time.monotonic() + timeout_s
        while self._replica.shard is None and time.monotonic() < deadline:
            time.sleep(0.02)

    def _leader_gauges(self) -> list:
        """While this replica leads: its group's replication, and a shard's own gauges."""
        status = self._replica.status()
        if status["role"] != "leader":
            return []
        shard = self._replica.shard
        return replication_gauges(status) + (
            shard_gauges(shard) if self._kind == "shard" and shard is not None else [])

    def _maker(self, index: int, cfg: ClusterConfig, controller):
        def make_shard(directory):
            sh = BrokerShard(index, cfg, directory=directory,
                             fetch_routes=lambda i: controller.call("shard_routes", i,
                                                                    timeout_s=30),
                             # (keywords: the janitor confirms the deleted topics it dropped)
                             fetch_settings=lambda **kw: controller.call(
                                 "topic_settings", timeout_s=30, **kw),
                             metrics=RayMetrics(shard=str(index)))
            sh.set_routes(controller.call("shard_routes", index, timeout_s=30))
            return sh
        return make_shard

    def ping(self) -> dict:
        """The replica's status; while it leads, what the served object's ``ping`` says
        too (a coordinator's transactions, a shard's directory)."""
        status = self._replica.status()
        shard = self._replica.shard
        return {**shard.ping(), **status} if shard is not None else status

    def replica_status(self) -> dict:
        return self._replica.status()

    def replica_fetch(self, *args) -> dict:
        return self._replica.replica_fetch(*args)

    def endpoint(self) -> tuple[tuple[str, int], bytes]:
        self._replica.serving()  # (clients ask the leader's only)
        return self._endpoint.address, self._endpoint.authkey

    def node_id(self) -> str:
        return rpc.node_id()

    def set_fault(self, fault: str | None) -> None:
        self._replica.serving().set_fault(fault)

    def close(self) -> None:
        self._gauges.stop()
        self._endpoint.close()
        self._replica.close()
        self._peers.close()


class ShardActor(_Replica):
    """A shard as a Ray actor: one replica of its group (a group of one when not
    replicated), serving ``BrokerShard`` while it leads."""

    def disk_bytes(self) -> int:
        """The bytes its shard's files take on disk while it leads, as of its last gauge
        report (5 s; counted now before the first since it leads)."""
        shard = self._replica.serving()  # (clients ask the leader's only)
        value = self._gauges.last.get("disk_bytes")
        return disk_usage(shard.directory) if value is None else int(value)


class _ShardCalls(_LeaderCalls):
    pass


ShardActor._calls = _ShardCalls
_delegate(BrokerShard, ShardActor, _ShardCalls)


class ShardLeaders:
    """Each shard's (``kind="coordinator"``: coordinator's) Ray handle, as a list of them
    is used: its leading replica's, asked of the controller, cached until ``forget``."""

    def __init__(self, controller, config: ClusterConfig, kind: str = "shard"):
        self._control = rpc.ControllerClient(controller)
        self.kind = kind
        self._n = config.num_shards if kind == "shard" else config.num_coordinators
        self._lock = threading.Lock()
        self._cached: dict[int, object] = {}

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        return (self[i] for i in range(self._n))

    def __getitem__(self, i: int):
        handle = self._cached.get(i)
        if handle is not None:
            return handle
        handle = rpc.get_actor(self._leader_name(i), NAMESPACE)
        with self._lock:
            self._cached[i] = handle
        return handle

    def _leader_name(self, i: int, wait_s: float = 30.0) -> str:
        deadline = time.monotonic() + wait_s
        while True:
            name, _epoch = self._control.call(
                "replica_leaders" if self.kind == "shard" else "coordinator_leaders",
                timeout_s=30)[i]
            if name is not None or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # (a new group: its first replica has not heartbeated yet)
        if name is None:
            raise BrokerUnavailableError(f"{self.kind}-{i} has no leader (no replica in sync "
                                         f"is alive)")
        return name

    def forget(self, i: int) -> None:
        with self._lock:
            self._cached.pop(i, None)


class RegistryActor(ProducerGroupRegistry):
    def __init__(self, index: int, config: dict):
        super().__init__(lease_ms=ClusterConfig.from_dict(config).producer_lease_ms)
        self.index = index


class CheckerActor(CheckerWorker):
    def __init__(self, index: int, config: dict):
        cfg = ClusterConfig.from_dict(config)

        leaders = ShardLeaders(get_controller(), cfg)

        def call_shard(i, method, *args, **kwargs):
            try:
                return rpc.ShardClient(leaders[i]).call(method, *args, timeout_s=60, **kwargs)
            except (NotLeaderError, BrokerUnavailableError):
                leaders.forget(i)  # the next round asks the leader as it is then
                raise

        def call_registry(i, method, *args):
            return rpc.RegistryClient(get_registry(i)).call(method, *args, timeout_s=30)
        shards = [i for i in range(cfg.num_shards) if i % cfg.num_checkers == index]
        super().__init__(index, shards, call_shard=call_shard, call_registry=call_registry,
                         num_registries=cfg.num_registries, interval_ms=cfg.txn_check_interval_ms,
                         max_checks_per_group=cfg.txn_max_checks_per_group)


#: What producers call on a coordinator's data channel (the rest: Ray calls).
COORDINATOR_METHODS = frozenset({"init_producer", "add_to_transaction", "end_transaction",
                                 "commit_batch"})


class _CoordinatorCalls(_LeaderCalls):
    pass


class CoordinatorActor(_Replica):
    """A transaction coordinator as a Ray actor: one replica of its group (a group of one
    when not replicated); its leader is the coordinator (its log replicated as a shard's
    commit log is), calling shards' leaders over their data channels, and producers
    reach it over its own (``COORDINATOR_METHODS``), as clients reach shards: a Ray call
    costs ~10 times as much."""

    _kind = "coordinator"
    _methods = COORDINATOR_METHODS | {"replica_fetch"}
    _calls = _CoordinatorCalls

    def _maker(self, index: int, cfg: ClusterConfig, controller):
        from raymq.transport import DirectTransport, FailoverTransport
        leaders = ShardLeaders(get_controller(), cfg)
        transport = FailoverTransport(DirectTransport(leaders.__getitem__, io_threads=8),
                                      leaders.forget, leaders.__getitem__)

        def make_coordinator(directory):
            return TransactionCoordinator(
                index, cfg, directory=directory,
                begin_shard=lambda i, method, args: transport.begin(i, method, args,
                                                                    timeout_s=60))
        return make_coordinator

    def set_fault(self, fault: str | None) -> None:
        """Test hook: a crash point of its log (``TransactionCoordinator.set_fault``),
        armed in this replica's process whatever its role."""
        faults_named(fault)


_delegate(TransactionCoordinator, CoordinatorActor, _CoordinatorCalls)


class ControllerActor(Controller):
    def __init__(self, config, **kwargs):
        super().__init__(config, restarted=rpc.actor_restarted(), **kwargs)

    def node_id(self) -> str:
        return rpc.node_id()


def registry_name(i: int) -> str:
    return f"registry-{i}"


def checker_name(i: int) -> str:
    return f"checker-{i}"


def get_registry(i: int):
    """Registry ``i``'s Ray handle (``ValueError`` if it is not deployed)."""
    return rpc.get_actor(registry_name(i), NAMESPACE)


def coordinator_name(i: int) -> str:
    return f"coordinator-{i}"


def get_checker(i: int):
    """Checker ``i``'s Ray handle (``ValueError`` if it is not deployed)."""
    return rpc.get_actor(checker_name(i), NAMESPACE)


def get_controller():
    """The controller's Ray handle (``ValueError`` if it is not deployed)."""
    return rpc.get_actor(CONTROLLER, NAMESPACE)


def _running_config(controller) -> ClusterConfig:
    return ClusterConfig.from_dict(rpc.ControllerClient(controller).call("get_config",
                                                                         timeout_s=60))


def differences(running: ClusterConfig, asked: Mapping[str, Any]) -> list[str]:
    """``"name: running X, asked Y"`` for each setting ``asked`` gives another value than
    ``running`` has (``asked`` is checked first: ``ConfigError``)."""
    wanted = ClusterConfig.from_dict(asked)
    out = []
    for name in asked:
        have, want = getattr(running, name), getattr(wanted, name)
        if name == "data_dir":
            have, want = running.resolved_data_dir(), wanted.resolved_data_dir()
        elif name == "delay_levels":
            have, want = running.delay_levels_ms, wanted.delay_levels_ms
        if have != want:
            out.append(f"{name}: running {have!r}, asked {want!r}")
    return out


def placed_shards() -> int:
    """How many shards the cluster places by custom resources (``raymq_shard_<i>``, as
    ``raymq.placement`` gives them from ``ray_config.yaml``'s RAYMQ_SHARDS): the highest
    index + 1 of the live nodes' resources; 0 when it places none."""
    placed = [int(name.rpartition("_")[2]) for name in rpc.cluster_resources()
              if name.startswith("raymq_shard_") and name.rpartition("_")[2].isdigit()]
    return max(placed) + 1 if placed else 0


def settings_for_up(asked: Mapping[str, Any]) -> dict[str, Any]:
    """The settings ``raymq up`` deploys with: ``asked``, and for a first deploy on a
    cluster that places shards (``placed_shards``) that many unless ``num_shards`` is
    asked.  When RayMQ runs already ``asked`` must agree with its settings, else
    ``ConfigMismatchError`` naming each difference (a running RayMQ keeps its
    settings: ``raymq down`` first).  Changes nothing."""
    settings = dict(asked)
    ClusterConfig.from_dict(settings)
    try:
        controller = get_controller()
    except ValueError:
        placed = placed_shards()
        if placed and "num_shards" not in settings:
            settings["num_shards"] = placed
        elif placed and settings["num_shards"] != placed:
            log.warning("the cluster places %d shards by resources; the other shards are "
                        "pinned to the node each is first placed on", placed)
        return settings
    diff = differences(_running_config(controller), settings)
    if diff:
        raise ConfigMismatchError(
            f"RayMQ runs in the Ray cluster at {rpc.gcs_address()} with other settings "
            f"({'; '.join(diff)}); nothing changed. A running RayMQ keeps its settings: "
            "`raymq down` first to deploy it with others (data stays on disk)")
    return settings


def find_deployed() -> tuple[object, list[object]]:
    """The running RayMQ's controller and shard handles; deploys nothing.

    ``NotDeployedError`` (one line: what is missing, and ``raymq up``) when RayMQ is
    not deployed in this Ray cluster, or only partly (an actor stopped for good).
    """
    where = f"the Ray cluster at {rpc.gcs_address()}"
    try:
        controller = get_controller()
    except ValueError:
        raise NotDeployedError(f"RayMQ is not deployed in {where}: run `raymq up` "
                               "(deploying is up to the operator)") from None
    cfg = _running_config(controller)
    missing = []
    for name in _actor_names(cfg, "shard"):
        try:
            rpc.get_actor(name, NAMESPACE)
        except ValueError:
            missing.append(name)
    for name in [registry_name(i) for i in range(cfg.num_registries)] + \
            [checker_name(i) for i in range(cfg.num_checkers)] + _actor_names(cfg, "coordinator"):
        try:
            rpc.get_actor(name, NAMESPACE)
        except ValueError:
            missing.append(name)
    if missing:
        raise NotDeployedError(f"RayMQ is only partly deployed in {where} (missing: "
                               f"{', '.join(missing)}): run `raymq up` to start what is missing")
    return controller, ShardLeaders(controller, cfg)


def _actor_names(cfg: ClusterConfig, kind: str) -> list[str]:
    """The actor names of the shards' or coordinators' (``kind``) replicas."""
    count = cfg.num_shards if kind == "shard" else cfg.num_coordinators
    return [replica_name(i, k, kind) for i in range(count)
            for k in range(cfg.replication_factor)]


def deploy(config: ClusterConfig) -> tuple[object, list[object]]:
    """Create whatever of RayMQ is missing (idempotent); return the controller's and the
    shards' handles.  ``config`` is used by a first deploy only: a running controller
    keeps its settings, and every actor created later gets them (not ``config``).

    The settings deployed with (``config``, or the running controller's) are checked
    against the cluster first (``check_deployable``): refused, nothing is created."""
    try:
        controller = get_controller()
    except ValueError:
        check_deployable(config)
    else:
        rpc.ControllerClient(controller).call("ping", timeout_s=120)
        check_deployable(_running_config(controller), running=True)
    first = config.to_dict()
    first["data_dir"] = config.data_dir_template()
    controller = _create_controller(first)
    control = rpc.ControllerClient(controller)
    control.call("ping", timeout_s=120)
    cfg = _running_config(controller)
    shards = _create_shards(control, cfg)
    _create_helpers(cfg)
    if cfg.kafka_port:
        kafka_listeners(cfg.kafka_port)
    return controller, shards


def kafka_listeners(port: int) -> list[tuple[str, int]]:
    """The Kafka listener of each alive node on ``port``, each created unless it exists
    (``raymq.wire.actor``); their addresses."""
    from raymq.wire.actor import KafkaListenerActor, listener_name
    handles = [rpc.create_actor(
        KafkaListenerActor, name=listener_name(node), namespace=NAMESPACE,
        lifetime="detached", get_if_exists=True, max_restarts=-1, num_cpus=0,
        max_concurrency=4, scheduling_strategy=rpc.pin_to_node(node))
        for node in rpc.alive_nodes()]
    answers = rpc.wait_all([rpc.Pending(h.start.remote(port)) for h in handles],
                           timeout_s=120)
    for handle, answer in zip(handles, answers):
        if isinstance(answer, Exception):  # (it would only be asked again: gone)
            rpc.kill(handle, no_restart=True)
    failed = next((a for a in answers if isinstance(a, Exception)), None)
    if failed is not None:
        raise failed
    return [tuple(a) for a in answers]


def check_deployable(config: ClusterConfig, *, running: bool = False) -> None:
    """``ConfigError`` (one line, saying what to do) unless this Ray cluster can hold
    RayMQ with ``config``: as many alive nodes as ``replication_factor`` (each replica
    of a group on its own node).  ``running``: ``config`` is the running RayMQ's (its
    controller keeps it: then ``raymq down`` comes first to deploy with another).
    Creates nothing."""
    factor = config.replication_factor
    if factor == 1:
        return
    alive = len(rpc.alive_nodes())
    if factor <= alive:
        return
    if running:
        raise ConfigError(
            f"RayMQ runs in the Ray cluster at {rpc.gcs_address()} with replication_factor "
            f"{factor}, which needs {factor} alive Ray nodes, the cluster has {alive}: add "
            "nodes, or `raymq down` first to deploy it with a lower one (data stays on disk)")
    raise ConfigError(f"replication_factor {factor} needs {factor} alive Ray nodes, the "
                      f"cluster has {alive}: add nodes or lower it (nothing was deployed)")


def _create_controller(cfg: dict):
    """The controller, on this node (or the node ``raymq_controller`` names).  In a
    replicated cluster it may restart on any node once its own is gone: the replicas keep
    its groups, topics and routes, and it takes them back (``Controller._mirror``)."""
    pinned = "raymq_controller" in rpc.cluster_resources()
    soft = ClusterConfig.from_dict(cfg).replication_factor > 1
    return rpc.create_actor(
        ControllerActor, cfg,
        name=CONTROLLER, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1, max_task_retries=-1, num_cpus=0, max_concurrency=16,
        scheduling_strategy=rpc.pin_to_node(rpc.node_id(), soft=soft) if not pinned else None,
        resources={"raymq_controller": 0.001} if pinned else None)


#: The environment a shard's worker process starts with.  A shard runs in a Ray worker
#: of ~66 threads; with glibc's malloc defaults (8 arenas per core, a cache per thread)
#: its anonymous memory grew for as long as load ran (15-23 MiB per million messages,
#: the Python heap flat: free memory kept by thread arenas).  Two arenas and no thread
#: caches keep it flat (``raymq bench soak``); other allocators ignore the variable.
SHARD_PROCESS_ENV = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"
                                       ":glibc.malloc.mmap_threshold=1048576"}


def _create_group(cls: type, config: ClusterConfig, count: int, *, max_concurrency: int,
                  control: rpc.ControllerClient):
    """``count`` groups of ``cls`` replicas (``replication_factor`` each, placed by
    ``_placements``), created unless they exist; waits until each answers.  Their handles."""
    factor, cfg, kind = config.replication_factor, config.to_dict(), cls._kind
    replicas = []
    for i in range(count):
        for k, where in enumerate(_placements(kind, i, factor, control)):
            replicas.append(rpc.create_actor(
                cls, i, k, cfg, name=replica_name(i, k, kind), namespace=NAMESPACE,
                lifetime="detached", get_if_exists=True, max_restarts=-1,
                # a call to a restarting replica: to the new leader (the client asks the
                # controller) -- a group of one has none: Ray sends it again once it is up
                max_task_retries=-1 if factor == 1 else 0,
                num_cpus=0, max_concurrency=max_concurrency,
                runtime_env={"env_vars": dict(SHARD_PROCESS_ENV)}, **where))
    for r in replicas:
        rpc.ShardClient(r).call("ping", timeout_s=120)
    return replicas


def _placements(kind: str, i: int, factor: int, control: rpc.ControllerClient) -> list[dict]:
    """Where each replica of group ``i`` goes (Ray options).  A replicated group: one
    bundle each of its placement group (``STRICT_SPREAD``: each on its own node, the
    bundles staying on their nodes across ``raymq down``/``up``).  A group of one: where
    its files are -- a shard by its custom resource ``raymq_shard_<i>`` when the
    cluster defines it, else pinned to the node the controller remembers (first: spread
    over the alive nodes); a coordinator on the controller's node (or by its resource)."""
    if factor > 1:
        group = rpc.spread_group(f"raymq-{kind}-{i}", factor)
        return [{"scheduling_strategy": rpc.in_group(group, k)} for k in range(factor)]
    resources = rpc.cluster_resources()
    own = f"raymq_shard_{i}" if kind == "shard" else "raymq_controller"
    if own in resources:
        return [{"resources": {own: 0.001}}]
    if kind != "shard":
        return [{"scheduling_strategy": rpc.pin_to_node(rpc.node_id())}]
    nodes = rpc.alive_nodes()
    node = control.call("shard_node", i, timeout_s=30)
    if node not in nodes:
        node = nodes[i % len(nodes)]
    return [{"scheduling_strategy": rpc.pin_to_node(node)}]


def _wait_in_sync(control: rpc.ControllerClient, config: ClusterConfig, what: str) -> None:
    """Until every group the controller's ``what`` lists has ``min_insync_replicas`` in sync."""
    deadline = time.monotonic() + 120
    while True:
        short = [g["shard"] for g in control.call(what, timeout_s=30)
                 if len(g["in_sync"]) < config.min_insync]
        if not short:
            return
        if time.monotonic() > deadline:
            raise BrokerUnavailableError(f"{what} {short}: fewer than min_insync_replicas "
                                         f"({config.min_insync}) in sync after 120 s")
        time.sleep(0.1)


def _create_shards(control: rpc.ControllerClient, config: ClusterConfig) -> "ShardLeaders":
    """Each shard's replicas, created unless they exist (``_placements``); waits until
    every group has ``min_insync_replicas`` in sync.  The shards' leaders."""
    check_deployable(config, running=True)  # (checked before anything: a node gone since?)
    _create_group(ShardActor, config, config.num_shards,
                  max_concurrency=config.shard_max_concurrency, control=control)
    _wait_in_sync(control, config, "replicas")
    return ShardLeaders(control.handle, config)


def _create_helpers(config: ClusterConfig) -> None:
    """The registries, check-back workers and transaction coordinators, each created
    unless it exists; waits until each answers (the coordinators' groups: until each
    has ``min_insync_replicas`` in sync)."""
    cfg = config.to_dict()
    common = dict(namespace=NAMESPACE, lifetime="detached", get_if_exists=True, max_restarts=-1,
                  max_task_retries=-1, num_cpus=0)
    registries = [rpc.create_actor(RegistryActor, i, cfg, name=registry_name(i),
                                   max_concurrency=64, **common)
                  for i in range(config.num_registries)]
    checkers = [rpc.create_actor(CheckerActor, i, cfg, name=checker_name(i),
                                 max_concurrency=4, **common)
                for i in range(config.num_checkers)]
    control = rpc.ControllerClient(get_controller())
    _create_group(CoordinatorActor, config, config.num_coordinators, max_concurrency=32,
                  control=control)
    for r in registries:
        rpc.RegistryClient(r).call("ping", timeout_s=120)
    for c in checkers:
        rpc.CheckerClient(c).call("ping", timeout_s=120)
    _wait_in_sync(control, config, "coordinator_replicas")


CLOSE_TIMEOUT_S = 15.0  # a replica's close waits for its heartbeat (10 s at most)
_REPLICA = re.compile(r"(shard|coordinator)-\d+-r\d+")


def undeploy() -> list[str]:
    """Kill RayMQ's actors (their data stays on disk); return the names killed."""
    killed = []
    names = [CONTROLLER]
    try:
        cfg = ClusterConfig.from_dict(
            rpc.ControllerClient(get_controller()).call("get_config", timeout_s=30))
        # (replicated shards' placement groups stay: `raymq up` puts each replica back in
        # its bundle, on the node that has its files)
        names += _actor_names(cfg, "shard")
        names += [registry_name(i) for i in range(cfg.num_registries)]
        names += [checker_name(i) for i in range(cfg.num_checkers)]
        names += _actor_names(cfg, "coordinator")
    except Exception:  # controller already gone: look for the actors by name
        names += [f(i) for f in (shard_name, registry_name, checker_name, coordinator_name)
                  for i in range(64)]
        names += [replica_name(i, k, kind) for i in range(64) for k in range(7)
                  for kind in ("shard", "coordinator")]
    from raymq.wire.actor import LISTENER_PREFIX
    names += [n for n in rpc.named_actors(NAMESPACE) if n.startswith(LISTENER_PREFIX)]
    # the actors that call shards go first (a check round or a marker write in flight
    # would otherwise meet a killed shard, and Ray logs a retry), the controller last;
    # a replica is closed before it is killed: its heartbeat to the controller ends first
    order = [LISTENER_PREFIX] + [f(0)[:-1] for f in (checker_name, coordinator_name,
                                                     registry_name, shard_name)]
    rank = lambda n: next(  # noqa: E731
        (k for k, prefix in enumerate(order) if n.startswith(prefix)), len(order))
    for k in range(len(order) + 1):
        handles = {}
        for name in (n for n in names if rank(n) == k):
            try:
                handles[name] = rpc.get_actor(name, NAMESPACE)
            except ValueError:
                continue
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for pending in [rpc.Pending(h.close.remote()) for n, h in handles.items()
                        if _REPLICA.fullmatch(n)]:
            try:
                pending.result(max(0.0, deadline - time.monotonic()))
            except RayMQError:  # (dead already, or hung: it is killed all the same)
                continue
        for name, handle in handles.items():
            rpc.kill(handle, no_restart=True)
            killed.append(name)
    return killed

