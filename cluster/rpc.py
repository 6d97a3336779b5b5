"""The one place that talks to Ray: finding and joining a cluster (``init``), creating,
finding and killing actors, and every actor call (``ActorClient`` and its per-kind
subclasses), failures mapped to RayMQ's.

Joining asks the cluster first (``probe``), so a wrong address, a cluster that wants a
token, or the address file of a Ray that died is one line saying what to fix
(``RayUnreachableError``, ``RayAuthError``) within seconds, not minutes of Ray's retries.

Nothing else in RayMQ calls ``.remote()`` or ``ray.init``; tests replace a client
class (``ShardClient``, ...) or a function here instead of Ray.  How a call's
failure reaches the caller:

- actor gone or restarting -> ``BrokerUnavailableError`` (retriable)
- no answer in time        -> ``RequestTimeoutError`` (retriable)
- an error raised by RayMQ code in the actor -> that error, unwrapped

Calls are not retried here: Ray itself resends a call in flight to a
restarting actor (``max_task_retries=-1``), the callers decide the rest.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray import exceptions as rex
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raymq.storage.errors import (BrokerUnavailableError, ControllerRecoveringError,
                                  RayAuthError, RayMQError, RayUnreachableError,
                                  RequestTimeoutError)

#: The Ray namespace of RayMQ's actors (and of the drivers ``init`` attaches).
NAMESPACE = "raymq"

log = logging.getLogger("raymq.rpc")

_GONE = tuple(e for e in (getattr(rex, "RayActorError", None), getattr(rex, "ActorDiedError", None),
                          getattr(rex, "ActorUnavailableError", None),
                          getattr(rex, "ActorUnschedulableError", None),
                          getattr(rex, "WorkerCrashedError", None),
                          getattr(rex, "NodeDiedError", None)) if e is not None)


# ------------------------------------------------------------------ attaching
def connected() -> bool:
    """Whether this process is attached to Ray (a call now would not start a new Ray)."""
    return ray.is_initialized()


def worker_settings() -> None:
    """Settings for the workers of a Ray started from this process (set before
    ``ray.init`` starts a local Ray; an explicit setting wins).

    - Normal priority: Ray starts worker processes at nice 15 by default
      (``RAY_worker_niceness``), so that its own daemons stay responsive.  A shard's
      actor is RayMQ's broker, not background work: at nice 15 it starves behind a busy
      client on the same machine (measured: ``txmsg.p8`` 716 -> 1,540 tx/s with 0).
    - Idle task workers kept: Ray kills an idle worker after a second once a node has
      more workers than CPUs (``RAY_num_workers_soft_limit``), and RayMQ's own actors
      (shards, coordinators, checkers, registries) and Spark's count.  Every
      ``read_committed`` then started its read workers afresh, two at a time (measured
      with Spark up, 500k messages: 3.8-4.7 s -> 1.1 s with ``WORKERS_SOFT_LIMIT_EXTRA``).
    """
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("RAY_num_workers_soft_limit",
                          str((os.cpu_count() or 1) + WORKERS_SOFT_LIMIT_EXTRA))


#: Workers a node keeps beyond one per CPU (``worker_settings``): RayMQ's and Spark's
#: long-lived actors, and a read task per queue of a committed dataset.
WORKERS_SOFT_LIMIT_EXTRA = 12


#: The largest object store ``init`` gives an embedded Ray (Ray's own default is 30% of
#: the memory available), so that reserving it at start (``embedded_store_settings``) is
#: quick: about a second for 3 GiB here, against 8 s for 7.5 GB.
EMBEDDED_OBJECT_STORE_MAX = 3 << 30


def embedded_store_settings(options: dict, available_memory: int, shm_free: int) -> dict:
    """The ``ray.init`` options of a Ray that ``init`` starts here: the object store Ray
    would give it (30% of ``available_memory``) at most ``EMBEDDED_OBJECT_STORE_MAX`` unless
    ``options`` size it, and reserved at start (Ray's ``preallocate_plasma_memory``) when
    ``/dev/shm`` has room for it (``shm_free``; else Ray keeps its store in a file on
    disk, not to be written whole).  A ``_system_config`` in ``options`` wins.

    Why reserve it: until the whole store has been used once, Ray places each new object
    in store memory that no process has touched yet, and the kernel allocates and zeroes
    such memory page by page as the object is written.  A committed dataset's blocks are
    all new objects: a 90 MB block took 0.08-0.09 s to store in fresh memory and 0.045 s
    in reserved memory; a read task's system time per 1M-row read fell from 0.52-0.59 s
    to 0.37-0.40 s with Spark up."""
    options = dict(options)
    options.setdefault("object_store_memory",
                       min(EMBEDDED_OBJECT_STORE_MAX, int(available_memory * 0.3)))
    if options["object_store_memory"] <= shm_free:
        options["_system_config"] = {"preallocate_plasma_memory": True,
                                     **options.get("_system_config", {})}
    return options


def _shm_free() -> int:
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:  # (no /dev/shm: Ray's store is a file on disk)
        return 0


#: How long ``init`` waits for a cluster to answer before saying it does not (seconds).
PROBE_TIMEOUT_S = 5.0

#: What this process told ``init``: whether the Ray it attached to is one it started.
_STATE = {"embedded": False}

_TOKEN_PLACES = ("~/.ray/auth_token, $RAY_AUTH_TOKEN_PATH or $RAY_AUTH_TOKEN "
                 "(`ray get-auth-token` on the cluster's head prints it)")


@dataclass(frozen=True)
class Target:
    """Where ``init`` joins a Ray cluster: ``address`` ("host:port"; None: start an
    embedded Ray), ``source`` (how it was found, for messages), and ``file`` (Ray's
    address file it was read from, if it was)."""

    address: str | None
    source: str
    file: str | None = None


def find_cluster(address: str | None) -> Target:
    """Where ``init(address)`` would join (see ``init``), without asking the cluster.

    ``RayUnreachableError`` for ``"auto"`` when nothing runs here, or when several
    clusters run here and none is named (Ray would pick one at random).
    """
    from ray._common.utils import get_ray_address_file
    from ray._private.services import find_gcs_addresses
    from ray._private.utils import read_ray_address
    env = os.environ.get("RAY_ADDRESS", "")
    if address == "local" or (address in (None, "auto") and env == "local"):
        return Target(None, "an embedded Ray")
    if address not in (None, "auto"):
        return Target(address, "the address given")
    if env not in ("", "auto"):
        return Target(env, "$RAY_ADDRESS")
    found = read_ray_address()
    if found:
        path = get_ray_address_file(None)
        return Target(found, f"Ray's address file {path}", file=path)
    if address is None:
        return Target(None, "an embedded Ray")
    running = sorted(find_gcs_addresses())
    if len(running) == 1:
        return Target(running[0], "the Ray running on this machine")
    if running:
        raise RayUnreachableError(f"several Ray clusters run on this machine ({', '.join(running)}) "
                                  "and none is named: choose one with --address or $RAY_ADDRESS")
    raise RayUnreachableError(
        "no Ray cluster found (no --address, no $RAY_ADDRESS, no Ray running on this machine): "
        "start one with `RAY_worker_niceness=0 ray start --head` or `ray up ray_config.yaml`, "
        "or set RAY_ADDRESS=host:port; `raymq demo` runs on an embedded Ray")


def probe(target: Target, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Ask the cluster at ``target`` for its id, as Ray's own clients do first, with this
    process's authentication: one try, at most ``timeout_s``.

    Returns when it answers; raises ``RayAuthError`` when it refuses this process and
    ``RayUnreachableError`` when nothing answers there as a Ray cluster (both one line,
    with the fix).
    """
    import grpc
    from ray._private.authentication.authentication_token_setup import (
        ensure_token_if_auth_enabled)
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    try:
        ensure_token_if_auth_enabled(None, create_token_if_missing=False)
    except rex.AuthenticationError as err:  # token mode on, and no token here
        raise RayAuthError(_one_line(err)) from None
    channel = init_grpc_channel(target.address)
    try:
        gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
            gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
    except grpc.RpcError as err:
        raise _refusal(target, err.code(), err.details() or "", timeout_s) from None
    finally:
        channel.close()


def _refusal(target: Target, code, details: str, timeout_s: float) -> RayMQError:
    """The one-line error for a cluster that did not answer ``probe`` as one that accepts us."""
    import grpc
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    where = f"the Ray cluster at {target.address} ({target.source})"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        if not is_token_auth_enabled():
            return RayAuthError(f"{where} requires token authentication, which is off in this "
                                f"process: set RAY_AUTH_MODE=token, with the cluster's token in "
                                f"{_TOKEN_PLACES}")
        return RayAuthError(f"{where} refused this process's token ({details}): use the "
                            f"cluster's token, in {_TOKEN_PLACES}")
    why = f"no answer within {timeout_s:g} s" if code == grpc.StatusCode.DEADLINE_EXCEEDED \
        else details.rsplit(": ", 1)[-1]
    if target.file:
        return RayUnreachableError(
            f"{target.source} names {target.address}, where nothing answers ({why}): a Ray "
            f"cluster that stopped without cleaning up; start it again, or delete {target.file}")
    return RayUnreachableError(
        f"nothing answers as a Ray cluster at {target.address} ({target.source}: {why}): start "
        "it (`ray start --head`, `ray up ray_config.yaml`) or set --address / $RAY_ADDRESS to "
        "a running one")


def _reachable(address: str | None) -> Target:
    """``find_cluster``, then ``probe`` what was found; past a dead cluster's address file
    to an embedded Ray when ``address`` is None (``init``)."""
    target = find_cluster(address)
    if target.address is None or "://" in target.address:  # embedded, or Ray Client
        return target
    if address in (None, "auto") and target.source != "$RAY_ADDRESS":
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available)
        ray_log = logging.getLogger(maybe_enable_token_auth_if_token_available.__module__)
        level = ray_log.level
        ray_log.setLevel(logging.ERROR)  # its warning would be a second line of an error
        try:
            maybe_enable_token_auth_if_token_available(warn_if_disabled=False)  # as ray.init
        finally:
            ray_log.setLevel(level)
    try:
        probe(target)
    except RayUnreachableError as err:
        if address is not None or target.file is None:
            raise
        log.warning("%s -- starting an embedded Ray instead", err)
        return Target(None, "an embedded Ray")
    return target


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


