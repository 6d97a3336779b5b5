"""A shard's direct data channel, both ends: the wire format (framing, versioned handshake,
method allow-list), the server (``Endpoint``) and the client connection (``connect``).

A Ray actor call costs ~1 ms and ~2 ms of CPU on this kind of machine, which
caps a shard at a few hundred requests per second however small they are.
The hot, batched calls of the data path (``send``, ``end_transactions``,
``pull``, ``commit_offsets``, ``get_offsets``) are therefore also served on a
socket the shard opens next to its actor; a round trip costs ~0.1 ms.
Everything else (lifecycle, placement, restarts, admin, discovery of this
endpoint) stays with Ray.  Which of the two the SDK uses is ``raymq.transport``'s
choice; pooling and retries are the SDK's too.

Wire format, after the handshake: a request is one length-prefixed
(``multiprocessing.connection``) pickle ``(method, args)``, the reply one
pickle ``(ok, value)`` (``value`` the result, or the error raised).

Handshake, once per connection:

1. the endpoint challenges the client with its random key, then the client
   the endpoint (``multiprocessing``'s mutual HMAC challenge);
2. the client sends ``HELLO`` (magic ``RMQC``, its ``PROTOCOL_VERSION``); the
   endpoint answers ``HELLO`` with its own version.  Different versions: the
   client raises ``ProtocolVersionError`` naming both (not retriable), and the
   endpoint closes the connection.  A client from before versions sends a
   request instead of ``HELLO``: it gets the same words as the reply, in a
   ``RayMQError`` (a class it knows).  ``HELLO``'s own format never changes.

Trust: the same as Ray's.  The key is handed out only through the shard's Ray
actor (``ShardActor.endpoint``), i.e. to processes that can already call the
actor.  Only the methods of ``DATA_METHODS`` can be called.

No Ray import: the shard's tests run it in-process.
"""
from __future__ import annotations

import logging
import os
import pickle
import select
import socket
import struct
import threading
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from raymq.storage.errors import RayMQError

log = logging.getLogger("raymq.channel")

#: Version of the wire format above; raise it with any change to the framing, the
#: handshake or the meaning of a data method's arguments or result.
PROTOCOL_VERSION = 1

#: The shard methods callable on the channel (all idempotent or reads, see ``raymq.actors.shard``).
DATA_METHODS = frozenset({"send", "end_transactions", "pull", "commit_offsets", "get_offsets"})

_HELLO = struct.Struct(">4sH")  # magic, protocol version
_HELLO_MAGIC = b"RMQC"

#: The handshake may take this long at most, on either side.
HANDSHAKE_TIMEOUT_S = 10.0


class ProtocolVersionError(RayMQError):
    """The two ends of a data channel speak different protocol versions (different
    RayMQ releases); retrying does not help, upgrading the older side does."""

    code = "PROTOCOL_VERSION_MISMATCH"
    retriable = False


# ------------------------------------------------------------------ framing
def encode_request(method: str, args: tuple) -> bytes:
    return pickle.dumps((method, args), protocol=5)


#: ``(ok, value)`` of a reply frame.
decode_reply = pickle.loads


def encode_reply(ok: bool, value: Any) -> bytes:
    try:
        return pickle.dumps((ok, value), protocol=5)
    except Exception as err:  # an unpicklable error: send what it says
        return pickle.dumps((False, RuntimeError(f"{type(value).__name__}: {value} "
                                                 f"(not picklable: {err})")), protocol=5)


def _hello(version: int) -> bytes:
    return _HELLO.pack(_HELLO_MAGIC, version)


def _hello_version(frame: bytes) -> int | None:
    """The version a ``HELLO`` frame carries; None when the frame is not a ``HELLO``."""
    if len(frame) != _HELLO.size:
        return None
    magic, version = _HELLO.unpack(frame)
    return version if magic == _HELLO_MAGIC else None


