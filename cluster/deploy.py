"""What RayMQ deploys into a Ray cluster: its actor classes, names and options;
deploying them (idempotent), finding them by name (``find_deployed``, which deploys
nothing), checking asked settings against the running ones, stopping them.

Who deploys: ``raymq up`` (``settings_for_up`` first: a running RayMQ keeps its
settings), ``connect(deploy=True)``, and ``connect()`` on an embedded Ray it or its
process started.  Nothing else: an operator's ``raymq down`` stays down.

Talking to Ray is ``raymq.rpc``'s part.  Actors live in namespace ``raymq``,
detached, named, restartable (``max_restarts=-1``).  A shard is pinned so that
a restart finds its files: by the custom resource ``raymq_shard_<i>`` when
the cluster defines it (``ray_config.yaml`` does), else by node affinity to
the node it was first placed on (remembered by the controller).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Mapping

from raymq.actors.rocketmq_tx.checker import CheckerWorker
from raymq.actors.channel import DATA_METHODS, ChannelLimits, Endpoint
from raymq.actors.controller import Controller
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
from raymq.storage.errors import (BrokerUnavailableError, ConfigError, ConfigMismatchError,
                                  InvalidMessageError, NotDeployedError, NotLeaderError)

log = logging.getLogger("raymq.deploy")

NAMESPACE = rpc.NAMESPACE
CONTROLLER = "controller"


def shard_name(i: int) -> str:
    return f"shard-{i}"


def _untrace_private_methods(cls: type) -> None:
    """Drop the tracing wrappers Ray put on the shard's private methods.

    Ray runs an actor as a subclass whose every method is wrapped for
    tracing, so each internal ``self._x()`` call of a request went through a
    wrapper too (~10% of a shard's time under load).  Private methods are
    never called by Ray; with tracing on, Ray passes its context only to
    the actor methods it calls, which keep their wrappers.
    """
    if cls is ShardActor or not hasattr(cls, "__ray_actor_class__"):
        return
    for name in list(vars(cls)):
        if name.startswith("_") and not name.startswith("__") and \
                callable(getattr(BrokerShard, name, None)):
            delattr(cls, name)


class _Untraced:
    """A shard's own methods, past the tracing wrappers Ray puts on every actor method
    (they cost ~5% of a shard's time on the data channel, where there is no trace)."""

    def __init__(self, shard: BrokerShard):
        self._shard = shard

    def __getattr__(self, name: str):
        return getattr(BrokerShard, name).__get__(self._shard)


class ShardActor(BrokerShard):
    """The shard as a Ray actor: routes come from the controller."""

    def __init__(self, index: int, config: dict):
        _untrace_private_methods(type(self))
        controller = rpc.ControllerClient(get_controller())
        super().__init__(index, config,
                         fetch_routes=lambda i: controller.call("shard_routes", i, timeout_s=30),
                         metrics=RayMetrics(shard=str(index)))
        self.set_routes(controller.call("shard_routes", index, timeout_s=30))
        node = rpc.node_id()
        controller.call("set_shard_node", index, node, timeout_s=30)
        # the data channel opens last: nothing is served before recovery finished
        self._endpoint = Endpoint(_Untraced(self), host=rpc.node_ip(),
                                  limits=ChannelLimits.from_config(self.config))
        self._gauges = GaugeReporter(self.metrics, lambda: shard_gauges(self)).start()
        log.info("shard-%d up on node %s, data in %s, data channel on %s:%d", index, node,
                 self.directory, *self._endpoint.address)

    def endpoint(self) -> tuple[tuple[str, int], bytes]:
        """Address and key of this shard's data channel (``raymq.actors.channel``)."""
        return self._endpoint.address, self._endpoint.authkey

    def close(self) -> None:
        self._gauges.stop()
        self._endpoint.close()
        super().close()

    def node_id(self) -> str:
        return rpc.node_id()

    def disk_bytes(self) -> int | None:
        """The bytes this shard's files take on disk, as of its last gauge report (5 s)."""
        return _disk_bytes(self._gauges)


def _disk_bytes(gauges: "GaugeReporter") -> int | None:
    value = gauges.last.get("disk_bytes")
    return None if value is None else int(value)


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
    """One replica (``raymq.actors.replica``) as a Ray actor, in bundle ``k`` of its
    group's placement group; its files under its own node's data directory.  Subclasses
    say what a leader serves (``_kind``, ``_maker``, the channel's ``_methods``)."""

    _kind = "shard"
    _methods = REPLICA_METHODS
    _calls: type = _LeaderCalls

    def __init__(self, index: int, k: int, config: dict):
        cfg = ClusterConfig.from_dict(config)
        controller = rpc.ControllerClient(get_controller())
        node = rpc.node_id()
        kind = self._kind
        name = replica_name(index, k, kind)
        # followers fetch over the leader's data channel (a Ray call costs ~10 times as
        # much); Ray only tells where that channel is
        peers = PeerLinks(lambda other, timeout_s: rpc.call(
            rpc.get_actor(other, NAMESPACE).endpoint, timeout_s=timeout_s))
        self._peers = peers
        call_replica = peers.call
        self._replica = ShardReplica(
            index, name, cfg, os.path.join(cfg.resolved_data_dir(node), name),
            controller=lambda m, *a: controller.call(m, *a, timeout_s=10),
            call_replica=call_replica, make_shard=self._maker(index, cfg, controller),
            node=node)
        self._endpoint = Endpoint(self._calls(self._replica), host=rpc.node_ip(),
                                  methods=self._methods, limits=ChannelLimits.from_config(cfg))
        self._gauges = GaugeReporter(RayMetrics(**{self._kind: str(index)}),
                                     self._leader_gauges).start()
        log.info("%s up on node %s, data channel on %s:%d", name, node,
                 *self._endpoint.address)

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
                             metrics=RayMetrics(shard=str(index)))
            sh.set_routes(controller.call("shard_routes", index, timeout_s=30))
            return sh
        return make_shard

    def ping(self) -> dict:
        return self._replica.status()

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


class ReplicaActor(_Replica):
    """A replica of a replicated shard."""

    def disk_bytes(self) -> int | None:
        """The bytes its shard's files take on disk while it leads (as of its last gauge
        report), None while it follows."""
        self._replica.serving()  # (clients ask the leader's only)
        return _disk_bytes(self._gauges)


class _ShardCalls(_LeaderCalls):
    pass


ReplicaActor._calls = _ShardCalls
_delegate(BrokerShard, ReplicaActor, _ShardCalls)


class ShardLeaders:
    """Each shard's Ray handle, as a list of them is used: a plain shard's, or the leading
    replica's of a replicated one (asked of the controller, cached until ``forget``)."""

    def __init__(self, controller, config: ClusterConfig, kind: str = "shard"):
        self._control = rpc.ControllerClient(controller)
        self.factor = config.replication_factor
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
        if self.factor == 1:
            handle = rpc.get_actor(_NAMES[self.kind](i), NAMESPACE)
        else:
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
COORDINATOR_METHODS = frozenset({"init_producer", "add_to_transaction", "end_transaction"})


class CoordinatorActor(TransactionCoordinator):
    """Its calls to shards (registrations, markers) go over the shards' data channels,
    and producers reach it over its own (``COORDINATOR_METHODS``), as clients reach
    shards: a Ray call costs ~10 times as much."""

    def __init__(self, index: int, config: dict):
        from raymq.transport import DirectTransport, FailoverTransport
        cfg = ClusterConfig.from_dict(config)
        leaders = ShardLeaders(get_controller(), cfg)
        transport = DirectTransport(leaders.__getitem__, io_threads=8)
        if cfg.replication_factor > 1:
            transport = FailoverTransport(transport, leaders.forget)

        def begin_shard(i, method, args):
            return transport.begin(i, method, args, timeout_s=60)
        super().__init__(index, config, begin_shard=begin_shard)
        self._endpoint = Endpoint(self, host=rpc.node_ip(), methods=COORDINATOR_METHODS,
                                  limits=ChannelLimits.from_config(self.config))

    def endpoint(self) -> tuple[tuple[str, int], bytes]:
        """Address and key of this coordinator's data channel."""
        return self._endpoint.address, self._endpoint.authkey

    def close(self) -> None:
        self._endpoint.close()
        super().close()


class _CoordinatorCalls(_LeaderCalls):
    pass


class CoordinatorReplicaActor(_Replica):
    """A replica of a replicated transaction coordinator: its leader is the coordinator
    (its log replicated as a shard's commit log is), calling shards' leaders."""

    _kind = "coordinator"
    _methods = COORDINATOR_METHODS | {"replica_fetch"}
    _calls = _CoordinatorCalls

    def _maker(self, index: int, cfg: ClusterConfig, controller):
        from raymq.transport import DirectTransport, FailoverTransport
        leaders = ShardLeaders(get_controller(), cfg)
        transport = FailoverTransport(DirectTransport(leaders.__getitem__, io_threads=8),
                                      leaders.forget)

        def make_coordinator(directory):
            return TransactionCoordinator(
                index, cfg, directory=directory,
                begin_shard=lambda i, method, args: transport.begin(i, method, args,
                                                                    timeout_s=60))
        return make_coordinator

    def set_fault(self, fault: str | None) -> None:
        raise InvalidMessageError("coordinators take no test faults")


_delegate(TransactionCoordinator, CoordinatorReplicaActor, _CoordinatorCalls)


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


#: The plain actor name of shard or coordinator i.
_NAMES = {"shard": shard_name, "coordinator": coordinator_name}


def get_coordinator(i: int):
    """Coordinator ``i``'s Ray handle (``ValueError`` if it is not deployed); of a
    replicated one, its leading replica's."""
    return _handle("coordinator", i)


def _handle(kind: str, i: int):
    """The actor of shard or coordinator ``i``, by its plain name; of a replicated one,
    its leading replica's, asked of the controller."""
    try:
        return rpc.get_actor(_NAMES[kind](i), NAMESPACE)
    except ValueError:
        controller = get_controller()
        leaders = ShardLeaders(controller, _running_config(controller), kind)
        if leaders.factor == 1:
            raise
        return leaders[i]


def get_checker(i: int):
    """Checker ``i``'s Ray handle (``ValueError`` if it is not deployed)."""
    return rpc.get_actor(checker_name(i), NAMESPACE)


def get_controller():
    """The controller's Ray handle (``ValueError`` if it is not deployed)."""
    return rpc.get_actor(CONTROLLER, NAMESPACE)


def get_shard(i: int):
    """Shard ``i``'s Ray handle (``ValueError`` if it is not deployed); of a replicated
    shard, its leading replica's (``ShardLeaders`` caches them)."""
    return _handle("shard", i)


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
    """The actor names of the shards or coordinators (``kind``): plain, or their replicas'."""
    count = cfg.num_shards if kind == "shard" else cfg.num_coordinators
    if cfg.replication_factor == 1:
        return [_NAMES[kind](i) for i in range(count)]
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
    return controller, shards


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


def _create_replicas(control: rpc.ControllerClient, config: ClusterConfig) -> None:
    """Each shard's replicas, created unless they exist, one per bundle of the shard's
    placement group (``STRICT_SPREAD``: each on its own node); waits until every group
    has ``min_insync_replicas`` in sync."""
    check_deployable(config, running=True)  # (checked before anything: a node gone since?)
    _create_group(ReplicaActor, config, config.num_shards,
                  max_concurrency=config.shard_max_concurrency)
    _wait_in_sync(control, config, "replicas")


def _create_group(cls: type, config: ClusterConfig, count: int, *, max_concurrency: int):
    """``count`` groups of ``cls`` replicas (``replication_factor`` each, a placement group
    a group), created unless they exist; waits until each answers.  Their handles."""
    factor, cfg, kind = config.replication_factor, config.to_dict(), cls._kind
    replicas = []
    for i in range(count):
        group = rpc.spread_group(f"raymq-{kind}-{i}", factor)
        for k in range(factor):
            replicas.append(rpc.create_actor(
                cls, i, k, cfg, name=replica_name(i, k, kind), namespace=NAMESPACE,
                lifetime="detached", get_if_exists=True, max_restarts=-1, max_task_retries=0,
                num_cpus=0, max_concurrency=max_concurrency,
                runtime_env={"env_vars": dict(SHARD_PROCESS_ENV)},
                scheduling_strategy=rpc.in_group(group, k)))
    for r in replicas:
        rpc.ShardClient(r).call("ping", timeout_s=120)
    return replicas


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


def _create_shards(control: rpc.ControllerClient, config: ClusterConfig) -> list:
    """The shards' handles, each created unless it exists, pinned (module doc); waits
    until every shard answers."""
    if config.replication_factor > 1:
        _create_replicas(control, config)
        return ShardLeaders(control.handle, config)
    cfg = config.to_dict()
    resources = rpc.cluster_resources()
    nodes = rpc.alive_nodes()
    shards = []
    for i in range(config.num_shards):
        try:
            shards.append(get_shard(i))
            continue
        except ValueError:
            pass
        opts = dict(name=shard_name(i), namespace=NAMESPACE, lifetime="detached",
                    get_if_exists=True, max_restarts=-1, max_task_retries=-1, num_cpus=0,
                    max_concurrency=config.shard_max_concurrency,
                    runtime_env={"env_vars": dict(SHARD_PROCESS_ENV)})
        res = f"raymq_shard_{i}"
        if res in resources:
            opts["resources"] = {res: 0.001}
        else:
            node = control.call("shard_node", i, timeout_s=30)
            if node not in nodes:
                node = nodes[i % len(nodes)]
            opts["scheduling_strategy"] = rpc.pin_to_node(node)
        shards.append(rpc.create_actor(ShardActor, i, cfg, **opts))
    for s in shards:
        rpc.ShardClient(s).call("ping", timeout_s=120)
    return shards


def _create_helpers(config: ClusterConfig) -> None:
    """The registries, check-back workers and transaction coordinators, each created
    unless it exists; waits until each answers."""
    cfg = config.to_dict()
    common = dict(namespace=NAMESPACE, lifetime="detached", get_if_exists=True, max_restarts=-1,
                  max_task_retries=-1, num_cpus=0)
    registries = [rpc.create_actor(RegistryActor, i, cfg, name=registry_name(i),
                                   max_concurrency=64, **common)
                  for i in range(config.num_registries)]
    checkers = [rpc.create_actor(CheckerActor, i, cfg, name=checker_name(i),
                                 max_concurrency=4, **common)
                for i in range(config.num_checkers)]
    if config.replication_factor > 1:  # replicated as shards are, each on its own node
        coordinators = _create_group(CoordinatorReplicaActor, config, config.num_coordinators,
                                     max_concurrency=32)
    else:
        # coordinators keep their logs on the node they start on: pinned there, as the
        # controller is (by its resource on a `ray up` cluster)
        pinned = "raymq_controller" in rpc.cluster_resources()
        coordinators = [rpc.create_actor(
            CoordinatorActor, i, cfg, name=coordinator_name(i), max_concurrency=32,
            scheduling_strategy=None if pinned else rpc.pin_to_node(rpc.node_id()),
            resources={"raymq_controller": 0.001} if pinned else None, **common)
            for i in range(config.num_coordinators)]
    for r in registries:
        rpc.RegistryClient(r).call("ping", timeout_s=120)
    for c in checkers:
        rpc.CheckerClient(c).call("ping", timeout_s=120)
    for c in coordinators:
        rpc.CoordinatorClient(c).call("ping", timeout_s=120)
    if config.replication_factor > 1:
        _wait_in_sync(rpc.ControllerClient(get_controller()), config, "coordinator_replicas")


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
    # the actors that call shards go first (a check round or a marker write in flight
    # would otherwise meet a killed shard, and Ray logs a retry), the controller last
    order = (checker_name, coordinator_name, registry_name, shard_name)
    names = sorted(names, key=lambda n: next(
        (k for k, f in enumerate(order) if n.startswith(f(0)[:-1])), len(order)))
    for name in names:
        try:
            rpc.kill(rpc.get_actor(name, NAMESPACE), no_restart=True)
            killed.append(name)
        except ValueError:
            continue
    return killed