def init(address: str | None = None, **options: Any) -> bool:
    """Attach this process to Ray unless it is attached already; whether it attached now.

    ``address``: ``"local"`` starts an embedded Ray of this process's own;
    ``"host:port"`` (or ``$RAY_ADDRESS``) joins that cluster; ``"auto"`` joins
    the cluster of this machine (Ray's address file, else the one Ray running
    here) and never starts one; None is ``"auto"`` but starts an embedded Ray
    when there is nothing to join -- also when Ray's address file names a
    cluster that no longer answers (a Ray that stopped without cleaning up:
    logged).  ``$RAY_ADDRESS`` counts as given (Ray then enables token auth
    only by ``RAY_AUTH_MODE=token``; a found cluster also by ``~/.ray/auth_token``).

    A cluster is asked first whether it answers and accepts this process
    (``probe``: one try, ``PROBE_TIMEOUT_S``), so a wrong address, a cluster
    that wants a token, or a dead cluster's address file is a one-line
    ``RayUnreachableError`` / ``RayAuthError`` saying what to fix, never minutes
    of Ray's retries.  A Ray started here gets an object store reserved at start
    (``embedded_store_settings``) and runs its workers at normal priority and
    keeps idle ones (``worker_settings``).  ``options`` go to ``ray.init``; ``namespace``
    defaults to RayMQ's, ``log_to_driver`` to False.
    """
    if ray.is_initialized():
        return False
    worker_settings()
    target = _reachable(address)
    options.setdefault("namespace", NAMESPACE)
    options.setdefault("log_to_driver", False)
    if target.address is None:
        import psutil
        options = embedded_store_settings(options, psutil.virtual_memory().available,
                                          _shm_free())
    try:
        ray.init(address=target.address or "local", **options)
    except rex.AuthenticationError as err:
        raise RayAuthError(_one_line(err)) from None
    except ConnectionError as err:
        raise RayUnreachableError(f"could not join the Ray cluster at {target.address} "
                                  f"({target.source}): {_one_line(err)}") from None
    _STATE["embedded"] = target.address is None
    return True


