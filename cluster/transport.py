"""How the SDK's data path reaches a shard: the choice between its direct channel and Ray
calls (``make_transport``), each one's pooling and retries, and ``Outcome``, the SDK's future.

``ClusterConfig.transport``:

- ``"direct"`` (default): the hot calls (``send``, ``end_transactions``,
  ``pull``, ``commit_offsets``, ``get_offsets``) go over the shard's data
  channel (``raymq.actors.channel``: wire format, handshake, connections),
  found through a Ray call to the shard actor and cached.  A broken connection
  means the shard is gone or restarting: ``BrokerUnavailableError``
  (retriable); the next call asks the actor again, which answers once the
  restarted shard has recovered.  An endpoint of another RayMQ release:
  ``ProtocolVersionError`` (not retriable).
  A request larger than the endpoint takes (its ``LIMITS``, the cluster's
  ``channel_max_request_bytes``) goes as a Ray call instead.  With Ray's TLS on
  (``RAY_USE_TLS``) the channel runs over TLS with Ray's certificates; if they
  cannot be loaded here, the client falls back to ``"ray"`` and says so
  (``why``, shown by ``raymq status``).
- ``"ray"``: every call is a Ray actor call (``raymq.rpc``).

Both give the same results and raise the same ``RayMQError`` kinds.  Each transport's
``why`` is one line: which it is and why (``raymq status`` prints it).
"""
from __future__ import annotations

import logging
import time
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import AuthenticationError
from typing import Any, Callable

from raymq import rpc
from raymq.actors.channel import (TLS_FROM_RAY, Link, connect, encode_request, read_reply,
                                  ray_tls_enabled, readable, tls_context)
from raymq.actors.config import TRANSPORTS
from raymq.storage import steps
from raymq.storage.errors import (BrokerUnavailableError, ChannelTLSError, NotLeaderError,
                                  ProtocolVersionError,
                                  RayMQError, RequestTimeoutError)

log = logging.getLogger("raymq.transport")


class Outcome:
    """A light future: no lock or condition of its own until somebody waits.

    The SDK makes one per request part (per message for single sends), so a
    ``concurrent.futures.Future`` (a Condition each) was a measurable cost.
    Offers the part of the Future interface the SDK uses.
    """

    __slots__ = ("_done", "_result", "_error", "_callbacks", "_event")  # _event: a Lock

    def __init__(self):
        self._done = False
        self._result = None
        self._error: BaseException | None = None
        self._callbacks: list | None = None
        self._event: threading.Lock | None = None

    def done(self) -> bool:
        return self._done

    def _finish(self) -> None:
        with _OUTCOME_LOCK:
            self._done = True
            callbacks, self._callbacks = self._callbacks, None
            waiter, self._event = self._event, None
        if waiter is not None:
            waiter.release()
        for cb in callbacks or ():
            try:
                cb(self)
            except Exception:  # a callback's failure is its own
                log.exception("completion callback failed")

    def set_result(self, value) -> None:
        self._result = value
        self._finish()

    def set_exception(self, err: BaseException) -> None:
        self._error = err
        self._finish()

    def settle(self, fn: Callable[[], Any]) -> None:
        """Complete with ``fn()``'s result, or with what it raised (for whoever waits)."""
        try:
            value = fn()
        except BaseException as err:
            self.set_exception(err)
        else:
            self.set_result(value)

    def add_done_callback(self, cb) -> None:
        with _OUTCOME_LOCK:
            if not self._done:
                self._callbacks = (self._callbacks or []) + [cb]
                return
        cb(self)

    def exception(self, timeout: float | None = None):
        self._wait(timeout)
        return self._error

    def result(self, timeout: float | None = None):
        self._wait(timeout)
        if self._error is not None:
            raise self._error
        return self._result

    def _wait(self, timeout: float | None) -> None:
        if self._done:
            return
        with _OUTCOME_LOCK:
            if self._done:
                return
            if self._event is None:  # a bare lock, held until the outcome completes
                self._event = threading.Lock()
                self._event.acquire()
            waiter = self._event
        if not waiter.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise TimeoutError("the call did not complete in time")
        waiter.release()  # and so the next waiter passes too


