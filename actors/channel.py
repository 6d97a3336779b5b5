"""A shard's direct data channel, both ends: the wire format (framing, versioned handshake,
method allow-list, what a request may contain), the limits a peer is held to, TLS with Ray's
certificates, the server (``Endpoint``) and the client connection (``connect``).

A Ray actor call costs ~1 ms and ~2 ms of CPU on this kind of machine, which
caps a shard at a few hundred requests per second however small they are.
The hot, batched calls of the data path (``send``, ``end_transactions``,
``pull``, ``commit_offsets``, ``get_offsets``) are therefore also served on a
socket the shard opens next to its actor; a round trip costs ~0.1 ms.
Everything else (lifecycle, placement, restarts, admin, discovery of this
endpoint) stays with Ray.  Which of the two the SDK uses is ``raymq.transport``'s
choice; pooling and retries are the SDK's too.

Wire format, after the handshake: a request is one length-prefixed frame (the
framing of ``multiprocessing.connection``) holding the pickle ``(method, args)``,
the reply one pickle ``(ok, value)`` (``value`` the result, or the error raised); a
reply whose value offers large pickle-5 buffers (a pull's undecoded records) is the pickle
after ``RMQB`` and their count, then each buffer as a frame (``encode_reply``).
A request is decoded by a restricted unpickler that builds only the classes of
``REQUEST_GLOBALS`` (a ``RecordBatch`` and an ``EndRequest``; tuples, lists,
dicts, sets, str, bytes, numbers need none): a pickle naming anything else (say
``os.system``) is refused before anything runs.  Replies are plain pickles (the
client trusts the shard).

Handshake, once per connection, all of it within ``handshake_timeout_ms``:

0. with Ray's TLS on (``RAY_USE_TLS``), a TLS handshake with Ray's certificates
   (``tls_context``): each end presents Ray's certificate and checks the other's
   against Ray's CA, as Ray's own gRPC does;
1. the endpoint challenges the client with its random key, then the client
   the endpoint (``multiprocessing``'s mutual HMAC challenge);
2. the client sends ``HELLO`` (magic ``RMQC``, its ``PROTOCOL_VERSION``); the
   endpoint answers ``HELLO`` with its own version.  Different versions: the
   client raises ``ProtocolVersionError`` naming both (not retriable), and the
   endpoint closes the connection.  A client from before versions sends a
   request instead of ``HELLO``: it gets the same words as the reply, in a
   ``RayMQError`` (a class it knows).  ``HELLO``'s own format never changes;
3. same version: the endpoint sends ``LIMITS`` (its largest request frame, in
   bytes); the SDK sends a larger request through Ray instead.

Limits (``ChannelLimits``, from the ``channel_*`` settings of ``ClusterConfig``):
connections in total and per peer address, descriptors kept free for the store,
one deadline for the whole handshake, an idle timeout, the request frame size,
and a pull's messages and wait (clamped).  A refusal after the handshake is a
``ChannelRefusedError`` reply of one line; before it, the connection is closed
(and logged, at most one line per ``_LOG_EVERY_S`` and kind).

Trust: the same as Ray's.  The key is handed out only through the shard's Ray
actor (``ShardActor.endpoint``), i.e. to processes that can already call the
actor.  A holder of the key can call the methods of ``DATA_METHODS`` only.

No Ray import: the shard's tests run it in-process.
"""
from __future__ import annotations

import dataclasses
import importlib
import io
import logging
import os
import pickle
import resource
import select
import socket
import ssl
import struct
import threading
import time
from multiprocessing.connection import answer_challenge, deliver_challenge
from typing import Any

from raymq.storage import steps
from raymq.storage.buffers import fresh_buffer
from raymq.storage.errors import (ChannelRefusedError, ChannelTLSError, ProtocolVersionError,
                                  RayMQError)

log = logging.getLogger("raymq.channel")

#: Version of the wire format above; raise it with any change to the framing, the
#: handshake or the meaning of a data method's arguments or result.
#: 2: TLS with Ray's TLS; the LIMITS frame; requests decoded with an allow-list.
#: 3: large reply buffers out of band (``RMQB`` replies).
PROTOCOL_VERSION = 3