def embedded() -> bool:
    """Whether the Ray this process is attached to is an embedded one: started by this
    process (``init("local")``, or ``ray.cluster_utils.Cluster``: its GCS server is a
    child process of this one) and ending with it."""
    if not ray.is_initialized():
        return False
    if _STATE["embedded"]:
        return True
    import psutil
    session = f"--session-name={ray._private.worker.global_worker.node.session_name}"
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name() == "gcs_server" and session in p.cmdline():
                return True
        except psutil.Error:
            continue
    return False


def shutdown() -> None:
    """Detach from Ray (and stop the embedded Ray this process started, if any)."""
    ray.shutdown()
    _STATE["embedded"] = False


def gcs_address() -> str:
    """The address other processes pass to ``init`` to join the Ray this process is on."""
    return ray.get_runtime_context().gcs_address


# ------------------------------------------------------- where this runs
def node_id() -> str:
    """The id of the Ray node this process (driver or actor) runs on."""
    return ray.get_runtime_context().get_node_id()


def node_ip() -> str:
    """The IP address of this process's node, as Ray knows it."""
    return ray.util.get_node_ip_address()


def alive_nodes() -> list[str]:
    """Ids of the cluster's live nodes, sorted."""
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def nodes() -> list[dict]:
    """Every node Ray knows: ``node`` (id), ``alive``, ``address``, ``head``,
    ``metrics_port`` (its Prometheus endpoint: ``http://address:port/metrics``) and its
    ``resources`` (totals)."""
    return [{"node": n["NodeID"], "alive": bool(n.get("Alive")),
             "address": n.get("NodeManagerAddress"),
             "head": "node:__internal_head__" in n.get("Resources", {}),
             "metrics_port": n.get("MetricsExportPort"),
             "resources": {k: v for k, v in n.get("Resources", {}).items()
                           if not k.startswith("node:")}} for n in ray.nodes()]