_OUTCOME_LOCK = threading.Lock()


class RayTransport:
    """Every call a Ray actor call."""

    name = "ray"

    def __init__(self, shard_handle: Callable[[int], Any], *,
                 why: str = "every call a Ray actor call (transport='ray')"):
        self._handle = shard_handle
        #: one line: why this transport (``raymq status``)
        self.why = why

    def call(self, shard: int, method: str, *args, timeout_s: float) -> Any:
        return self.begin(shard, method, args, timeout_s=timeout_s).result()

    def begin(self, shard: int, method: str, args: tuple, *, timeout_s: float):
        """Start a call; ``result()`` of what it returns waits for it."""
        return _RayCall(rpc.ShardClient(self._handle(shard)).submit(method, *args), timeout_s)

    def submit(self, shard: int, method: str, args: tuple, *, timeout_s: float) -> Outcome:
        """Start a call; the outcome completes with its result or its ``RayMQError``.

        (Ray retries a call to a restarting actor by itself, so ``timeout_s``
        is left to the caller's own deadline here.)
        """
        out = Outcome()
        pending = rpc.ShardClient(self._handle(shard)).submit(method, *args)
        pending.add_done_callback(lambda done: out.settle(lambda: done.result(0)))
        return out

    def close(self) -> None:
        pass


class _RayCall:
    __slots__ = ("pending", "timeout_s")

    def __init__(self, pending: rpc.Pending, timeout_s: float):
        self.pending, self.timeout_s = pending, timeout_s

    def result(self) -> Any:
        return self.pending.result(self.timeout_s)

    def abandon(self) -> None:
        """Its answer is not wanted (the call runs on; what it returns is dropped)."""


class _ChannelRefused(BrokerUnavailableError):
    """A shard's endpoint closed a new connection in its handshake (at its connection
    limits, or going away): a call falls back to Ray."""