def _mismatch(client: int | None, endpoint: int | None, address) -> ProtocolVersionError:
    def name(v):
        return f"version {v}" if v is not None else "no version (a release before versions)"
    return ProtocolVersionError(
        f"data channel protocol mismatch with endpoint {address[0]}:{address[1]}: this client "
        f"speaks {name(client)}, the endpoint {name(endpoint)}; run the same RayMQ release "
        f"on both sides")


# ------------------------------------------------------------------ sockets
def tune(sock: socket.socket) -> None:
    """Requests are latency-bound: never let Nagle hold back the second write of a frame."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def receive_timeout(sock: socket.socket, seconds: float) -> None:
    """A kernel receive timeout (0: none) that holds for every user of the descriptor."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                    struct.pack("ll", whole, int((seconds - whole) * 1_000_000)))


def readable(conn: Connection, timeout_s: float) -> bool:
    """Whether the connection has data within ``timeout_s`` (``Connection.poll`` builds a
    selector each time: ~10x dearer)."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return bool(poller.poll(max(0.0, timeout_s) * 1000))


# ------------------------------------------------------------------ client
def connect(address: tuple[str, int], authkey: bytes, timeout_s: float, *,
            version: int | None = None) -> Connection:
    """A connection to an endpoint, past the handshake: ready for request frames.

    Raises ``AuthenticationError`` (wrong key), ``OSError``/``EOFError`` (no endpoint
    there, or it went away), ``ProtocolVersionError`` (another release's endpoint).
    ``version`` (default ``PROTOCOL_VERSION``) is the one this client claims.
    """
    version = PROTOCOL_VERSION if version is None else version
    limit = min(timeout_s, HANDSHAKE_TIMEOUT_S)
    with socket.create_connection(address, timeout=limit) as sock:
        tune(sock)
        sock.settimeout(None)  # blocking: the Connection polls for its own timeouts
        receive_timeout(sock, limit)  # ... but a silent endpoint must not hang the handshake
        conn = Connection(os.dup(sock.fileno()))
        try:
            answer_challenge(conn, authkey)
            deliver_challenge(conn, authkey)
            conn.send_bytes(_hello(version))
            theirs = _hello_version(conn.recv_bytes())  # a pre-version endpoint: its error
            if theirs != version:
                raise _mismatch(version, theirs, address)
            receive_timeout(sock, 0)
        except BaseException:
            conn.close()
            raise
    return conn


# ------------------------------------------------------------------ server
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
        #: the version this endpoint speaks (a test may make it another release's)
        self.protocol_version = PROTOCOL_VERSION
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

    def _handshake(self, conn: Connection) -> bool:
        """The server's half of the handshake; False (after telling the client, when it
        can understand) if the client speaks another protocol version."""
        deliver_challenge(conn, self.authkey)
        answer_challenge(conn, self.authkey)
        frame = conn.recv_bytes()
        theirs = _hello_version(frame)
        if theirs is None:  # a request: a client from before versions, waiting for a reply
            said = _mismatch(None, self.protocol_version, self.address)
            conn.send_bytes(encode_reply(False, RayMQError(str(said))))
        else:
            conn.send_bytes(_hello(self.protocol_version))
        if theirs != self.protocol_version:
            log.warning("endpoint %s: refused a client of protocol version %s (this endpoint "
                        "speaks %d)", self.address, theirs, self.protocol_version)
            return False
        return True

    def _serve(self, sock: socket.socket) -> None:
        tune(sock)
        # a silent peer must not hold a thread in the handshake (a kernel timeout: the
        # Connection below uses the descriptor directly, so sock.settimeout would not reach it)
        receive_timeout(sock, HANDSHAKE_TIMEOUT_S)
        conn = Connection(os.dup(sock.fileno()))
        try:
            accepted = self._handshake(conn)
            receive_timeout(sock, self.IDLE_TIMEOUT_S)  # between requests
        except Exception as err:  # wrong key, garbage, or a peer that went away
            log.warning("endpoint %s: connection refused: %s", self.address, err)
            accepted = False
        if not accepted:
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
