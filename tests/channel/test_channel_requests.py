"""The data channel after authentication (``raymq.actors.channel``): what a holder of the
key can make the shard do -- decode only the request types (no code run by a pickle), read
frames up to a size, pull within caps -- and the SDK's side of the size limit (a larger
request goes through Ray).  In-process, no Ray."""
from __future__ import annotations

import math
import os
import pickle
import struct

import pytest

from raymq import rpc
from raymq.actors.channel import ChannelLimits, Endpoint, connect, readable
from raymq.actors.protocol import EndRequest, check_group
from raymq.storage import RecordBatch
from raymq.storage.errors import RayMQError
from tests.helpers import call


class Target:
    def __init__(self):
        self.calls = 0
        self.pulled = []

    def send(self, *args):
        self.calls += 1
        return {"echo": args}

    def pull(self, *args):
        self.pulled.append(args)
        return []


def reply(link):
    assert readable(link, 5), "no reply within 5 s"
    return pickle.loads(link.recv_bytes())


@pytest.fixture
def via_handle(monkeypatch):
    """A ``DirectTransport`` finding ``ep`` through a fake shard handle (no Ray); Ray calls
    (``rpc.ShardClient``) served by the target directly, and recorded."""
    from raymq.transport import DirectTransport
    made = []

    def make(ep, target):
        class Handle:
            def endpoint(self):
                return ep.address, ep.authkey
        ray_calls = []

        class FakeShardClient:  # what a Ray actor call would do
            def __init__(self, handle):
                pass

            def submit(self, method, *args):
                ray_calls.append(method)
                value = getattr(target, method)(*args)
                return type("Done", (), {"result": lambda self, timeout=None: value})()
        monkeypatch.setattr(rpc, "connected", lambda: True)
        monkeypatch.setattr(rpc, "call", lambda method, timeout_s=None: method())
        monkeypatch.setattr(rpc, "ShardClient", FakeShardClient)
        t = DirectTransport(lambda i: Handle(), tls=None)
        made.append(t)
        return t, ray_calls
    yield make
    for t in made:
        t.close()