class DirectTransport:
    """Calls over the shards' data channels (``raymq.actors.channel``); a pool of
    connections per shard.

    A connection carries one call at a time; concurrent calls to a shard use
    more connections.  ``submit`` runs the call in an I/O thread.  ``tls`` is the
    client's TLS context (default: TLS exactly when Ray's is on, ``tls_context``).
    """

    name = "direct"

    def __init__(self, shard_handle: Callable[[int], Any], *, io_threads: int = 256,
                 tls: ssl.SSLContext | None | str = TLS_FROM_RAY, why: str = ""):
        self._handle = shard_handle
        self._tls = tls_context(server_side=False) if isinstance(tls, str) else tls
        #: one line: why this transport (``raymq status``)
        self.why = why or (_TLS_WHY if self._tls is not None else _PLAIN_WHY)
        self._ray = RayTransport(shard_handle)  # for requests larger than an endpoint takes
        self._lock = threading.Lock()
        self._endpoints: dict[int, tuple[tuple[str, int], bytes]] = {}
        self._idle: dict[int, list[Link]] = {}
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="raymq-io")
        self._closed = False
        self._refused_said = -1e9  # when a refused connection was last logged

    # ------------------------------------------------------------ calls
    def call(self, shard: int, method: str, *args, timeout_s: float) -> Any:
        """Call ``method`` of the shard and wait for it.

        A pooled connection found broken is replaced once at once (the shard
        restarted since it was opened; every channel method is idempotent).
        """
        return self.begin(shard, method, args, timeout_s=timeout_s).result()

    def begin(self, shard: int, method: str, args: tuple, *, timeout_s: float):
        """Send a call now; its ``result()`` waits for the answer (``call`` in two halves,
        so the caller can do other work while the shard works).  A request larger than
        the endpoint takes goes as a Ray call."""
        c = _Call(self, shard, method, encode_request(method, args), timeout_s)
        steps.mark("client.encoded")
        try:
            try:
                c.conn, c.reused = self._checkout(shard, timeout_s)
            except _ChannelRefused as err:  # (at its limits, say): the same call via Ray
                if time.monotonic() - self._refused_said > 10:  # (a line per 10 s at most)
                    self._refused_said = time.monotonic()
                    log.warning("shard-%d %s: the data channel refused a connection (%s); "
                                "calls go through Ray meanwhile", shard, method, err)
                return self._ray.begin(shard, method, args, timeout_s=timeout_s)
            if len(c.request) > c.conn.max_request_bytes:
                self._checkin(shard, c.conn)
                log.debug("shard-%d %s: a request of %d bytes goes through Ray (the channel "
                          "takes %d)", shard, method, len(c.request), c.conn.max_request_bytes)
                return self._ray.begin(shard, method, args, timeout_s=timeout_s)
            self._send(c)
            steps.mark("client.sent")
        except RayMQError as err:
            c.error = err
        return c

    def _send(self, c: "_Call") -> None:
        while True:
            try:
                c.conn.send_bytes(c.request)
                return
            except (EOFError, OSError) as err:
                self._replace(c, err)

    def _replace(self, c: "_Call", err: BaseException) -> None:
        """The call's connection broke: a fresh one if it was pooled, else the shard is gone."""
        c.conn.close()
        self._forget(c.shard)
        if not c.reused:
            raise BrokerUnavailableError(f"shard-{c.shard} connection lost during {c.method}: "
                                         f"{type(err).__name__}: {err}") from None
        c.conn, c.reused = self._checkout(c.shard, c.timeout_s)

    def _receive(self, c: "_Call") -> Any:
        if c.error is not None:
            raise c.error
        while True:
            try:
                if not readable(c.conn, c.timeout_s):
                    raise RequestTimeoutError(f"shard-{c.shard} did not answer {c.method} "
                                              f"within {c.timeout_s:.1f} s")
                steps.mark("client.reply_arrived")
                ok, value = read_reply(c.conn)
                steps.mark("client.reply_decoded")
                break
            except RayMQError:  # a RequestTimeoutError is a TimeoutError (an OSError) too:
                c.conn.close()  # its late reply must not be read as the next call's
                raise
            except (EOFError, OSError) as err:
                self._replace(c, err)
                self._send(c)
            except BaseException:  # a timeout too: its late reply must not be read as the next's
                c.conn.close()
                raise
        self._checkin(c.shard, c.conn)
        if ok:
            return value
        raise value

    def submit(self, shard: int, method: str, args: tuple, *, timeout_s: float) -> Outcome:
        """Start a call in an I/O thread; the outcome completes with its result or error."""
        out = Outcome()
        try:
            self._io.submit(out.settle,
                            lambda: self.call(shard, method, *args, timeout_s=timeout_s))
        except RuntimeError as err:  # the transport was closed
            out.set_exception(RayMQError(f"client closed: {err}"))
        return out

    # ------------------------------------------------------- connections
    def _checkout(self, shard: int, timeout_s: float) -> tuple[Link, bool]:
        """A connection to the shard, and whether it was pooled (may have gone stale)."""
        with self._lock:
            if self._closed:
                raise RayMQError("client closed")
            idle = self._idle.get(shard)
            if idle:
                return idle.pop(), True
            endpoint = self._endpoints.get(shard)
        if endpoint is None:
            if not rpc.connected():  # e.g. a call still in flight after ray.shutdown()
                raise BrokerUnavailableError(f"shard-{shard}: not connected to Ray")
            address, key = rpc.call(self._handle(shard).endpoint, timeout_s=timeout_s)
            endpoint = (tuple(address), key)
            with self._lock:
                self._endpoints[shard] = endpoint
        try:
            return connect(endpoint[0], endpoint[1], timeout_s, tls=self._tls), False
        except EOFError as err:  # it closed the connection in the handshake: at a limit
            raise _ChannelRefused(f"shard-{shard} endpoint {endpoint[0]}: {err}") from None
        except (OSError, AuthenticationError) as err:  # gone, or its port reused
            self._forget(shard)
            raise BrokerUnavailableError(f"shard-{shard} endpoint {endpoint[0]} unreachable: "
                                         f"{type(err).__name__}: {err}") from None
        except ProtocolVersionError:  # not retriable; asked again next time (an upgrade)
            self._forget(shard)
            raise

    #: Idle connections kept per shard (a burst of concurrent calls opens more; the
    #: extras are closed, and their endpoint threads end with them).
    MAX_IDLE_PER_SHARD = 16

    def _checkin(self, shard: int, conn: Link) -> None:
        with self._lock:
            idle = self._idle.setdefault(shard, [])
            if not self._closed and len(idle) < self.MAX_IDLE_PER_SHARD:
                idle.append(conn)
                return
        conn.close()

    def _forget(self, shard: int) -> None:
        """The shard's endpoint broke: ask its actor again next time; drop idle connections."""
        with self._lock:
            self._endpoints.pop(shard, None)
            idle = self._idle.pop(shard, [])
        for c in idle:
            c.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        self._io.shutdown(wait=True)
        for conns in idle.values():
            for c in conns:
                c.close()