#: The shard methods callable on the channel (all idempotent or reads, see ``raymq.actors.shard``).
DATA_METHODS = frozenset({"send", "end_transactions", "pull", "commit_offsets", "get_offsets",
                          "delete_offsets", "queue_bounds", "ktx_send", "ktx_offsets",
                          "ktx_register", "ktx_verify", "ktx_end", "ktx_commit_batch",
                          "ktx_epoch", "producer_sequences"})

#: The only globals a request pickle may name: what ``RecordBatch`` and ``EndRequest``
#: reduce to (what the SDK's requests held in a traced run of the Ray tests; numbers
#: cross as Python ints, never numpy).  Adding one changes the wire format.
REQUEST_GLOBALS = frozenset({("raymq.storage.records", "_rebuild_batch"),
                             ("raymq.actors.protocol", "EndRequest")})

_HELLO = struct.Struct(">4sH")  # magic, protocol version
_HELLO_MAGIC = b"RMQC"
_LIMITS = struct.Struct(">4sQ")  # magic, largest request frame (bytes)
_LIMITS_MAGIC = b"RMQL"

#: A client's handshake may take this long at most (its own timeout may be shorter).
HANDSHAKE_TIMEOUT_S = 10.0

#: ``tls=TLS_FROM_RAY``: TLS exactly when Ray's is on (``tls_context``).
TLS_FROM_RAY = "ray"
_TLS_FILES = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")

_TICK_S = 0.2        # the accept loop's longest wait: how late a handshake deadline is seen
_LOG_EVERY_S = 10.0  # at most one log line per kind of refusal or accept failure this often


@dataclasses.dataclass(frozen=True)
class ChannelLimits:
    """What one endpoint allows its peers; each field is the ``ClusterConfig`` setting
    ``channel_<field>`` (documented there, with the same default)."""

    max_connections: int = 1024
    max_connections_per_peer: int = 256
    max_handshakes: int = 128
    max_handshakes_per_peer: int = 16
    handshake_timeout_ms: int = 10_000
    idle_timeout_ms: int = 300_000
    reserve_fds: int = 64
    max_request_bytes: int = 64 * 1024 * 1024
    pull_max_messages: int = 100_000
    pull_max_wait_ms: int = 30_000

    @classmethod
    def from_config(cls, config) -> "ChannelLimits":
        """The limits a ``ClusterConfig`` sets."""
        return cls(**{f.name: getattr(config, "channel_" + f.name)
                      for f in dataclasses.fields(cls)})


# ------------------------------------------------------------------ framing
def encode_request(method: str, args: tuple) -> bytes:
    return pickle.dumps((method, args), protocol=5)


