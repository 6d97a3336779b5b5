"""A replica's calls to the other replicas of its group (a follower's fetches, over the
leader's data channel): one connection per peer, one call at a time on it.  Below the
client layer: it speaks the channel's frames (``raymq.actors.channel``) itself, and is
handed ``locate(name)`` -- the peer's channel address and key -- by the actor around it.
Pure Python: no Ray.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from multiprocessing import AuthenticationError
from typing import Any, Callable

from raymq.actors.channel import Link, connect, encode_request, read_reply, readable
from raymq.storage.errors import BrokerUnavailableError, RequestTimeoutError


class PeerLinks:
    """``call(name, method, args, timeout_s)`` on the replica ``name``'s data channel.  A
    connection found broken is opened again once (the peer restarted since: every
    replica method is idempotent); a peer that does not answer in time loses its
    connection (a late reply is never read as the next call's)."""

    def __init__(self, locate: Callable[[str, float], tuple[tuple[str, int], bytes]]):
        self._locate = locate
        self._links: dict[str, Link] = {}
        self._locks: dict[str, threading.Lock] = defaultdict(threading.Lock)
        self._closed = False

    def call(self, name: str, method: str, args: tuple, timeout_s: float) -> Any:
        with self._locks[name]:
            for _attempt in range(2):
                link, fresh = self._link(name, timeout_s)
                try:
                    link.send_bytes(encode_request(method, args))
                    answered = readable(link, timeout_s)
                    if answered:
                        ok, value = read_reply(link)
                except (EOFError, OSError) as err:
                    self._drop(name)
                    if fresh:
                        raise BrokerUnavailableError(f"{name}: connection lost during {method}: "
                                                     f"{type(err).__name__}: {err}") from None
                    continue
                if not answered:
                    self._drop(name)
                    raise RequestTimeoutError(f"{name} did not answer {method} within "
                                              f"{timeout_s:.1f} s")
                if ok:
                    return value
                raise value
        raise BrokerUnavailableError(f"{name}: no connection for {method}")

    def _link(self, name: str, timeout_s: float) -> tuple[Link, bool]:
        link = self._links.get(name)
        if link is not None:
            return link, False
        if self._closed:
            raise BrokerUnavailableError(f"{name}: this replica is closing")
        address, key = self._locate(name, timeout_s)
        try:
            link = connect(tuple(address), key, timeout_s)
        except (OSError, EOFError, AuthenticationError) as err:
            raise BrokerUnavailableError(f"{name} endpoint {address} unreachable: "
                                         f"{type(err).__name__}: {err}") from None
        self._links[name] = link
        return link, True

    def _drop(self, name: str) -> None:
        link = self._links.pop(name, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        self._closed = True
        for name in list(self._links):
            self._drop(name)