class _Call:
    """A call sent over a connection, its answer not yet read (``DirectTransport.begin``)."""

    __slots__ = ("transport", "shard", "method", "request", "timeout_s", "conn", "reused",
                 "error")

    def __init__(self, transport: DirectTransport, shard: int, method: str, request: bytes,
                 timeout_s: float):
        self.transport, self.shard, self.method = transport, shard, method
        self.request, self.timeout_s = request, timeout_s
        self.conn: Link | None = None
        self.reused = False
        self.error: BaseException | None = None

    def result(self) -> Any:
        return self.transport._receive(self)

    def abandon(self) -> None:
        """Its answer is not wanted: the connection is closed, never to be read again."""
        if self.conn is not None:
            self.conn.close()


_PLAIN_WHY = "each shard's data channel, plain TCP: Ray's TLS is off (RAY_USE_TLS not 1)"
_TLS_WHY = "each shard's data channel over TLS with Ray's certificates (RAY_USE_TLS is on)"


class FailoverTransport:
    """A transport to shards as groups of replicas (of one, unreplicated): a call answered
    ``NotLeaderError``, or whose shard is gone, asks the controller for the leader again
    (``forget``) and is sent again -- the same request (every call on this path is
    idempotent: a producer's sequence keeps a resent write stored once) -- until
    ``FAILOVER_S`` have passed.  A call that timed out is sent again only when the
    controller names another leader by then (``shard_handle``: the leader now); else its
    ``RequestTimeoutError`` is the caller's, at the caller's time-out.  Everything else is
    the inner transport's."""

    #: How long a call follows leader changes before it fails with the last error.
    FAILOVER_S = 20.0

    def __init__(self, inner, forget: Callable[[int], None],
                 shard_handle: Callable[[int], Any] | None = None):
        self.inner, self._forget_leader, self._handle = inner, forget, shard_handle
        self.name, self.why = inner.name, inner.why  # (every transport follows leaders)

    def call(self, shard: int, method: str, *args, timeout_s: float) -> Any:
        return self.begin(shard, method, args, timeout_s=timeout_s).result()

    def begin(self, shard: int, method: str, args: tuple, *, timeout_s: float):
        return _FailoverCall(self, shard, method, args, timeout_s)

    def submit(self, shard: int, method: str, args: tuple, *, timeout_s: float) -> Outcome:
        """The inner transport's submit; one that must follow a leader change goes on in
        a thread of its own (rare: once per failover and caller)."""
        out = Outcome()
        first = self.inner.submit(shard, method, args, timeout_s=timeout_s)

        def done(f: Outcome) -> None:
            if not isinstance(f._error, _REROUTE) or not self.moved(shard, f._error):
                out.settle(f.result)
                return
            threading.Thread(target=out.settle, daemon=True, name="raymq-failover", args=(
                lambda: self.call(shard, method, *args, timeout_s=timeout_s),)).start()
        first.add_done_callback(done)
        return out

    def moved(self, shard: int, err: BaseException) -> bool:
        """After ``err``: whether shard ``shard``'s call should go again (to the leader
        the controller names now)."""
        if not isinstance(err, RequestTimeoutError) or self._handle is None:
            self.rerouted(shard)
            return True
        before = _actor_id(self._handle(shard))
        self.rerouted(shard)
        try:
            return _actor_id(self._handle(shard)) != before
        except _REROUTE:
            return True

    def rerouted(self, shard: int) -> None:
        self._forget_leader(shard)
        forget = getattr(self.inner, "_forget", None)
        if forget is not None:
            forget(shard)

    def close(self) -> None:
        self.inner.close()


