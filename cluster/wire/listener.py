"""The Kafka listener's sockets: one thread per connection, requests answered in order.

A frame that cannot be taken -- oversized, truncated, of an API not served, or not
parsing -- closes its own connection only (logged in one line); the listener and every
other connection go on.  ``KafkaListener(mq, host, port)`` serves until ``stop``
(port 0: any free one, ``address`` once started), which closes every connection and
returns once none is answering a request any more: nothing reaches ``mq`` after it (a
client left open would otherwise go on asking for metadata, through an ``mq`` that may
be closed by then).
"""
from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time

from raymq.wire.apis import KafkaApis, unsupported_api_versions
from raymq.wire.frames import (MAX_FRAME_BYTES, BadFrame, UnsupportedVersion, decode_request,
                               encode_response, frame_size)

log = logging.getLogger("raymq.kafka")

#: How long a connection may sit in the middle of a frame.
FRAME_TIMEOUT_S = 30.0
#: How long ``stop`` waits for a connection answering a request to finish it.
STOP_WAIT_S = 30.0


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    apis: KafkaApis
    max_frame_bytes = MAX_FRAME_BYTES

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.open: dict[socket.socket, threading.Thread] = {}  # connections being served
        self.open_lock = threading.Lock()
        self.stopping = False

    def close_connections(self, wait_s: float) -> list[str]:
        """Shut every open connection and wait up to ``wait_s`` for their threads; the
        names of those still running (answering a request that has not returned)."""
        with self.open_lock:
            self.stopping = True
            served = dict(self.open)
        for sock in served:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # (closed meanwhile)
        deadline = time.monotonic() + wait_s
        for thread in served.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in served.values() if t.is_alive()]


class _Connection(socketserver.BaseRequestHandler):
    def setup(self) -> None:
        with self.server.open_lock:
            if self.server.stopping:  # (accepted as the listener stopped: not served)
                self.request.close()
                return
            self.server.open[self.request] = threading.current_thread()

    def finish(self) -> None:
        with self.server.open_lock:
            self.server.open.pop(self.request, None)

    def handle(self) -> None:
        if self.request.fileno() < 0:
            return  # (closed in setup)
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = "%s:%s" % self.client_address[:2]
        try:
            while True:
                head = _read(sock, 4, idle=True)
                if head is None:
                    return  # (closed between requests)
                payload = _read(sock, frame_size(head, self.server.max_frame_bytes))
                if payload is None:
                    raise BadFrame("the connection closed inside a frame")
                answer = self._answer(payload)
                if answer is not None:  # (a Produce with acks 0 is not answered)
                    sock.sendall(answer)
        except BadFrame as err:
            log.warning("kafka listener: closed the connection of %s: %s", peer, err)
        except (OSError, socket.timeout) as err:
            log.info("kafka listener: connection of %s ended: %s", peer, err)
        except Exception:  # (a defect answering a request: that connection only)
            log.exception("kafka listener: closed the connection of %s: answering failed",
                          peer)

    def _answer(self, payload: bytes) -> bytes | None:
        try:
            request = decode_request(payload)
        except UnsupportedVersion as ask:
            return encode_response(unsupported_api_versions(), ask.correlation_id)
        response = self.server.apis.handle(request)
        if not request.expect_response():
            return None
        return encode_response(response, request.header.correlation_id)


def _read(sock: socket.socket, n: int, *, idle: bool = False) -> bytes | None:
    """``n`` bytes, or None when the peer closed first (between frames when ``idle``:
    no wait limit then)."""
    sock.settimeout(None if idle else FRAME_TIMEOUT_S)
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
        sock.settimeout(FRAME_TIMEOUT_S)
    return b"".join(chunks)


class KafkaListener:
    """A Kafka-protocol listener in front of ``mq`` on ``host:port`` (advertised as
    ``advertised_host``, default: ``host``)."""

    def __init__(self, mq, host: str = "127.0.0.1", port: int = 9092, *,
                 advertised_host: str | None = None, node_id: int = 0):
        self._server = _Server((host, port), _Connection)
        bound = self._server.server_address[1]
        self._server.apis = KafkaApis(mq, advertised_host or host, bound, node_id)
        self.address = (host, bound)
        self._thread: threading.Thread | None = None

    def start(self) -> "KafkaListener":
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="raymq-kafka-listener")
        self._thread.start()
        log.info("kafka listener on %s:%d", *self.address)
        return self

    def stop(self) -> None:
        """Stop accepting, close every connection, and return once no request is being
        answered (a request still running after ``STOP_WAIT_S`` is logged)."""
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        left = self._server.close_connections(STOP_WAIT_S)
        if left:
            log.warning("kafka listener: %d connection(s) still answering a request after "
                        "%.0f s: %s", len(left), STOP_WAIT_S, ", ".join(left))
