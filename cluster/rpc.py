"""The one place that waits on Ray calls: maps Ray's failures onto RayMQ errors.

- actor gone or restarting -> ``BrokerUnavailableError`` (retriable)
- no answer in time        -> ``RequestTimeoutError`` (retriable)
- an error raised by RayMQ code in the actor -> that error, unwrapped
"""
from __future__ import annotations

from typing import Any

import ray
from ray import exceptions as rex

from raymq.storage.errors import BrokerUnavailableError, RayMQError, RequestTimeoutError

_GONE = tuple(e for e in (getattr(rex, "RayActorError", None), getattr(rex, "ActorDiedError", None),
                          getattr(rex, "ActorUnavailableError", None),
                          getattr(rex, "ActorUnschedulableError", None),
                          getattr(rex, "WorkerCrashedError", None),
                          getattr(rex, "NodeDiedError", None)) if e is not None)


def connected() -> bool:
    """Whether this process is attached to Ray (a call now would not start a new Ray)."""
    return ray.is_initialized()


def get(ref, timeout_s: float | None = None) -> Any:
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
    """``method.remote(*args, **kwargs)`` and wait for it."""
    return get(method.remote(*args, **kwargs), timeout_s)


def wait_all(refs: list, timeout_s: float | None = None) -> list:
    """Results (or the RayMQError each raised) of several calls, in order."""
    out = []
    for ref in refs:
        try:
            out.append(get(ref, timeout_s))
        except RayMQError as err:
            out.append(err)
    return out