def logs_dir() -> str:
    """This Ray session's log directory on this machine."""
    return ray._private.worker._global_node.get_logs_dir_path()


def named_actors(namespace: str = NAMESPACE) -> list[str]:
    """The names of the live named actors of ``namespace``, sorted."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == namespace)


def ready(handle) -> Pending:
    """A call that answers once the actor is up (Ray's own readiness method)."""
    return Pending(handle.__ray_ready__.remote())


def cluster_resources() -> dict[str, float]:
    """The cluster's total resources, custom ones included (``raymq_shard_<i>``, ...)."""
    return ray.cluster_resources()


def actor_restarted() -> bool:
    """In an actor's constructor: whether Ray is restarting it (not its first start)."""
    return ray.get_runtime_context().was_current_actor_reconstructed


# ------------------------------------------------------------------- actors
_REMOTE: dict[type, Any] = {}
_REMOTE_LOCK = threading.Lock()


def create_actor(cls: type, *args: Any, **options: Any):
    """A handle to a new actor of plain class ``cls`` built with ``args``.

    ``options`` are Ray's actor options (``name``, ``namespace``, ``lifetime``,
    ``get_if_exists``, ``max_restarts``, ``num_cpus``, ``resources``,
    ``scheduling_strategy``...); with ``get_if_exists`` a named actor that
    exists already is returned instead.  Idempotent then.
    """
    with _REMOTE_LOCK:
        remote = _REMOTE.get(cls)
        if remote is None:
            remote = _REMOTE[cls] = ray.remote(cls)
    return remote.options(**options).remote(*args)


def pin_to_node(node: str, *, soft: bool = False) -> NodeAffinitySchedulingStrategy:
    """The ``scheduling_strategy`` option that keeps an actor on ``node`` (never elsewhere;
    ``soft``: elsewhere once that node is gone)."""
    return NodeAffinitySchedulingStrategy(node, soft=soft)


def spread_group(name: str, bundles: int, *, timeout_s: float = 120):
    """The detached placement group ``name`` of ``bundles`` bundles on as many distinct
    nodes (``STRICT_SPREAD``), created unless it exists; waits until it is placed
    (``RayMQError`` naming the group when the cluster cannot place it in time)."""
    from ray.util import get_placement_group, placement_group
    try:
        group = get_placement_group(name)
    except ValueError:
        group = placement_group([{"CPU": 0.001}] * bundles, strategy="STRICT_SPREAD",
                                name=name, lifetime="detached")
    if not group.wait(timeout_seconds=timeout_s):
        raise RayMQError(f"placement group {name} ({bundles} bundles on distinct nodes) "
                         f"is not placed after {timeout_s:.0f} s: too few nodes with a free CPU")
    return group


def remove_group(name: str) -> bool:
    """Remove the placement group ``name``; whether there was one."""
    from ray.util import get_placement_group, remove_placement_group
    try:
        remove_placement_group(get_placement_group(name))
        return True
    except ValueError:
        return False


def in_group(group, bundle: int):
    """The ``scheduling_strategy`` option that places an actor in bundle ``bundle``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return PlacementGroupSchedulingStrategy(placement_group=group,
                                            placement_group_bundle_index=bundle)


def get_actor(name: str, namespace: str = NAMESPACE):
    """The handle of the named actor; ``ValueError`` if there is none."""
    return ray.get_actor(name, namespace=namespace)


def kill(handle, *, no_restart: bool = True) -> None:
    """Kill an actor (with ``no_restart=False`` Ray restarts it, as after a crash)."""
    ray.kill(handle, no_restart=no_restart)


# -------------------------------------------------------------------- calls
def get(ref, timeout_s: float | None = None) -> Any:
    """The result of a call under way (a Ray object ref), failures mapped (module doc)."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except rex.GetTimeoutError:
        raise RequestTimeoutError(f"no answer within {timeout_s:.1f} s") from None
    except rex.RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, RayMQError):
            raise cause from None
        if isinstance(cause, _GONE):
            raise BrokerUnavailableError(str(cause)) from None
        raise
    except _GONE as err:
        raise BrokerUnavailableError(f"actor unavailable: {type(err).__name__}: "
                                     f"{str(err).splitlines()[0] if str(err) else ''}") from None


