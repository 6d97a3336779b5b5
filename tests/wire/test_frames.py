"""The Kafka listener's frames with a real Kafka client's encoder (kafka-python's), and a
listener fed random and truncated frames: each closes its own connection, never the
listener.  No Ray: the cluster behind it is a table of topics."""
from __future__ import annotations

import random
import socket
import struct
import threading

import pytest
from kafka.protocol.metadata import ApiVersionsRequest, ApiVersionsResponse, MetadataRequest

from raymq.wire.frames import SERVED, BadFrame, UnsupportedVersion, decode_request, frame_size
from raymq.wire.listener import KafkaListener


class Topics:
    """The cluster as the listener sees it: its topics and their queues' shards."""

    def __init__(self, topics):
        self._topics = topics

    def topics(self):
        return self._topics

    def learn_routes(self, routes):
        self.learned = routes


@pytest.fixture
def listener():
    lst = KafkaListener(Topics({"orders": {"routes": [0, 1, 0]}, "RMQ_SYS_TRANS_HALF_TOPIC":
                                {"routes": [0]}, "%DLQ%g": {"routes": [0]}}), port=0).start()
    yield lst
    lst.stop()


def ask(sock: socket.socket, request, version: int, correlation_id: int = 1):
    """Send ``request`` at ``version`` as kafka-python does; the decoded answer."""
    request.API_VERSION = version
    request.with_header(correlation_id=correlation_id, client_id="test")
    sock.sendall(bytes(request.encode(header=True, framed=True)))
    size = struct.unpack(">i", _exactly(sock, 4))[0]
    body = _exactly(sock, size)
    from kafka.protocol.api_header import ResponseClassRegistry
    cls = ResponseClassRegistry._response_class_registry[request.API_KEY]
    answer = cls.decode(body, version=version, header=True)
    assert answer.header.correlation_id == correlation_id
    return answer


def _exactly(sock, n):
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "the listener closed the connection"
        out += chunk
    return out


def test_every_version_served_of_each_api_is_answered(listener):
    with socket.create_connection(listener.address) as s:
        for v in range(0, 4):
            got = ask(s, ApiVersionsRequest(client_software_name="t",
                                            client_software_version="1"), v)
            assert got.error_code == 0
            assert {(k.api_key, k.min_version, k.max_version) for k in got.api_keys} == \
                {(key, lo, hi) for key, (_c, lo, hi) in SERVED.items()}
        for v in range(0, 13):
            topics = None if v else []  # (v0 has no null: an empty list means all)
            got = ask(s, MetadataRequest(topics=topics, allow_auto_topic_creation=False), v)
            assert {t.name: len(t.partitions) for t in got.topics} == {"orders": 3}
            [broker] = got.brokers
            assert (broker.host, broker.port) == listener.address
            asked = [MetadataRequest.MetadataRequestTopic(name=n, topic_id=None)
                     for n in ("orders", "nope")]
            got = ask(s, MetadataRequest(topics=asked, allow_auto_topic_creation=False), v)
            assert [(t.name, t.error_code) for t in got.topics] == [("orders", 0), ("nope", 3)]


def test_an_api_versions_request_of_a_version_not_served_is_told_which_are(listener):
    with socket.create_connection(listener.address) as s:
        r = ApiVersionsRequest[3](client_software_name="t", client_software_version="1")
        r.with_header(correlation_id=9, client_id="new client")
        raw = bytearray(r.encode(header=True, framed=True))
        struct.pack_into(">h", raw, 6, 99)  # a version from the future
        s.sendall(bytes(raw))
        size = struct.unpack(">i", _exactly(s, 4))[0]
        got = ApiVersionsResponse.decode(_exactly(s, size), version=0, header=True)
        assert got.header.correlation_id == 9 and got.error_code == 35
        assert 18 in {k.api_key for k in got.api_keys}


