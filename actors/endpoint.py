"""A shard's direct data channel: the hot calls without a Ray call each.

A Ray actor call costs ~1 ms and ~2 ms of CPU on this kind of machine, which
caps a shard at a few hundred requests per second however small they are.
The hot, batched calls of the data path (``send``, ``end_transactions``,
``pull``, ``commit_offsets``, ``get_offsets``) are therefore also served on a
socket the shard opens next to its actor: a request is one length-prefixed
pickle ``(method, args)``, the reply one pickle ``(ok, value)``; a round trip
costs ~0.1 ms.  Everything else (lifecycle, placement, restarts, admin,
discovery of this endpoint) stays with Ray.

Trust: the same as Ray's.  Every connection must pass the ``multiprocessing``
HMAC challenge with the endpoint's random key, and the key is handed out only
through the shard's Ray actor (``ShardActor.endpoint``), i.e. to processes
that can already call the actor.  Only the listed methods can be called.

No Ray import: the shard's tests run it in-process.
"""
from __future__ import annotations

import logging
import os
import pickle
import socket
import struct
import threading
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

log = logging.getLogger("raymq.endpoint")

#: The shard methods callable on the channel (all idempotent or reads, see ``raymq.actors.shard``).
DATA_METHODS = frozenset({"send", "end_transactions", "pull", "commit_offsets", "get_offsets"})


def tune(sock: socket.socket) -> None:
    """Requests are latency-bound: never let Nagle hold back the second write of a frame."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def receive_timeout(sock: socket.socket, seconds: float) -> None:
    """A kernel receive timeout (0: none) that holds for every user of the descriptor."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                    struct.pack("ll", whole, int((seconds - whole) * 1_000_000)))


def encode_reply(ok: bool, value: Any) -> bytes:
    try:
        return pickle.dumps((ok, value), protocol=5)
    except Exception as err:  # an unpicklable error: send what it says
        return pickle.dumps((False, RuntimeError(f"{type(value).__name__}: {value} "
                                                 f"(not picklable: {err})")), protocol=5)


class Endpoint:
    """Serve ``target``'s ``methods`` on a TCP socket, one thread per connection.

    A connection idle for ``IDLE_TIMEOUT_S`` is closed (its thread ends): a client that
    died without closing does not hold a thread for ever, and a live one reconnects.
    """

    IDLE_TIMEOUT_S = 300.0

    def __init__(self, target: object, *, host: str = "127.0.0.1",
                 methods: frozenset[str] = DATA_METHODS, authkey: bytes | None = None):
        self._handlers = {m: getattr(target, m) for m in methods  # resolved once
                          if hasattr(target, m)}
        self.authkey = authkey or os.urandom(32)
        self._sock = socket.create_server((host, 0), backlog=128)
        self.address = (host, self._sock.getsockname()[1])
        self._closed = threading.Event()
        self._conns: dict[Connection, socket.socket] = {}
        self._lock = threading.Lock()
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name="raymq-endpoint-accept")
        self._acceptor.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _peer = self._sock.accept()
            except OSError:
                if self._closed.is_set():
                    return
                log.exception("endpoint %s: accept failed", self.address)
                continue
            threading.Thread(target=self._serve, args=(sock,), daemon=True,
                             name="raymq-endpoint-conn").start()

    def _serve(self, sock: socket.socket) -> None:
        tune(sock)
        # a silent peer must not hold a thread in the handshake (a kernel timeout: the
        # Connection below uses the descriptor directly, so sock.settimeout would not reach it)
        receive_timeout(sock, 10.0)
        conn = Connection(os.dup(sock.fileno()))
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
            receive_timeout(sock, self.IDLE_TIMEOUT_S)  # between requests
        except Exception as err:  # wrong key, garbage, or a peer that went away
            log.warning("endpoint %s: connection refused: %s", self.address, err)
            conn.close()
            sock.close()
            return
        with self._lock:
            if self._closed.is_set():
                conn.close()
                sock.close()
                return
            self._conns[conn] = sock
        try:
            while True:
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    return  # the client closed (or the endpoint is closing)
                conn.send_bytes(self._dispatch(data))
        except OSError as err:  # the client went away before its reply
            log.info("endpoint %s: client gone: %s", self.address, err)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()
            sock.close()

    def _dispatch(self, data: bytes) -> bytes:
        try:
            method, args = pickle.loads(data)
            handler = self._handlers.get(method)
            if handler is None:
                raise PermissionError(f"{method!r} is not callable on the data channel")
            return encode_reply(True, handler(*args))
        except Exception as err:  # the caller gets the error, the connection lives on
            return encode_reply(False, err)

    def close(self) -> None:
        """Stop accepting and drop every connection (their clients see the shard gone)."""
        self._closed.set()
        with self._lock:
            socks = [self._sock, *self._conns.values()]
        for s in socks:  # shutdown wakes the threads blocked on these sockets
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._acceptor.join(timeout=5)
        self._sock.close()
