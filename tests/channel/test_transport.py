"""Tests of the shards' data channel (``raymq.actors.channel``: framing, versioned handshake,
allow-list, endpoint, client connection) and of the SDK's transports (``raymq.transport``)."""
from __future__ import annotations

import os
import threading
from collections import Counter
from multiprocessing import AuthenticationError

import pytest

from raymq.actors.channel import ChannelRefusedError, Endpoint, connect
from raymq.storage.errors import BrokerUnavailableError, UnknownTopicError
from tests.helpers import EchoTarget, call
from tests.helpers import wait_for


class Target(EchoTarget):
    def pull(self, topic):
        raise UnknownTopicError(f"topic {topic!r} does not exist")

    def secret(self):
        return "must not be reachable"


def test_endpoint_serves_its_methods_refuses_others_and_strangers():
    target = Target()
    ep = Endpoint(target)
    try:
        conn = connect(ep.address, ep.authkey, 5)
        assert call(conn, "send", [1, b"x"]) == {"echo": [1, b"x"]}
        with pytest.raises(UnknownTopicError, match="does not exist"):  # the error, typed
            call(conn, "pull", "nope")
        with pytest.raises(ChannelRefusedError, match="not callable"):
            call(conn, "secret")
        assert call(conn, "send", 2) == {"echo": 2}  # the connection lives on after errors

        with pytest.raises(AuthenticationError):
            connect(ep.address, os.urandom(32), 5)
        # garbage instead of a handshake: refused, and the endpoint keeps serving
        import socket
        with socket.create_connection(ep.address) as raw:
            raw.sendall(b"GET / HTTP/1.0\r\n\r\n" * 10)
            raw.settimeout(5)
            try:
                while raw.recv(4096):
                    pass
            except OSError:
                pass
        other = connect(ep.address, ep.authkey, 5)
        assert call(other, "send", 3) == {"echo": 3}
        assert target.calls == 3

        # concurrent connections are served concurrently
        results = []
        threads = [threading.Thread(target=lambda i=i: results.append(
            call(connect(ep.address, ep.authkey, 5), "send", i))) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(r["echo"] for r in results) == list(range(8))
    finally:
        ep.close()
    with pytest.raises((EOFError, OSError)):  # closed: its clients see the shard gone
        call(conn, "send", 4)


uses_ray = pytest.mark.ray


@uses_ray
def test_ray_and_direct_transports_give_the_same_results(mq, name):
    from raymq import Message
    from raymq.client import RayMQ
    from raymq.message import SendStatus
    from tests.client.test_cluster import read_to_end
    assert mq.transport.name == "direct"
    via_ray = RayMQ(mq.controller, [mq.shard_handle(i) for i in range(mq.num_shards)],
                    transport="ray")
    assert via_ray.transport.name == "ray"
    try:
        mq.create_topic(name, queues=4)
        results = {}
        for client in (mq, via_ray):
            p = client.producer("p")
            sent = p.send_batch([Message(name, f"{client.transport.name}-{i}".encode(),
                                         key=str(i % 5)) for i in range(200)])
            sent_one = p.send(Message(name, f"{client.transport.name}-single".encode()))
            results[client.transport.name] = [*sent, sent_one]
            p.close()
        direct, ray_ = results["direct"], results["ray"]
        assert len(direct) == len(ray_) == 201
        assert {r.status for r in direct + ray_} == {SendStatus.SEND_OK}
        # the same message went to the same queue either way; and every offset of a queue
        # was given once (the ray sends after the direct ones)
        assert [r.queue_id for r in direct] == [r.queue_id for r in ray_]
        offsets = sorted((r.queue_id, r.queue_offset) for r in direct + ray_)
        per_queue = {q: [o for qq, o in offsets if qq == q] for q, _o in offsets}
        assert all(offs == list(range(len(offs))) for offs in per_queue.values())
        ids = sorted(r.msg_id for r in direct + ray_)
        assert len(set(ids)) == 402
        delivered = {}
        for client in (mq, via_ray):  # each reads everything, whichever way it was sent
            c = client.consumer(f"g{name}-{client.transport.name}", [name])
            got = read_to_end(c, client, [name])  # every queue to its end
            # as lists: a message delivered twice would show (a set would hide it)
            assert sorted(m.msg_id for m in got) == ids
            delivered[client.transport.name] = sorted(
                (m.msg_id, m.body, m.queue_id, m.queue_offset, m.key) for m in got)
            c.close()
        assert delivered["direct"] == delivered["ray"]
        sent_as = {r.msg_id: (r.queue_id, r.queue_offset) for r in direct + ray_}
        assert all(sent_as[i] == (q, o) for i, _b, q, o, _k in delivered["direct"])
    finally:
        via_ray.close()


@uses_ray
def test_a_kafka_style_transaction_through_the_ray_transport(mq, name):
    """Producer to coordinator and shards as Ray calls: a write held at its shard until
    the coordinator's registration lands is stored; commit and abort as over the
    channels."""
    from raymq import Message
    from raymq.client import RayMQ
    from tests.client.test_cluster import read_to_end
    via_ray = RayMQ(mq.controller, [mq.shard_handle(i) for i in range(mq.num_shards)],
                    transport="ray")
    try:
        topics = [f"{name}-{i}" for i in range(3)]
        for t in topics:
            mq.create_topic(t, queues=2)
        kp = via_ray.transactional_producer(f"p{name}")
        with kp.transaction():
            sent = kp.send_batch([Message(t, f"{t}-{i}".encode(), key=str(i))
                                  for t in topics for i in range(4)])
        assert [r.topic for r in sent] == [t for t in topics for _i in range(4)]
        kp.begin()
        kp.send_batch([Message(t, b"aborted") for t in topics])
        kp.abort()
        c = mq.consumer(f"g{name}", topics, isolation="read_committed")
        got = sorted(m.body for m in read_to_end(c, mq, topics))
        c.close()
        assert got == sorted(f"{t}-{i}".encode() for t in topics for i in range(4))
        kp.close()
    finally:
        via_ray.close()


@uses_ray
@pytest.mark.slow
def test_pooled_connection_to_a_restarted_shard_is_replaced_transparently(mq, name):
    import ray

    from raymq import Message, rpc
    mq.create_topic(name, queues=1)
    shard = mq.routes_for({name})[name][0]
    p = mq.producer("p")
    first = p.send(Message(name, b"before"))
    before = rpc.call(mq.shard_handle(shard).endpoint, timeout_s=30)
    assert mq.transport.inner._idle.get(shard), "the connection should be pooled"
    pid = rpc.call(mq.shard_handle(shard).ping, timeout_s=30)["pid"]
    ray.kill(mq.shard_handle(shard), no_restart=False)

    def restarted():
        try:
            return rpc.call(mq.shard_handle(shard).ping, timeout_s=30)["pid"] != pid
        except rpc.RayMQError:
            return False
    wait_for(restarted, 60, "the shard restarted")

    def endpoint():  # (once it leads again: its one replica, re-elected)
        try:
            return rpc.call(mq.shard_handle(shard).endpoint, timeout_s=60)
        except rpc.RayMQError:
            return None
    after = wait_for(endpoint, 60, "the restarted shard's data channel")
    assert after[1] != before[1]  # a new key (and port)
    # the pooled connection is dead; the call replaces it and goes through
    offsets = mq.transport.call(shard, "get_offsets", "nobody", [(name, 0)], timeout_s=30)
    assert offsets == {(name, 0): -1}
    second = p.send(Message(name, b"after"))
    assert (first.queue_offset, second.queue_offset) == (0, 1)
    p.close()


@uses_ray
def test_wrong_key_is_refused_by_a_shard_and_it_keeps_serving(mq, name):
    from raymq import rpc
    address, key = rpc.call(mq.shard_handle(0).endpoint, timeout_s=30)
    with pytest.raises(AuthenticationError):
        connect(tuple(address), bytes(reversed(key)), 5)
    assert mq.transport.call(0, "get_offsets", "nobody", [], timeout_s=30) == {}


@uses_ray
def test_concurrent_single_sends_share_a_sticky_queue_and_spread_over_time(mq, name):
    from raymq import Message
    mq.create_topic(name, queues=4)
    p = mq.producer("p")
    per_queue = Counter()
    lock = threading.Lock()

    def sender():
        for i in range(60):
            r = p.send(Message(name, b"x"))
            with lock:
                per_queue[r.queue_id] += 1
    threads = [threading.Thread(target=sender) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    p.close()
    assert sum(per_queue.values()) == 480
    assert set(per_queue) == {0, 1, 2, 3}  # every queue gets messages ...
    assert max(per_queue.values()) < 0.6 * 480  # ... none takes most of them


def test_a_closed_client_fails_calls_instead_of_starting_ray():
    from raymq.transport import DirectTransport
    t = DirectTransport(lambda i: None)
    t.close()
    with pytest.raises(Exception, match="closed"):
        t.call(0, "send", timeout_s=1)
    assert isinstance(t.submit(0, "send", (), timeout_s=1).exception(5), Exception)


def test_unreachable_endpoint_is_broker_unavailable():
    from raymq.transport import DirectTransport
    ep = Endpoint(Target())
    address, key = ep.address, ep.authkey
    ep.close()
    t = DirectTransport(lambda i: None)
    t._endpoints[0] = (address, key)  # as if resolved before the shard went away
    with pytest.raises(BrokerUnavailableError, match="unreachable"):
        t.call(0, "send", 1, timeout_s=2)
    assert 0 not in t._endpoints  # asked again next time
    t.close()


def test_an_endpoint_whose_port_went_to_another_shard_is_forgotten(monkeypatch):
    """A restarted shard's old port taken by another endpoint (another key): the client
    must not keep failing on the stale address; it asks the actor again."""
    import socket

    from raymq.actors import channel as endpoint_mod
    from raymq import rpc
    from raymq.transport import DirectTransport
    first = Endpoint(Target())
    port = first.address[1]
    current = {"ep": first}
    monkeypatch.setattr(rpc, "connected", lambda: True)
    monkeypatch.setattr(rpc, "call", lambda method, timeout_s=None: method())

    class Handle:
        def endpoint(self):  # what the shard actor would answer
            return current["ep"].address, current["ep"].authkey
    t = DirectTransport(lambda i: Handle())
    assert t.call(0, "send", 1, timeout_s=5) == {"echo": 1}
    first.close()
    for conns in t._idle.values():  # (a pooled connection would end in EOF: that is known)
        for c in conns:
            c.close()
    t._idle.clear()
    create = socket.create_server
    monkeypatch.setattr(endpoint_mod.socket, "create_server",
                        lambda addr, **kw: create((addr[0], port), **kw))  # the port reused
    second = Endpoint(Target())
    monkeypatch.setattr(endpoint_mod.socket, "create_server", create)
    current["ep"] = second
    with pytest.raises(BrokerUnavailableError):  # retriable, and the address is dropped
        t.call(0, "send", 2, timeout_s=5)
    assert 0 not in t._endpoints
    assert t.call(0, "send", 3, timeout_s=5) == {"echo": 3}  # asked again: served
    t.close()
    second.close()


def test_a_call_the_channel_refuses_a_connection_for_goes_through_ray(monkeypatch):
    """Issue 25 (11): an endpoint at its connection limits closes a new connection in
    its handshake; the SDK makes the same call through Ray instead of failing it."""
    from raymq import rpc
    from raymq.actors.channel import ChannelLimits
    from raymq.transport import DirectTransport
    target = Target()
    ep = Endpoint(target, limits=ChannelLimits(max_connections=1))
    monkeypatch.setattr(rpc, "connected", lambda: True)
    monkeypatch.setattr(rpc, "call", lambda method, timeout_s=None: method())

    class Handle:
        def endpoint(self):
            return ep.address, ep.authkey

    class RaySide:  # what the shard's Ray actor answers (no Ray in this test)
        calls = []

        def begin(self, shard, method, args, *, timeout_s):
            self.calls.append(method)
            return _Answered(getattr(target, method)(*args))
    t = DirectTransport(lambda i: Handle())
    t._ray = RaySide()
    try:
        held, _ = t._checkout(0, 5)  # the one connection the endpoint serves
        assert t.call(0, "send", 7, timeout_s=5) == {"echo": 7}
        assert RaySide.calls == ["send"]
        t._checkin(0, held)
        assert t.call(0, "send", 8, timeout_s=5) == {"echo": 8}  # the channel again
        assert RaySide.calls == ["send"]
    finally:
        t.close()
        ep.close()


class _Answered:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def test_outcome_wakes_every_waiter_and_times_out_cleanly():
    from raymq.transport import Outcome
    out = Outcome()
    with pytest.raises(TimeoutError):
        out.result(0)
    with pytest.raises(TimeoutError):
        out.result(-1.0)  # a negative timeout is no timeout at all, as for Event.wait
    got, seen = [], []
    out.add_done_callback(lambda o: seen.append(o.result()))
    waiters = [threading.Thread(target=lambda: got.append(out.result(30))) for _ in range(4)]
    for t in waiters:
        t.start()
    out.set_result("done")
    for t in waiters:
        t.join(30)
    assert got == ["done"] * 4 and seen == ["done"] and out.result(0) == "done"
    failed = Outcome()
    failed.set_exception(ValueError("boom"))
    with pytest.raises(ValueError):
        failed.result(0)
    assert isinstance(failed.exception(0), ValueError)


def test_an_idle_connection_is_closed_by_the_endpoint_and_the_client_reconnects(monkeypatch):
    import time

    from raymq import rpc
    from raymq.transport import DirectTransport
    from raymq.actors.channel import ChannelLimits
    ep = Endpoint(Target(), limits=ChannelLimits(idle_timeout_ms=300))
    monkeypatch.setattr(rpc, "connected", lambda: True)
    monkeypatch.setattr(rpc, "call", lambda method, timeout_s=None: method())

    class Handle:
        def endpoint(self):
            return ep.address, ep.authkey
    t = DirectTransport(lambda i: Handle())
    try:
        assert t.call(0, "send", 1, timeout_s=5) == {"echo": 1}
        deadline = time.monotonic() + 10
        while ep.connections() and time.monotonic() < deadline:  # the endpoint lets it go
            time.sleep(0.05)
        assert not ep.connections()
        assert t.call(0, "send", 2, timeout_s=5) == {"echo": 2}  # the pooled one was stale
    finally:
        t.close()
        ep.close()


# ------------------------------------------------------------ protocol version
def test_a_client_of_another_protocol_version_gets_one_clear_error_and_is_not_served():
    from raymq.actors.channel import PROTOCOL_VERSION, ProtocolVersionError
    target = Target()
    ep = Endpoint(target)
    try:
        newer = PROTOCOL_VERSION + 1
        with pytest.raises(ProtocolVersionError) as client_newer:
            connect(ep.address, ep.authkey, 5, version=newer)
        ep.protocol_version = newer  # now the endpoint is the other release
        with pytest.raises(ProtocolVersionError) as endpoint_newer:
            connect(ep.address, ep.authkey, 5)
        for err, mine, theirs in ((client_newer.value, newer, PROTOCOL_VERSION),
                                  (endpoint_newer.value, PROTOCOL_VERSION, newer)):
            text = str(err)
            assert f"this client speaks version {mine}, the endpoint version {theirs}" in text
            assert "\n" not in text and f"{ep.address[1]}" in text
            assert err.retriable is False and err.code == "PROTOCOL_VERSION_MISMATCH"
        assert not ep.connections() and target.calls == 0  # neither was kept nor served

        ep.protocol_version = PROTOCOL_VERSION  # the same release again: served
        conn = connect(ep.address, ep.authkey, 5)
        assert call(conn, "send", 1) == {"echo": 1}
        assert ep.connections() == 1 and target.calls == 1
    finally:
        ep.close()


def test_a_client_from_before_versions_gets_the_mismatch_as_the_reply_to_its_request():
    """A client of a release without the HELLO (HMAC, then a request at once)."""
    import socket
    from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

    from raymq.actors.channel import PROTOCOL_VERSION
    from raymq.storage.errors import RayMQError
    target = Target()
    ep = Endpoint(target)
    try:
        with socket.create_connection(ep.address, timeout=5) as sock:
            sock.settimeout(None)
            old = Connection(os.dup(sock.fileno()))
        answer_challenge(old, ep.authkey)
        deliver_challenge(old, ep.authkey)
        with pytest.raises(RayMQError, match="this client speaks no version .*the endpoint "
                                             f"version {PROTOCOL_VERSION}") as err:
            call(old, "send", 1)
        assert type(err.value) is RayMQError  # a class every release can unpickle
        with pytest.raises((EOFError, OSError)):  # and the endpoint hung up
            call(old, "send", 2)
        assert target.calls == 0
        old.close()
    finally:
        ep.close()


def test_an_endpoint_from_before_versions_is_a_clear_error_for_the_client(monkeypatch):
    """An endpoint of a release without the HELLO reads it as a (broken) request."""
    from multiprocessing.connection import answer_challenge, deliver_challenge

    from raymq.actors.channel import PROTOCOL_VERSION, ProtocolVersionError

    def old_handshake(self, conn):
        deliver_challenge(conn, self.authkey)
        answer_challenge(conn, self.authkey)
        return True
    monkeypatch.setattr(Endpoint, "_handshake", old_handshake)
    ep = Endpoint(Target())
    try:
        with pytest.raises(ProtocolVersionError, match=f"this client speaks version "
                                                       f"{PROTOCOL_VERSION}, the endpoint no "
                                                       f"version"):
            connect(ep.address, ep.authkey, 5)
    finally:
        ep.close()


def test_direct_transport_raises_a_version_mismatch_at_once_and_asks_again_next_time(
        monkeypatch):
    from raymq import rpc
    from raymq.actors.channel import PROTOCOL_VERSION, ProtocolVersionError
    from raymq.transport import DirectTransport
    ep = Endpoint(Target())
    ep.protocol_version = PROTOCOL_VERSION + 1  # a shard of another release
    monkeypatch.setattr(rpc, "connected", lambda: True)
    monkeypatch.setattr(rpc, "call", lambda method, timeout_s=None: method())
    asked = []

    class Handle:
        def endpoint(self):
            asked.append(1)
            return ep.address, ep.authkey
    t = DirectTransport(lambda i: Handle())
    try:
        with pytest.raises(ProtocolVersionError, match="version") as err:
            t.call(0, "send", 1, timeout_s=5)
        assert not err.value.retriable  # the producer's retry loop stops on it
        assert len(asked) == 1 and 0 not in t._endpoints  # one try; asked again next time
        assert isinstance(t.submit(0, "send", (2,), timeout_s=5).exception(10),
                          ProtocolVersionError)
        ep.protocol_version = PROTOCOL_VERSION  # the shard upgraded
        assert t.call(0, "send", 3, timeout_s=5) == {"echo": 3}
        assert len(asked) == 3
    finally:
        t.close()
        ep.close()