def call(method, *args, timeout_s: float | None = None, **kwargs) -> Any:
    """``method.remote(*args, **kwargs)`` of an actor method (``handle.name``), and wait for it."""
    return get(method.remote(*args, **kwargs), timeout_s)


class Pending:
    """A call under way: ``result`` waits for it, ``add_done_callback`` hears when it ends."""

    __slots__ = ("ref",)

    def __init__(self, ref):
        self.ref = ref

    def result(self, timeout_s: float | None = None) -> Any:
        """Its result, or its failure mapped as ``get`` maps it."""
        return get(self.ref, timeout_s)

    def add_done_callback(self, fn: Callable[["Pending"], Any]) -> None:
        """Call ``fn(self)`` once the call ended (in a Ray thread: keep ``fn`` short)."""
        self.ref.future().add_done_callback(lambda _f: fn(self))


def wait_all(pendings: list[Pending], timeout_s: float | None = None) -> list:
    """Results (or the RayMQError each raised) of several calls, in order."""
    out = []
    for p in pendings:
        try:
            out.append(p.result(timeout_s))
        except RayMQError as err:
            out.append(err)
    return out


class ActorClient:
    """Calls to one actor by method name.

    Whether a method is idempotent and safe to retry is that method's own
    contract (see the actor's class); this adds no retries.
    """

    __slots__ = ("handle",)

    def __init__(self, handle):
        #: the Ray actor handle (a client given here is unwrapped)
        self.handle = handle.handle if isinstance(handle, ActorClient) else handle

    def call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> Any:
        """Call ``method`` and wait up to ``timeout_s`` (None: for ever) for its result."""
        return get(self._method(method).remote(*args, **kwargs), timeout_s)

    def submit(self, method: str, *args, **kwargs) -> Pending:
        """Start a call to ``method``; the ``Pending`` gives its result."""
        return Pending(self._method(method).remote(*args, **kwargs))

    def _method(self, method: str):
        if not ray.is_initialized():  # (Ray would start a new local cluster of its own)
            raise RayUnreachableError(
                f"cannot call {method}: Ray no longer runs in this process (ray.shutdown() "
                f"ran, or the process never joined the cluster); nothing was called")
        return getattr(self.handle, method)

    def kill(self, *, no_restart: bool = True) -> None:
        kill(self.handle, no_restart=no_restart)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.handle!r})"


class ControllerClient(ActorClient):
    """Calls to the controller (``raymq.actors.controller.Controller``): topics, routes,
    group membership, shard placement.  A controller taking its records back from the
    replicas (``ControllerRecoveringError``) is asked again, within ``timeout_s``."""

    __slots__ = ()

    def call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> Any:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pause = 0.05
        while True:
            try:
                return super().call(method, *args, timeout_s=timeout_s, **kwargs)
            except ControllerRecoveringError:
                if deadline is not None and time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 1.0)


class ShardClient(ActorClient):
    """Calls to a shard actor (``raymq.actors.shard.BrokerShard``) through Ray; the SDK's
    data path reaches shards through ``raymq.transport`` instead."""

    __slots__ = ()


class RegistryClient(ActorClient):
    """Calls to a producer-group registry (``raymq.actors.rocketmq_tx.registry.ProducerGroupRegistry``)."""

    __slots__ = ()


class CheckerClient(ActorClient):
    """Calls to a check-back worker (``raymq.actors.rocketmq_tx.checker.CheckerWorker``)."""

    __slots__ = ()


class CoordinatorClient(ActorClient):
    """Calls to a transaction coordinator
    (``raymq.actors.kafka_tx.coordinator.TransactionCoordinator``)."""

    __slots__ = ()