class _RequestUnpickler(pickle.Unpickler):
    """Builds the globals of ``REQUEST_GLOBALS`` and nothing else."""

    _allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[module, name]
        except (KeyError, TypeError):
            raise ChannelRefusedError(
                f"request refused: it names {module}.{name}, which a data channel request may "
                f"not build (only {', '.join(sorted(m + '.' + n for m, n in REQUEST_GLOBALS))})"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise ChannelRefusedError("request refused: it holds a persistent id")


_RequestUnpickler._allowed = {(m, n): getattr(importlib.import_module(m), n)
                              for m, n in REQUEST_GLOBALS}


def decode_request(data) -> tuple[str, tuple]:
    """``(method, args)`` of a request frame, built with ``REQUEST_GLOBALS`` only;
    ``ChannelRefusedError`` for anything else."""
    try:
        request = _RequestUnpickler(io.BytesIO(data)).load()
    except ChannelRefusedError:
        raise
    except Exception as err:  # (a truncated or garbled pickle)
        raise ChannelRefusedError(f"request refused: not a pickle: {type(err).__name__}: "
                                  f"{err}") from None
    if type(request) is not tuple or len(request) != 2 or type(request[0]) is not str \
            or type(request[1]) not in (tuple, list):
        raise ChannelRefusedError(f"request refused: not a (method, args) pair but "
                                  f"{type(request).__name__}")
    return request


#: A reply whose large buffers follow it out of band starts with this and their count.
_BUFFERS = struct.Struct("!4sI")
_BUFFERS_MAGIC = b"RMQB"
#: From this size a buffer pickle 5 offers (a pull's ``RecordSpans``) is sent out of band.
OUT_OF_BAND_FROM = 1 << 20


def encode_reply(ok: bool, value: Any) -> list:
    """The frames of a reply: the pickle ``(ok, value)``, alone; or, when the value offers
    pickle 5 buffers of ``OUT_OF_BAND_FROM`` bytes or more, the pickle after ``RMQB`` and
    their count, then each buffer as a frame of its own (written from where it lies, read
    into the buffer the client keeps: no copy into or out of the pickle)."""
    buffers: list = []

    def out_of_band(buf: pickle.PickleBuffer):
        if buf.raw().nbytes < OUT_OF_BAND_FROM:
            return True  # (in band)
        buffers.append(buf.raw())
        return False
    try:
        data = pickle.dumps((ok, value), protocol=5, buffer_callback=out_of_band)
    except Exception as err:  # an unpicklable error: send what it says
        return [pickle.dumps((False, RuntimeError(f"{type(value).__name__}: {value} "
                                                  f"(not picklable: {err})")), protocol=5)]
    if not buffers:
        return [data]
    return [_BUFFERS.pack(_BUFFERS_MAGIC, len(buffers)) + data, *buffers]


def read_reply(link: "Link") -> tuple:
    """``(ok, value)`` of the next reply on a client's link (the client trusts the shard:
    a plain pickle, and its out-of-band buffers)."""
    data = link.recv_bytes()
    if data[:4] != _BUFFERS_MAGIC:
        return pickle.loads(data)
    count = _BUFFERS.unpack_from(data)[1]
    buffers = [link.recv_bytes() for _ in range(count)]
    return pickle.loads(memoryview(data)[_BUFFERS.size:], buffers=buffers)


def _hello(version: int) -> bytes:
    return _HELLO.pack(_HELLO_MAGIC, version)


def _hello_version(frame: bytes) -> int | None:
    """The version a ``HELLO`` frame carries; None when the frame is not a ``HELLO``."""
    if len(frame) != _HELLO.size:
        return None
    magic, version = _HELLO.unpack(frame)
    return version if magic == _HELLO_MAGIC else None


def _limits_frame(max_request_bytes: int) -> bytes:
    return _LIMITS.pack(_LIMITS_MAGIC, max_request_bytes)


def _limits_of(frame: bytes) -> int:
    if len(frame) != _LIMITS.size or frame[:4] != _LIMITS_MAGIC:
        raise ProtocolVersionError(f"data channel protocol error: expected LIMITS after "
                                   f"HELLO, got {bytes(frame[:16])!r}")
    return _LIMITS.unpack(frame)[1]


def _mismatch(client: int | None, endpoint: int | None, address) -> ProtocolVersionError:
    def name(v):
        return f"version {v}" if v is not None else "no version (a release before versions)"
    return ProtocolVersionError(
        f"data channel protocol mismatch with endpoint {address[0]}:{address[1]}: this client "
        f"speaks {name(client)}, the endpoint {name(endpoint)}; run the same RayMQ release "
        f"on both sides")


# ------------------------------------------------------------------ connections
_HEADER = struct.Struct("!i")
_HEADER_LONG = struct.Struct("!Q")
_SMALL = 16384  # up to this, header and payload go in one write (and are read in one)
_GROW_FROM = 1 << 20  # a larger frame's buffer starts at this and doubles as data comes


class FrameTooLarge(OSError):
    """A frame's header announced more bytes than the reader takes (nothing more was read)."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"a frame of {size} bytes, more than the {limit} taken")
        self.size, self.limit = size, limit


class Link:
    """One connection of the channel, plain or TLS: frames over a socket.

    The frames are ``multiprocessing.connection``'s (a 4-byte signed big-endian
    length, or -1 and an 8-byte length), so a client of an older release still
    reads its version error.  ``recv_bytes(maxlength)`` refuses a longer frame
    from its header alone (``FrameTooLarge``).  One descriptor per connection.
    """

    __slots__ = ("sock", "tls", "max_request_bytes", "trusted")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        #: the endpoint's largest request frame (a client's link, after the handshake)
        self.max_request_bytes: int | None = None
        #: the peer is an authenticated shard (a client's link, after the handshake): a
        #: large frame's buffer is allocated whole at once, not grown as data comes
        self.trusted = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send_bytes(self, data) -> None:
        n = len(data)
        if n <= _SMALL:  # one write: Nagle never holds back a second one
            self.sock.sendall(_HEADER.pack(n) + data)
        elif n <= 0x7FFFFFFF:
            self.sock.sendall(_HEADER.pack(n))
            self.sock.sendall(data)
        else:
            self.sock.sendall(_HEADER.pack(-1) + _HEADER_LONG.pack(n))
            self.sock.sendall(data)

    def send_frames(self, frames: list) -> None:
        for data in frames:
            self.send_bytes(data)

    def recv_bytes(self, maxlength: int | None = None):
        size = _HEADER.unpack(self._exactly(4, first=True))[0]
        if size == -1:
            size = _HEADER_LONG.unpack(self._exactly(8))[0]
        elif size < 0:
            raise OSError(f"bad frame length {size}")
        if maxlength is not None and size > maxlength:
            raise FrameTooLarge(size, maxlength)
        return self._exactly(size)

    def _exactly(self, n: int, *, first: bool = False):
        """``n`` bytes (bytes; a bytearray, or an mmap, when they came in pieces).  Past
        ``_GROW_FROM`` the buffer grows with what arrives: an announced size costs no
        memory until it is sent."""
        if n <= _SMALL:  # most frames: one read
            chunk = self.sock.recv(n)
            if len(chunk) == n:
                return chunk
            if not chunk:
                raise EOFError if first else OSError("got end of file during message")
            got, buf = len(chunk), bytearray(chunk)
        elif self.trusted:  # (in huge pages when large)
            got, buf = 0, fresh_buffer(n)
        else:
            got, buf = 0, bytearray(min(n, _GROW_FROM))
        while got < n:
            if got == len(buf):  # full: double it (up to n)
                buf.extend(bytes(min(max(len(buf), _GROW_FROM), n - len(buf))))
            with memoryview(buf) as view:
                k = self.sock.recv_into(view[got:])
            if not k:
                raise OSError("got end of file during message")
            got += k
        return buf

    def pending(self) -> int:
        """Bytes already decrypted and waiting (TLS): ``poll`` does not see them."""
        return self.sock.pending() if self.tls else 0

    def close(self) -> None:
        self.sock.close()


def tune(sock: socket.socket) -> None:
    """Requests are latency-bound: never let Nagle hold back the second write of a frame."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel receive and send timeouts (0: none) of a blocking socket: a read or write
    waiting longer fails (``BlockingIOError``) at no cost per call."""
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def readable(link: Link, timeout_s: float) -> bool:
    """Whether the link has data within ``timeout_s`` (``Connection.poll`` builds a
    selector each time: ~10x dearer)."""
    if link.tls and link.pending():
        return True
    poller = select.poll()
    poller.register(link.fileno(), select.POLLIN)
    return bool(poller.poll(max(0.0, timeout_s) * 1000))


# ------------------------------------------------------------------ TLS
def ray_tls_enabled() -> bool:
    """Whether Ray runs with TLS here (``RAY_USE_TLS``, read as Ray reads it)."""
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


def tls_context(*, server_side: bool) -> ssl.SSLContext | None:
    """The channel's TLS when Ray's is on, else None: Ray's certificate and key
    (``RAY_TLS_SERVER_CERT``, ``RAY_TLS_SERVER_KEY``) presented by both ends, the peer's
    checked against Ray's CA (``RAY_TLS_CA_CERT``), TLS 1.2 at least.  Host names are
    not checked: any holder of a certificate of Ray's CA is a member of the cluster (as
    for Ray), and Ray's certificates need not name the addresses endpoints listen on.

    Raises ``ChannelTLSError`` when TLS is on but the files cannot be loaded.
    """
    if not ray_tls_enabled():
        return None
    missing = [v for v in _TLS_FILES if not os.environ.get(v)]
    if missing:
        raise ChannelTLSError(f"RAY_USE_TLS is on but {', '.join(missing)} is not set")
    cert, key, ca = (os.environ[v] for v in _TLS_FILES)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as err:
        raise ChannelTLSError(f"RAY_USE_TLS is on but Ray's certificates cannot be loaded "
                              f"(RAY_TLS_SERVER_CERT={cert}, RAY_TLS_SERVER_KEY={key}, "
                              f"RAY_TLS_CA_CERT={ca}): {type(err).__name__}: {err}") from None
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


# ------------------------------------------------------------------ client
def connect(address: tuple[str, int], authkey: bytes, timeout_s: float, *,
            version: int | None = None, tls: ssl.SSLContext | None | str = TLS_FROM_RAY,
            source: str | None = None) -> Link:
    """A connection to an endpoint, past the handshake: ready for request frames.

    Raises ``AuthenticationError`` (wrong key), ``OSError``/``EOFError`` (no endpoint
    there, it went away, or it refused the connection: at a limit, see its log),
    ``ProtocolVersionError`` (another release's endpoint).  ``version`` (default
    ``PROTOCOL_VERSION``) is the one this client claims; ``tls`` a client context
    (default: ``tls_context``, i.e. TLS exactly when Ray's TLS is on here); ``source``
    the local address to connect from (default: the system's choice).
    """
    version = PROTOCOL_VERSION if version is None else version
    if isinstance(tls, str):
        tls = tls_context(server_side=False)
    sock = socket.create_connection(address, timeout=min(timeout_s, HANDSHAKE_TIMEOUT_S),
                                    source_address=None if source is None else (source, 0))
    try:
        tune(sock)
        if tls is not None:  # (the TLS handshake runs under the same timeout)
            sock = tls.wrap_socket(sock, server_hostname=None)
        link = Link(sock)
        answer_challenge(link, authkey)
        deliver_challenge(link, authkey)
        link.send_bytes(_hello(version))
        theirs = _hello_version(link.recv_bytes())  # a pre-version endpoint: its error
        if theirs != version:
            raise _mismatch(version, theirs, address)
        link.max_request_bytes = _limits_of(link.recv_bytes(_LIMITS.size))
        link.trusted = True
        sock.settimeout(None)  # blocking: the transport polls for its own timeouts
    except EOFError:
        sock.close()
        raise EOFError(f"endpoint {address[0]}:{address[1]} closed the connection in the "
                       f"handshake (at a connection limit, or going away: see the shard's "
                       f"log)") from None
    except BaseException:
        sock.close()
        raise
    return link


# ------------------------------------------------------------------ server
def descriptors_free() -> int | None:
    """Descriptors this process may still open (None: no limit, or unknown here)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        used = len(os.listdir("/proc/self/fd")) - 1  # (the listing's own)
    except OSError:
        return None
    return soft - used


def _shutdown(fd: int) -> None:
    """Shut a connection down by descriptor (wakes the thread blocked on it, whatever
    wraps it: a plain socket, TLS, in a handshake or not)."""
    s = socket.socket(fileno=fd)
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.detach()


class _Throttle:
    """At most one log line per kind of event every ``_LOG_EVERY_S``; counts the rest."""

    def __init__(self):
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def __call__(self, kind: str) -> int | None:
        """None: stay quiet; else log now, with this many held back since the last line."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -_LOG_EVERY_S) < _LOG_EVERY_S:
                self._held[kind] = self._held.get(kind, 0) + 1
                return None
            self._last[kind] = now
            return self._held.pop(kind, 0)


class _Gate:
    """An endpoint's connections: who may hold one, the handshake deadline of each,
    closing them all.

    Connections in their handshake (not authenticated yet) and served ones have separate
    budgets, each in total and per peer address: peers without the key can fill only
    the handshake budget, never take a served connection's place.  An address that
    authenticated within ``TRUSTED_S`` goes past a full handshake budget (up to twice
    it), so peers with the key get in while keyless ones fill it.
    Descriptors are kept for the store.  A connection is tracked by descriptor from
    ``admit`` until ``leave`` (which its thread calls before it closes the descriptor,
    so a tracked number is never reused).
    """

    #: How long an address that authenticated may go past a full handshake budget (up to
    #: twice it): a peer with the key gets in while keyless ones fill the budget.
    TRUSTED_S = 600.0
    #: Most addresses remembered (the oldest are forgotten first).
    MAX_PEERS_KEPT = 10_000

    def __init__(self, limits: ChannelLimits):
        self.limits = limits
        self._lock = threading.Lock()
        self._peer_of: dict[int, str] = {}        # fd -> peer address (every connection)
        self._served: dict[str, int] = {}         # peer -> served connections
        self._shaking: dict[str, int] = {}        # peer -> connections in their handshake
        self._deadline: dict[int, float] = {}     # fd -> monotonic s (handshakes only)
        self._trusted: dict[str, float] = {}      # peer -> monotonic s it last authenticated
        self._reaped: set[int] = set()            # handshakes shut down, threads not gone
        self._closed = False

    def admit(self, fd: int, peer: str) -> tuple[str, str] | None:
        """Track a new connection, its handshake deadline running; or say why not:
        (the setting that refuses it, why)."""
        lim = self.limits
        free = descriptors_free()
        if free is not None and free < lim.reserve_fds:
            return "channel_reserve_fds", (
                f"only {free} descriptors left before the process limit, "
                f"{lim.reserve_fds} are kept for the store (channel_reserve_fds)")
        now = time.monotonic()
        with self._lock:
            if self._closed:
                return "closing", "the endpoint is closing"
            trusted = now - self._trusted.get(peer, -self.TRUSTED_S) < self.TRUSTED_S
            if len(self._deadline) >= lim.max_handshakes * (2 if trusted else 1):
                return "channel_max_handshakes", (
                    f"{len(self._deadline)} connections in their handshake, the limit "
                    f"(channel_max_handshakes)")
            mine = self._shaking.get(peer, 0)
            if mine >= lim.max_handshakes_per_peer:
                return "channel_max_handshakes_per_peer", (
                    f"{mine} connections from {peer} in their handshake, the limit "
                    f"(channel_max_handshakes_per_peer)")
            self._peer_of[fd] = peer
            self._shaking[peer] = mine + 1
            self._deadline[fd] = now + lim.handshake_timeout_ms / 1000
        return None

    def settle(self, fd: int) -> tuple[str, str] | None:
        """The handshake is done in time: the connection moves to the served budget.  Why
        not (the setting, why) when it came too late (it was shut down), the endpoint is
        closing, or the served connections are at their caps."""
        lim = self.limits
        with self._lock:
            if self._deadline.pop(fd, None) is None or self._closed:
                return "handshake", "too late, or the endpoint is closing"
            peer = self._peer_of[fd]
            _drop(self._shaking, peer)
            served = sum(self._served.values())
            if served >= lim.max_connections:
                why = ("channel_max_connections", f"{served} connections served, the "
                       f"limit (channel_max_connections)")
            elif self._served.get(peer, 0) >= lim.max_connections_per_peer:
                why = ("channel_max_connections_per_peer", f"{self._served[peer]} "
                       f"connections served to {peer}, the limit "
                       f"(channel_max_connections_per_peer)")
            else:
                self._served[peer] = self._served.get(peer, 0) + 1
                _note_peer(self._trusted, peer, self.MAX_PEERS_KEPT)
                return None
            del self._peer_of[fd]  # (counted nowhere now: ``leave`` has nothing to do)
            return why

    def leave(self, fd: int) -> None:
        with self._lock:
            peer = self._peer_of.pop(fd, None)
            shaking = self._deadline.pop(fd, None) is not None or fd in self._reaped
            self._reaped.discard(fd)
            if peer is not None:
                _drop(self._shaking if shaking else self._served, peer)

    def reap(self, now: float) -> int:
        """Shut down the connections whose handshake is past its deadline (their threads
        end and ``leave``); how many."""
        with self._lock:
            late = [fd for fd, t in self._deadline.items() if t <= now]
            for fd in late:
                del self._deadline[fd]
                self._reaped.add(fd)
                _shutdown(fd)
        return len(late)

    def close(self) -> None:
        """Refuse new connections and shut down every connection."""
        with self._lock:
            self._closed = True
            for fd in self._peer_of:
                _shutdown(fd)

    def established(self) -> int:
        """Connections past their handshake."""
        with self._lock:
            return sum(self._served.values())

    def counts(self) -> tuple[int, int]:
        """(connections, of which in their handshake)."""
        with self._lock:
            return len(self._peer_of), len(self._deadline)


def _note_peer(seen: dict[str, float], peer: str, most: int) -> None:
    """Note ``peer`` now in ``seen`` (insertion ordered: the oldest forgotten first)."""
    seen.pop(peer, None)
    seen[peer] = time.monotonic()
    while len(seen) > most:
        del seen[next(iter(seen))]


def _drop(counts: dict[str, int], peer: str) -> None:
    left = counts.get(peer, 0) - 1
    if left > 0:
        counts[peer] = left
    else:
        counts.pop(peer, None)


def _clamped(value: Any, cap: int) -> Any:
    """A number over ``cap`` (or NaN) as ``cap``; anything else as it is (the shard
    judges it)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not value <= cap:
        return cap
    return value


def capped_pull(limits: ChannelLimits, args) -> tuple:
    """A pull's arguments within the channel's caps: each queue's count clamped to its
    share of ``pull_max_messages``, the wait to ``pull_max_wait_ms``.  A pull naming more
    queues than ``pull_max_messages`` is refused.  (The shard checks the rest.)"""
    if not args or type(args[0]) not in (list, tuple):
        return tuple(args)
    requests = args[0]
    if len(requests) > limits.pull_max_messages:
        raise ChannelRefusedError(f"pull refused: it names {len(requests)} queues, more than "
                                  f"channel_pull_max_messages ({limits.pull_max_messages})")
    share = limits.pull_max_messages // max(1, len(requests))
    capped = [(r[0], r[1], r[2], _clamped(r[3], share))
              if type(r) in (tuple, list) and len(r) == 4 else r for r in requests]
    if len(args) < 2:
        return (capped,)
    return (capped, _clamped(args[1], limits.pull_max_wait_ms), *args[2:])


#: Arguments of a data method brought within the channel's limits before the call.
_GUARDS = {"pull": capped_pull}


class Endpoint:
    """Serve ``target``'s ``methods`` on a TCP socket, one thread per connection, within
    ``limits`` (default ``ChannelLimits()``), over TLS when ``tls`` is a server context
    (default: ``tls_context``, i.e. exactly when Ray's TLS is on).

    The accept loop never ends before ``close``: each step has its own error handling;
    a failed accept (out of descriptors: EMFILE, ENFILE, ...) or thread start waits,
    doubling from 50 ms up to 1 s, and is logged (throttled).  A connection over a cap,
    or while fewer than ``reserve_fds`` descriptors are left, is closed at once.  The
    loop also shuts down every handshake past its deadline.  A connection idle for
    ``idle_timeout_ms`` is closed (its thread ends): a client that died without
    closing does not hold a thread for ever, and a live one reconnects.
    """

    def __init__(self, target: object, *, host: str = "127.0.0.1",
                 methods: frozenset[str] = DATA_METHODS, authkey: bytes | None = None,
                 limits: ChannelLimits | None = None,
                 tls: ssl.SSLContext | None | str = TLS_FROM_RAY):
        self._handlers = {m: getattr(target, m) for m in methods  # resolved once
                          if hasattr(target, m)}
        self._guards = {m: g for m, g in _GUARDS.items() if m in self._handlers}
        self.limits = limits or ChannelLimits()
        self.authkey = authkey or os.urandom(32)
        #: the version this endpoint speaks (a test may make it another release's)
        self.protocol_version = PROTOCOL_VERSION
        #: the server's TLS context; None: plain TCP
        self.tls = tls_context(server_side=True) if isinstance(tls, str) else tls
        self._gate = _Gate(self.limits)
        self._throttle = _Throttle()
        self._sock = socket.create_server((host, 0), backlog=128)
        self._sock.settimeout(_TICK_S)  # the loop wakes to shut down late handshakes
        self.address = (host, self._sock.getsockname()[1])
        self._closed = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name="raymq-endpoint-accept")
        self._acceptor.start()

    def connections(self) -> int:
        """Connections past their handshake, being served."""
        return self._gate.established()

    # ------------------------------------------------------------ accepting
    def _accept_loop(self) -> None:
        failures, next_reap = 0, 0.0
        while not self._closed.is_set():
            try:
                self._accept_one()
                failures = 0
            except Exception as err:  # out of descriptors or threads: wait, then go on
                if self._closed.is_set():
                    return
                failures += 1
                delay = min(1.0, 0.05 * 2 ** min(failures - 1, 5))
                self._note("accept", "accept failed (%s: %s); next try in %.2f s",
                           type(err).__name__, err, delay)
                self._closed.wait(delay)
            now = time.monotonic()
            if now >= next_reap:
                next_reap = now + _TICK_S
                try:
                    self._gate.reap(now)
                except Exception:
                    log.exception("endpoint %s: shutting down late handshakes failed",
                                  self.address)

    def _accept_one(self) -> None:
        """Accept one connection (or none within ``_TICK_S``) and give it a thread."""
        try:
            sock, peer = self._sock.accept()
        except TimeoutError:
            return
        refused = self._gate.admit(sock.fileno(), peer[0])
        if refused is not None:
            setting, why = refused
            self._note(setting, "refused a connection from %s: %s", peer[0], why)
            sock.close()
            return
        try:
            threading.Thread(target=self._serve, args=(sock, peer[0]), daemon=True,
                             name="raymq-endpoint-conn").start()
        except BaseException:
            self._gate.leave(sock.fileno())
            sock.close()
            raise

    def _note(self, kind: str, msg: str, *args) -> None:
        """A warning, at most one per kind every ``_LOG_EVERY_S``."""
        held = self._throttle(kind)
        if held is not None:
            more = f" ({held} more like it since the last report)" if held else ""
            log.warning("endpoint %s:%d: " + msg + more, *self.address, *args)

    # ------------------------------------------------------------ one connection
    def _serve(self, sock: socket.socket, peer: str) -> None:
        fd = sock.fileno()
        try:
            tune(sock)
            if self.tls is not None:  # (bound, like the rest, by the handshake deadline)
                sock = self.tls.wrap_socket(sock, server_side=True,
                                            do_handshake_on_connect=False)
                sock.do_handshake()
            link = Link(sock)
            if self._handshake(link):
                refused = self._gate.settle(fd)
                if refused is not None:
                    self._note(refused[0], "refused a connection from %s: %s", peer,
                               refused[1])
                    return
                link.send_bytes(_limits_frame(self.limits.max_request_bytes))  # its last step
                self._serve_requests(link)
        except Exception as err:  # wrong key, garbage, too slow, or a peer that went away
            self._note("handshake", "connection from %s refused: %s: %s", peer,
                       type(err).__name__, err)
        finally:
            self._gate.leave(fd)  # (before the descriptor can be reused)
            sock.close()

    def _handshake(self, link: Link) -> bool:
        """The server's half of the handshake up to ``HELLO`` (``LIMITS`` follows once the
        connection is counted as served); False (after telling the client, when it can
        understand) if the client speaks another protocol version."""
        deliver_challenge(link, self.authkey)
        answer_challenge(link, self.authkey)
        theirs = _hello_version(link.recv_bytes(self.limits.max_request_bytes))
        if theirs is None:  # a request: a client from before versions, waiting for a reply
            said = _mismatch(None, self.protocol_version, self.address)
            link.send_frames(encode_reply(False, RayMQError(str(said))))
        else:
            link.send_bytes(_hello(self.protocol_version))
        if theirs == self.protocol_version:
            return True
        log.warning("endpoint %s: refused a client of protocol version %s (this endpoint "
                    "speaks %d)", self.address, theirs, self.protocol_version)
        return False

    def _serve_requests(self, link: Link) -> None:
        """Requests until the client closes, stays idle too long, or sends too much."""
        idle_s = self.limits.idle_timeout_ms / 1000
        if link.tls:  # (kernel timeouts do not end a TLS read)
            link.sock.settimeout(idle_s)
        else:
            kernel_timeouts(link.sock, idle_s)
        limit = self.limits.max_request_bytes
        try:
            while True:
                try:
                    data = link.recv_bytes(limit)
                except FrameTooLarge as err:  # refused from its header: nothing more is read
                    self._note("too-large", "refused a request of %d bytes (the limit is %d)",
                               err.size, err.limit)
                    link.send_frames(encode_reply(False, ChannelRefusedError(
                        f"request refused: {err.size} bytes, more than the data channel takes "
                        f"({err.limit}: channel_max_request_bytes); connection closed")))
                    return
                except (EOFError, OSError):
                    return  # the client closed, stayed idle, or the endpoint is closing
                link.send_frames(self._dispatch(data))
        except OSError as err:  # the client went away before its reply
            log.info("endpoint %s: client gone: %s", self.address, err)

    def _dispatch(self, data) -> list:
        steps.start("shard.read")
        try:
            method, args = decode_request(data)
            steps.mark("shard.decoded")
            handler = self._handlers.get(method)
            if handler is None:
                raise ChannelRefusedError(f"{method!r} is not callable on the data channel")
            guard = self._guards.get(method)
            if guard is not None:
                args = guard(self.limits, args)
            return encode_reply(True, handler(*args))
        except ChannelRefusedError as err:
            self._note("request", "%s", err)
            return encode_reply(False, err)
        except Exception as err:  # the caller gets the error, the connection lives on
            return encode_reply(False, err)

    def close(self) -> None:
        """Stop accepting and drop every connection (their clients see the shard gone)."""
        self._closed.set()
        self._gate.close()  # shutdown wakes the threads blocked on these sockets
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._acceptor.join(timeout=5)
        self._sock.close()

