"""A seeded fuzz of the data channel's frames (issue 12 E): what a holder of the key can
put on the wire -- random and mutated frames, truncated ones, lying length headers,
pickles of classes a request may not build, well-formed requests with wrong arguments --
never takes the endpoint or the shard down.  Every frame is answered with a result or one
line of RayMQ error, or its connection is closed; afterwards the endpoint serves new
connections, no connection is left open, and what was acknowledged before the fuzzing is
read back exactly as written.  In-process endpoint and shard, no Ray.
"""
from __future__ import annotations

import os
import pickle
import random
import socket
import struct

import pytest

from raymq.actors.channel import DATA_METHODS, ChannelLimits, Endpoint, connect, readable
from raymq.actors.protocol import dlq_topic, retry_topic
from raymq.actors.shard import BrokerShard
from raymq.storage import RecordBatch
from raymq.storage.errors import RayMQError
from tests.helpers import wait_for
from tests.front.test_fuzz_shard import TOPICS, a_timer, odd, some_batch, some_number, valid_calls

METHODS = ["send", "end_transactions", "pull", "commit_offsets", "get_offsets",
           "ktx_register", "ktx_send", "ktx_offsets", "ktx_end",
           "get_message", "set_fault", "close", "__init__", "", None, 7]


class Evil:
    """A pickle that would run code when loaded (make a directory), if the endpoint let
    a request build what it names."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def well_formed(rng) -> bytes:
    """A (method, args) request of the right shape with fuzzed arguments."""
    method = rng.choice(METHODS[:9]) if rng.random() < 0.8 else rng.choice(METHODS)
    q = (rng.choice(TOPICS), rng.choice([0, 1, -1, None]))
    args = {
        "send": lambda: (some_batch(rng), some_number(rng), some_number(rng)),
        "end_transactions": lambda: ([("g", "t", [some_number(rng)], "COMMIT_MESSAGE")],),
        "pull": lambda: ([(q[0], q[1], some_number(rng), some_number(rng))],
                         rng.choice([0, 1, -5, 10**9]), None,
                         rng.choice([None, "g", "other", 5])),
        "commit_offsets": lambda: (rng.choice(["g", "", None]), {q: some_number(rng)}),
        "get_offsets": lambda: (rng.choice(["g", None]), [q]),
        "ktx_register": lambda: (some_number(rng), some_number(rng), [q],
                                 rng.choice([["g"], [odd(rng)]])),
        "ktx_send": lambda: (some_batch(rng), some_number(rng), some_number(rng),
                             some_number(rng)),
        "ktx_offsets": lambda: (some_number(rng), some_number(rng), "g", {q: some_number(rng)}),
        "ktx_end": lambda: (some_number(rng), some_number(rng), rng.choice(["COMMIT", "X"])),
    }.get(method, lambda: tuple(odd(rng) for _ in range(rng.randrange(3))))()
    try:
        return pickle.dumps((method, args), protocol=5)
    except Exception:  # noqa: BLE001 -- an argument pickle cannot carry (object())
        return pickle.dumps((method, ()), protocol=5)


def some_frame(rng, marker: str) -> tuple[str, bytes]:
    """(kind, bytes to write after the handshake)."""
    kind = rng.choice(["request", "request", "mutated", "random", "evil", "shape",
                       "truncated", "bad-length", "huge-length", "empty"])
    if kind == "request":
        data = well_formed(rng)
    elif kind == "mutated":
        data = bytearray(well_formed(rng))
        for _ in range(rng.randrange(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        data = bytes(data)
    elif kind == "random":
        data = rng.randbytes(rng.randrange(1, 300))
    elif kind == "evil":
        data = pickle.dumps(("send", (Evil(marker),)), protocol=5)
    elif kind == "shape":
        data = pickle.dumps(rng.choice([("send",), ["pull", ()], ("pull", "x"), 5, None,
                                        ("pull", (), "extra")]), protocol=5)
    elif kind == "empty":
        data = b""
    else:
        data = None
    if kind == "truncated":  # a length it never completes, then the end
        body = well_formed(rng)
        return kind, struct.pack("!i", len(body)) + body[:rng.randrange(len(body))]
    if kind == "bad-length":
        return kind, struct.pack("!i", rng.choice([-2, -7, -(2**31)]))
    if kind == "huge-length":  # over the frame cap: refused from the header alone
        return kind, struct.pack("!i", -1) + struct.pack("!Q", rng.choice([2**40, 2**63 - 1]))
    return kind, struct.pack("!i", len(data)) + data


def answer(link):
    """The reply to what was written: ("reply", ok, value) or ("closed",)."""
    try:
        if not readable(link, 10):
            return ("silent",)
        ok, value = pickle.loads(link.recv_bytes())
        return ("reply", ok, value)
    except (EOFError, OSError):
        return ("closed",)


@pytest.mark.parametrize("seed", range(3))
def test_fuzzed_frames_are_answered_or_closed_and_nothing_is_lost(tmp_path, seed):
    rng = random.Random(seed)
    sh = BrokerShard(0, {"data_dir": str(tmp_path), "num_shards": 1, "txn_timeout_ms": 1},
                     background=False)
    sh.set_routes([("orders", 0), ("orders", 1), (retry_topic("g"), 0), (dlq_topic("g"), 0)])
    ep = Endpoint(sh, tls=None, limits=ChannelLimits(max_request_bytes=1 << 20,
                                                     idle_timeout_ms=20_000,
                                                     pull_max_wait_ms=2_000))
    link, marker = None, str(tmp_path / "code-ran")
    try:
        bodies = [f"acked-{i}".encode() for i in range(20)]
        assert sh.send(RecordBatch("orders", 0, bodies, keys=[f"k{i}" for i in range(20)]),
                       77, 1).status == "SEND_OK"
        surprises, kinds = [], {"reply": 0, "closed": 0}
        acked_phys, timer = list(range(0, 1)), a_timer(sh)  # (get_message is not served)
        for k in range(300):
            if link is None:
                link = connect(ep.address, ep.authkey, 10, tls=None)
            if k % 5 == 0:  # valid requests among the fuzz: each answered with a result
                for method, args in valid_calls(rng, acked_phys, timer, 5000 + k):
                    if method not in DATA_METHODS:
                        continue
                    link.send_bytes(pickle.dumps((method, args), protocol=5))
                    got = answer(link)
                    if got[0] != "reply" or not got[1]:
                        surprises.append(f"valid {method}: {got}")
                continue
            kind, raw = some_frame(rng, marker)
            try:
                link.sock.sendall(raw)
                if kind == "truncated":
                    link.sock.shutdown(socket.SHUT_WR)  # the rest never comes
            except OSError:
                pass
            got = answer(link)
            kinds[got[0]] = kinds.get(got[0], 0) + 1
            if got[0] == "reply":
                _, ok, value = got
                if not ok and (not isinstance(value, RayMQError) or "\n" in str(value)):
                    surprises.append(f"{kind}: {type(value).__name__}: {value}")
                if kind in ("truncated", "bad-length", "huge-length") and ok:
                    surprises.append(f"{kind} answered as a request: {value!r}")
            elif got[0] == "silent":
                surprises.append(f"{kind}: no answer and the connection still open")
            else:  # closed: only for what is not a whole frame, or a frame over the cap
                if kind in ("request", "mutated", "random", "evil", "shape", "empty"):
                    surprises.append(f"{kind}: a whole frame closed the connection")
            if got[0] in ("closed", "silent") or kind in ("truncated", "bad-length",
                                                          "huge-length"):
                # (a frame over the cap is answered, then its connection closed)
                link.close()
                link = None
        assert surprises == [], "\n".join(surprises)
        assert not os.path.exists(marker)  # no pickle ran code
        assert kinds["reply"] > 120 and kinds["closed"] > 10  # both paths were taken
        if link is not None:
            link.close()
            link = None
        wait_for(lambda: ep.connections() == 0, 20, "every fuzzed connection closed")
        link = connect(ep.address, ep.authkey, 10, tls=None)  # the endpoint still serves
        link.send_bytes(pickle.dumps(("pull", ([("orders", 0, 0, 100)], 0)), protocol=5))
        ok, [(_t, _q, batch, _n, _e)] = pickle.loads(link.recv_bytes())
        assert ok
        assert [(m.body, m.key) for m in batch.messages()][:20] == \
            [(b, f"k{i}") for i, b in enumerate(bodies)]  # as written
    finally:
        if link is not None:
            link.close()
        ep.close()
        sh.close()
