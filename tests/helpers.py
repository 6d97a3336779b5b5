"""What the tests share (no Ray): the repository's root, ``wait_for``; a store of small
segments (``open_store``), records and bodies to put in it, ways to damage its files; a
shard on its own directory and clock (``open_shard``) and the bodies of a queue; an
echo target and a raw request for the data channel."""
from __future__ import annotations

import os
import pickle
import threading
import time

import numpy as np

from raymq.storage import MessageStore, RecordBatch, StoreConfig
from raymq.storage.consumequeue import CQ_ENTRY

#: The repository's root (README.md, pyproject.toml, the tools' scripts).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_for(cond, timeout_s: float = 30.0, what: str = "condition"):
    """Poll ``cond`` until truthy (returns its value) or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    ev = threading.Event()
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        ev.wait(0.02)


# ------------------------------------------------------------------ stores
SMALL = StoreConfig(segment_size_bytes=256 * 1024, max_message_bytes=4096,
                    max_frame_bytes=4096 + 128 * 1024, flush_interval_ms=50)


def body(i: int, size: int = 200) -> bytes:
    head = f"msg-{i:08d}|".encode()
    return head + bytes((i + k) % 251 for k in range(size - len(head)))


def batch(topic: str, queue_id: int, start: int, n: int, size: int = 200) -> RecordBatch:
    return RecordBatch(topic, queue_id, [body(i, size) for i in range(start, start + n)])


def commitlog_files(directory: str) -> list[str]:
    cl = os.path.join(directory, "commitlog")
    return [os.path.join(cl, n) for n in sorted(os.listdir(cl))]


def store_whose_queues_must_be_rebuilt(directory: str, config: StoreConfig = SMALL
                                       ) -> dict[tuple[str, int], list[bytes]]:
    """Topic A: 3 records under the checkpoint; B: 5 after it, its consume queue holding
    one stray entry instead of theirs.  Opening it finds B's queue at odds with the log
    (the first record of B has queue offset 0, the queue expects 1) and rebuilds."""
    with MessageStore(directory, config, background=False) as store:
        store.put(RecordBatch("A", 0, [b"a0", b"a1", b"a2"]))
        store.checkpoint()
        with open(os.path.join(directory, "checkpoint"), "rb") as f:
            first_checkpoint = f.read()
        store.put(RecordBatch("B", 0, [b"b%d" % i for i in range(5)]))
        first_a = int(store.read_cq("A", 0, 0, 1)["phys"][0])
    with open(os.path.join(directory, "checkpoint"), "wb") as f:  # died before checkpointing B
        f.write(first_checkpoint)
    stray = np.array([(first_a, 80, 0)], CQ_ENTRY).tobytes()  # an entry no record of B has
    with open(os.path.join(directory, "consumequeue", "B", "0"), "wb") as f:
        f.write(stray)
    return {("A", 0): [b"a0", b"a1", b"a2"], ("B", 0): [b"b%d" % i for i in range(5)]}


def put_starts(store: MessageStore) -> list[tuple[int, dict[int, int]]]:
    """Where each put starts in ``store``'s log, with the last sequence of each producer
    before it."""
    from raymq.storage.records import FRAME_ATTR_LAST, frame_producer
    from raymq.storage.replication import split_frames
    out, last, phys, pending = [], {}, 0, True
    while True:
        start, data = store.read_frames(phys, 1 << 30)
        if not data:
            return out
        for pos, _length, _count in split_frames(data):
            if pending:
                out.append((start + pos, dict(last)))
            producer_id, sequence, _ms, attrs = frame_producer(data, pos)
            last[producer_id] = sequence
            pending = bool(attrs & FRAME_ATTR_LAST)
        phys = start + len(data)


def forget_checkpoint(path) -> None:
    """As if the process died before checkpointing anything (scan from the start)."""
    (path / "checkpoint").write_text('{"format": "raymq-checkpoint", "version": 1, '
                                     '"consume_queue_offset": 0, "producers": {}}')


def flip(path: str, offset: int) -> None:
    """Invert the byte at ``offset`` of the file at ``path`` (a bit rot)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def open_store(path, config: StoreConfig = SMALL, **kw) -> MessageStore:
    """A store of small segments in ``path``, with no background threads unless asked."""
    kw.setdefault("background", False)
    return MessageStore(str(path), config, **kw)


def queue_bodies(store, topic: str, qid: int = 0) -> list[bytes]:
    """The bodies of every record of one queue, in order."""
    return [m.body for m in store.read_queue(topic, qid, 0, store.max_queue_offset(topic, qid) + 1)]


# ------------------------------------------------------------------ shards
def open_shard(directory, routes, *, clock=None, **cfg):
    """Shard 0 of one, on ``directory``, serving ``routes`` ((topic, queue) pairs); no
    background threads; on ``clock`` (a ManualClock) when given."""
    from raymq.actors.shard import BrokerShard
    kw = {} if clock is None else {"clock": clock}
    sh = BrokerShard(0, {"data_dir": str(directory), "num_shards": 1, **cfg}, background=False,
                     **kw)
    sh.set_routes(list(routes))
    return sh


# ------------------------------------------------------------ data channel
class EchoTarget:
    """What an endpoint serves: ``send`` echoes its argument and counts its calls."""

    def __init__(self):
        self.calls = 0

    def send(self, x):
        self.calls += 1
        return {"echo": x}


def call(link, method, *args):
    """One request on an established link; its value, or its error raised."""
    link.send_bytes(pickle.dumps((method, args), protocol=5))
    ok, value = pickle.loads(link.recv_bytes())
    if not ok:
        raise value
    return value


class Answered:
    """A call made at once, as a transport's ``begin`` would send it: ``result()`` hands
    over its answer, or raises its error (the listener's tests over in-process shards)."""

    def __init__(self, fn, args):
        try:
            self.value, self.error = fn(*args), None
        except Exception as err:  # (raised where a transport's call would raise it)
            self.value, self.error = None, err

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value
