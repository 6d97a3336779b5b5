"""The one place that talks to Ray: ``ray.init``, creating, finding and killing actors,
and every actor call (``ActorClient`` and its per-kind subclasses), failures mapped to RayMQ's.

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

import os
import threading
from typing import Any, Callable

import ray
from ray import exceptions as rex
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raymq.storage.errors import BrokerUnavailableError, RayMQError, RequestTimeoutError

#: The Ray namespace of RayMQ's actors (and of the drivers ``init`` attaches).
NAMESPACE = "raymq"

_GONE = tuple(e for e in (getattr(rex, "RayActorError", None), getattr(rex, "ActorDiedError", None),
                          getattr(rex, "ActorUnavailableError", None),
                          getattr(rex, "ActorUnschedulableError", None),
                          getattr(rex, "WorkerCrashedError", None),
                          getattr(rex, "NodeDiedError", None)) if e is not None)


# ------------------------------------------------------------------ attaching
def connected() -> bool:
    """Whether this process is attached to Ray (a call now would not start a new Ray)."""
    return ray.is_initialized()


def worker_priority() -> None:
    """Have a Ray started from this process run its workers at normal priority.

    Ray starts worker processes at nice 15 by default (``RAY_worker_niceness``),
    so that its own daemons stay responsive.  A shard's actor is RayMQ's
    broker, not background work: at nice 15 it starves behind a busy client on
    the same machine (measured: ``txmsg.p8`` 716 -> 1,540 tx/s with 0).  Set
    before ``ray.init`` starts a local Ray; an explicit setting wins.
    """
    os.environ.setdefault("RAY_worker_niceness", "0")


def init(address: str | None = None, **options: Any) -> bool:
    """Attach this process to Ray unless it is attached already; whether it attached now.

    ``address``: ``"local"`` starts an embedded Ray of this process's own;
    ``"auto"`` or ``"host:port"`` joins a running cluster; None joins
    ``$RAY_ADDRESS`` if set, else does what ``ray.init()`` does (join a cluster
    running on this machine, else start an embedded one).  A Ray started here
    runs its workers at normal priority (``worker_priority``).  ``options`` go
    to ``ray.init``; ``namespace`` defaults to RayMQ's, ``log_to_driver`` to False.
    Raises what ``ray.init`` raises (``ConnectionError``: nothing to join).
    """
    if ray.is_initialized():
        return False
    worker_priority()
    address = address or os.environ.get("RAY_ADDRESS")
    options.setdefault("namespace", NAMESPACE)
    options.setdefault("log_to_driver", False)
    if address:
        ray.init(address=address, **options)
    else:
        ray.init(**options)
    return True


def shutdown() -> None:
    """Detach from Ray (and stop the embedded Ray this process started, if any)."""
    ray.shutdown()


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


def pin_to_node(node: str) -> NodeAffinitySchedulingStrategy:
    """The ``scheduling_strategy`` option that keeps an actor on ``node`` (never elsewhere)."""
    return NodeAffinitySchedulingStrategy(node, soft=False)


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
        return get(getattr(self.handle, method).remote(*args, **kwargs), timeout_s)

    def submit(self, method: str, *args, **kwargs) -> Pending:
        """Start a call to ``method``; the ``Pending`` gives its result."""
        return Pending(getattr(self.handle, method).remote(*args, **kwargs))

    def kill(self, *, no_restart: bool = True) -> None:
        kill(self.handle, no_restart=no_restart)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.handle!r})"


class ControllerClient(ActorClient):
    """Calls to the controller (``raymq.actors.controller.Controller``): topics, routes,
    group membership, shard placement."""

    __slots__ = ()


class ShardClient(ActorClient):
    """Calls to a shard actor (``raymq.actors.shard.BrokerShard``) through Ray; the SDK's
    data path reaches shards through ``raymq.transport`` instead."""

    __slots__ = ()


class RegistryClient(ActorClient):
    """Calls to a producer-group registry (``raymq.actors.registry.ProducerGroupRegistry``)."""

    __slots__ = ()


class CheckerClient(ActorClient):
    """Calls to a check-back worker (``raymq.actors.checker.CheckerWorker``)."""

    __slots__ = ()
