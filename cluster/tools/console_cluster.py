"""The console's look at RayMQ's actors and Ray's nodes: every named actor of RayMQ's
namespace, by kind, and whether it answers (``rpc.ready``, a second at most)."""
from __future__ import annotations

import re

from raymq import rpc
from raymq.storage.errors import RayMQError

#: how long an actor may take to answer before the console shows it as not alive
READY_TIMEOUT_S = 2.0


def kind_of(name: str, replicated: bool = True) -> str:
    """An actor's kind from its name: ``shard-3`` -> shard, ``shard-3-r1`` -> shard
    replica (``replicated=False``: shard, the one replica of a group of one is the
    shard), ``controller`` -> controller."""
    head = name.split("-", 1)[0]
    kind = head if head in ("shard", "coordinator", "checker", "registry", "controller") \
        else "other"
    return f"{kind} replica" if replicated and re.search(r"-r\d+$", name) else kind


def actors_alive(mq) -> list[dict]:
    """``[{"name", "kind", "alive", "error"}]`` for every named actor of RayMQ."""
    names = rpc.named_actors()
    calls = []
    for name in names:
        try:
            calls.append(rpc.ready(rpc.get_actor(name)))
        except ValueError as err:  # gone between the listing and now
            calls.append(err)
    out = []
    for name, call in zip(names, calls):
        error = None
        if isinstance(call, Exception):
            error = str(call)
        else:
            try:
                call.result(READY_TIMEOUT_S)
            except (RayMQError, Exception) as err:  # noqa: BLE001 -- shown, not raised
                error = f"{type(err).__name__}: {err}"
        out.append({"name": name, "kind": kind_of(name, mq.config.replication_factor > 1),
                    "alive": error is None, "error": error})
    return out


def ray_nodes() -> list[dict]:
    return rpc.nodes()