class RunsCode:
    """A pickle that calls ``os.system`` when it is loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused_and_the_endpoint_keeps_serving(tmp_path):
    target = Target()
    ep = Endpoint(target)
    marker = tmp_path / "ran"
    try:
        link = connect(ep.address, ep.authkey, 5)
        for request in (("send", (RunsCode(marker),)),  # in the arguments
                        (RunsCode(marker), ()),          # as the method
                        ("send", (check_group,))):       # an allowed module, another name
            link.send_bytes(pickle.dumps(request, protocol=5))
            ok, err = reply(link)
            assert not ok and isinstance(err, RayMQError), err
            assert err.code == "CHANNEL_REFUSED" and not err.retriable and "\n" not in str(err)
            assert "may not build" in str(err)
        assert "posix.system" in str(reply_of(link, ("send", (RunsCode(marker),))))
        assert not marker.exists(), "the pickle ran its command"
        assert target.calls == 0
        assert call(link, "send", 1) == {"echo": (1,)}  # the same connection goes on
    finally:
        ep.close()


def reply_of(link, request):
    link.send_bytes(pickle.dumps(request, protocol=5))
    return reply(link)[1]


def test_what_the_sdk_sends_still_crosses(via_handle):
    """The request types -- a RecordBatch (every column kind), EndRequests, dicts, tuples."""
    target = Target()
    ep = Endpoint(target)
    t, ray_calls = via_handle(ep, target)
    batch = RecordBatch(["a", "b"], [0, 1], [b"x", b"y"], keys=["k", None], tags=["t", None],
                        properties=[{"p": "1"}, None], flags=[0, 1], born_ms=5)
    ends = [EndRequest("g", "tx", (1, 2), "COMMIT_MESSAGE")]
    try:
        (got, pid, seq, got_ends), = [t.call(0, "send", batch, 7, 1, ends, timeout_s=5)["echo"]]
        assert (got.topics, got.queue_ids, got.bodies, got.keys, got.tags, got.properties,
                got.flags, got.born_ms) == (batch.topics, batch.queue_ids, batch.bodies,
                                            batch.keys, batch.tags, batch.properties,
                                            batch.flags, batch.born_ms)
        assert (pid, seq, got_ends) == (7, 1, ends)
        assert t.call(0, "send", {("t", 0): 3}, {"s"}, 1.5, None, True, timeout_s=5) == \
            {"echo": ({("t", 0): 3}, {"s"}, 1.5, None, True)}
        big = os.urandom(3 << 20)  # a frame read in pieces, both ways
        assert t.call(0, "send", big, timeout_s=10) == {"echo": (big,)}
        assert ray_calls == []
    finally:
        ep.close()


def test_a_frame_announced_but_not_sent_costs_no_memory():
    import time
    import tracemalloc
    ep = Endpoint(Target())
    tracemalloc.start()
    try:
        link = connect(ep.address, ep.authkey, 5)
        before = tracemalloc.get_traced_memory()[0]
        os.write(link.fileno(), struct.pack("!i", 60 << 20) + b"x" * 100)  # 60 MiB, within
        time.sleep(0.5)                                                   # the limit
        grown = tracemalloc.get_traced_memory()[0] - before
        assert grown < 4 << 20, f"{grown} bytes for a frame of 100 bytes so far"
    finally:
        tracemalloc.stop()
        ep.close()


def test_an_oversized_frame_is_refused_from_its_header_without_being_read():
    target = Target()
    ep = Endpoint(target)
    try:
        for header in (struct.pack("!i", 0x7FFFFFF0),                       # ~2 GiB
                       struct.pack("!i", -1) + struct.pack("!Q", 1 << 40)):  # 1 TiB
            link = connect(ep.address, ep.authkey, 5)
            os.write(link.fileno(), header + b"x" * 100)  # and no more: the reply comes
            ok, err = reply(link)
            assert not ok and isinstance(err, RayMQError) and err.code == "CHANNEL_REFUSED"
            assert "channel_max_request_bytes" in str(err) and "\n" not in str(err)
            with pytest.raises((EOFError, OSError)):  # and that connection is closed
                link.recv_bytes()
        assert call(connect(ep.address, ep.authkey, 5), "send", 1) == {"echo": (1,)}
    finally:
        ep.close()


def test_the_frame_limit_is_a_setting_and_the_sdk_sends_larger_requests_through_ray(via_handle):
    target = Target()
    ep = Endpoint(target, limits=ChannelLimits(max_request_bytes=65_536))
    t, ray_calls = via_handle(ep, target)
    try:
        link = connect(ep.address, ep.authkey, 5)
        assert link.max_request_bytes == 65_536  # the endpoint says so in the handshake
        with pytest.raises(RayMQError, match="more than the data channel takes"):
            call(link, "send", b"x" * 70_000)
        assert call(connect(ep.address, ep.authkey, 5), "send", b"y" * 60_000)
        assert t.call(0, "send", b"z" * 100, timeout_s=5) == {"echo": (b"z" * 100,)}
        assert ray_calls == []
        big = b"w" * 100_000  # a request the endpoint would refuse: sent as a Ray call
        assert t.call(0, "send", big, timeout_s=5) == {"echo": (big,)}
        assert ray_calls == ["send"]
        assert t.call(0, "send", 2, timeout_s=5) == {"echo": (2,)}  # and the channel goes on
        assert ray_calls == ["send"]
    finally:
        ep.close()


def test_a_huge_pull_is_capped_and_a_normal_one_left_alone():
    target = Target()
    ep = Endpoint(target)  # default caps: 100000 messages a pull, 30 s of wait
    try:
        link = connect(ep.address, ep.authkey, 5)
        call(link, "pull", [("t", 0, 0, 10**12), ("t", 1, 5, 1000)], 10**9, {"t": ["a"]})
        assert target.pulled[-1] == ([("t", 0, 0, 50_000), ("t", 1, 5, 1000)], 30_000,
                                     {"t": ["a"]})
        normal = ([("t", q, 7, 1000) for q in range(4)], 500, None)  # what a consumer asks
        call(link, "pull", *normal)
        assert target.pulled[-1] == normal
        call(link, "pull", [("t", 0, 0, 0)], 0)  # (a consumer's look at the queue ends)
        assert target.pulled[-1] == ([("t", 0, 0, 0)], 0)
    finally:
        ep.close()


def test_pull_caps_are_settings_and_too_many_queues_is_refused():
    target = Target()
    ep = Endpoint(target, limits=ChannelLimits(pull_max_messages=10, pull_max_wait_ms=100))
    try:
        link = connect(ep.address, ep.authkey, 5)
        call(link, "pull", [["t", 0, 0, math.inf], ("t", 1, 0, math.nan), ("t", 2, 0, 2)],
             1e300)
        assert target.pulled[-1] == ([("t", 0, 0, 3), ("t", 1, 0, 3), ("t", 2, 0, 2)], 100)
        with pytest.raises(RayMQError, match="names 11 queues, more than "
                                             "channel_pull_max_messages") as err:
            call(link, "pull", [("t", q, 0, 1) for q in range(11)], 0)
        assert err.value.code == "CHANNEL_REFUSED" and len(target.pulled) == 1
    finally:
        ep.close()


def test_a_large_receive_buffer_is_whole_huge_pages_seen_at_its_own_length():
    """A trusted link reads a large frame into ``fresh_buffer``: its mapping is a whole
    number of huge pages (placed on a huge-page boundary by the kernel, none of it left in
    4 KiB pages), the buffer the frame's exact length."""
    import mmap

    from raymq.storage.buffers import HUGE_PAGE_BYTES, fresh_buffer
    for size in (3 << 20, 4 << 20, (4 << 20) + 1):
        buf = fresh_buffer(size)
        view = memoryview(buf)
        assert len(view) == size and not view.readonly
        whole = view.obj
        assert isinstance(whole, mmap.mmap) and len(whole) % HUGE_PAGE_BYTES == 0
        assert len(whole) - size < HUGE_PAGE_BYTES
        view[-1:] = b"x"
        assert whole[size - 1:size] == b"x"
    assert isinstance(fresh_buffer(1000), bytearray)