def test_frames_that_cannot_be_taken_are_refused_in_one_line():
    with pytest.raises(BadFrame, match="frame of 1000000000 bytes"):
        frame_size(struct.pack(">i", 10**9))
    with pytest.raises(BadFrame, match="API key 999 is not served"):
        decode_request(struct.pack(">hhi", 999, 0, 1) + b"\x00\x00")
    with pytest.raises(BadFrame, match="MetadataRequest v99 is not served"):
        decode_request(struct.pack(">hhi", 3, 99, 1) + b"\x00\x00")
    with pytest.raises(UnsupportedVersion):
        decode_request(struct.pack(">hhi", 18, 99, 1) + b"\x00\x00")
    with pytest.raises(BadFrame, match="does not parse"):
        decode_request(struct.pack(">hhi", 3, 1, 1) + b"\x00\x00" + b"\xff" * 3)


def test_random_and_truncated_frames_never_stop_the_listener(listener):
    """Fuzz: for every API key served (and some not), random bodies, truncated good
    frames, lying sizes; after each, a new connection is still answered."""
    rng = random.Random(36)
    good = ApiVersionsRequest[3](client_software_name="t", client_software_version="1")
    good.with_header(correlation_id=1, client_id="fuzz")
    sample = bytes(good.encode(header=True, framed=True))
    for i in range(300):
        kind = i % 3
        if kind == 0:  # a header of a served (or not) API and a random body
            key = rng.choice(list(SERVED) + [0, 1, 999])
            body = struct.pack(">hhi", key, rng.randrange(0, 14), i) + bytes(
                rng.randrange(256) for _ in range(rng.randrange(0, 64)))
            frame = struct.pack(">i", len(body)) + body
        elif kind == 1:  # a good frame cut short
            frame = sample[:rng.randrange(1, len(sample))]
        else:  # a size that lies
            frame = struct.pack(">i", rng.choice([-1, 0, 3, 10**9, len(sample) + 50])) + sample[4:]
        with socket.create_connection(listener.address, timeout=5) as s:
            try:  # (the listener may have closed it already: that is the point)
                s.sendall(frame)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass
            except OSError:
                pass
        if i % 50 == 49:
            with socket.create_connection(listener.address, timeout=5) as s:
                assert ask(s, ApiVersionsRequest(client_software_name="t",
                                                 client_software_version="1"), 3).error_code == 0


class HeldTopics(Topics):
    """The cluster, its answer to ``topics`` held until ``release``."""

    def __init__(self, topics):
        super().__init__(topics)
        self.entered, self.release, self.calls = threading.Event(), threading.Event(), 0

    def topics(self):
        self.calls += 1
        self.entered.set()
        assert self.release.wait(30)
        return super().topics()


def test_stop_closes_every_connection_and_returns_once_no_request_is_being_answered():
    """A client left open (librdkafka asks for metadata on its own) reached a cluster
    client closed after ``stop``: Ray, shut down by then, started again by itself."""
    cluster = HeldTopics({"orders": {"routes": [0]}})
    lst = KafkaListener(cluster, port=0).start()
    idle = socket.create_connection(lst.address, timeout=10)
    busy = socket.create_connection(lst.address, timeout=10)
    request = MetadataRequest[1](topics=None)
    request.with_header(correlation_id=7, client_id="test")
    busy.sendall(bytes(request.encode(header=True, framed=True)))
    assert cluster.entered.wait(10)  # a request is being answered
    stopper = threading.Thread(target=lst.stop)
    stopper.start()
    stopper.join(0.5)
    assert stopper.is_alive()  # ... and stop waits for it
    cluster.release.set()
    stopper.join(30)
    assert not stopper.is_alive()
    assert idle.recv(1) == b""  # closed by the listener
    idle.close()
    busy.close()
    calls = cluster.calls
    with pytest.raises(OSError):  # nothing listens any more
        socket.create_connection(lst.address, timeout=2)
    assert cluster.calls == calls == 1