_REROUTE = (NotLeaderError, BrokerUnavailableError, RequestTimeoutError)


def _actor_id(handle: Any) -> Any:
    return getattr(handle, "_actor_id", handle)


class _FailoverCall:
    __slots__ = ("t", "shard", "method", "args", "timeout_s", "call", "deadline")

    def __init__(self, t: FailoverTransport, shard: int, method: str, args: tuple,
                 timeout_s: float):
        self.t, self.shard, self.method, self.args, self.timeout_s = t, shard, method, args, \
            timeout_s
        self.deadline = time.monotonic() + max(timeout_s, t.FAILOVER_S)
        self.call = self._begin()

    def _begin(self):
        try:
            return self.t.inner.begin(self.shard, self.method, self.args,
                                      timeout_s=self.timeout_s)
        except _REROUTE as err:
            return _Failed(err)

    def result(self) -> Any:
        pause = 0.05
        while True:
            try:
                return self.call.result()
            except _REROUTE as err:
                if time.monotonic() + pause >= self.deadline or not self.t.moved(self.shard,
                                                                                 err):
                    raise
                log.debug("shard-%d %s: %s; asking for the leader again", self.shard,
                          self.method, err)
                time.sleep(pause)  # (back-off while the controller elects)
                pause = min(pause * 2, 0.5)
                self.call = self._begin()

    def abandon(self) -> None:
        abandon = getattr(self.call, "abandon", None)
        if abandon is not None:
            abandon()


class _Failed:
    __slots__ = ("err",)

    def __init__(self, err: BaseException):
        self.err = err

    def result(self):
        raise self.err


def make_transport(kind: str, shard_handle: Callable[[int], Any],
                   forget: Callable[[int], None] | None = None):
    """The transport of ``kind``; ``"direct"`` falls back to ``"ray"`` (logged, and said
    in its ``why``) when Ray's TLS is on but its certificates cannot be loaded here.
    With ``forget`` (replicated shards: drop shard i's cached leader) calls follow leader
    changes (``FailoverTransport``)."""
    inner = _make_transport(kind, shard_handle)
    return inner if forget is None else FailoverTransport(inner, forget, shard_handle)


def _make_transport(kind: str, shard_handle: Callable[[int], Any]):
    if kind == "direct":
        if not ray_tls_enabled():
            return DirectTransport(shard_handle, tls=None)
        try:
            return DirectTransport(shard_handle, tls=tls_context(server_side=False))
        except ChannelTLSError as err:
            log.warning("transport 'direct' falls back to 'ray': %s", err)
            return RayTransport(shard_handle, why=f"fallback from 'direct': {err}")
    if kind == "ray":
        return RayTransport(shard_handle)
    raise ValueError(f"transport must be one of {TRANSPORTS}, not {kind!r}")
