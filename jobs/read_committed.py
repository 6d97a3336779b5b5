"""Committed messages as a Ray Dataset: ``read_committed(mq, topics, group=...)``.

The call fixes, for every queue of the topics, where the read starts (the group's
committed offsets, ``"earliest"``, or given ones) and where it ends: the queue's last
stable offset at this call, so the dataset holds exactly the messages a read_committed
consumer of that range sees -- no open or aborted Kafka-style transaction, no control
marker, no RocketMQ half, no system topic.  One Ray task per block -- a queue's range in
pieces of at most ``max_block_rows`` messages -- reads it from its shard over the data
channel (never through the driver) and returns one Arrow IPC stream
(``raymq.jobs.schema``), which becomes one block of the dataset: RayDP's executors read
such blocks straight from Ray's object store (``to_spark``).

With a ``group``, the group's job producer (transactional id ``raymq-job-<group>``) is
made first: its new epoch fences an earlier run of the job and aborts whatever that run
left open, so the offsets read here cannot be committed by anyone else meanwhile.
``write_transactionally`` commits the results with ``end_offsets`` through it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ray

from raymq.jobs.schema import message_record_batch, to_ipc_bytes
from raymq.message import check_user_topic
from raymq.storage.errors import InvalidMessageError, RayMQError

log = logging.getLogger("raymq.jobs")

Queue = tuple[str, int]
#: Messages one pull of a read task asks for.
PULL_MESSAGES = 20_000
#: Most messages in one block of the dataset: a queue's range is read in blocks of at
#: most this many (each its own read task), so that no block outgrows the object store.
MAX_BLOCK_ROWS = 1_000_000


def job_transactional_id(group: str) -> str:
    return f"raymq-job-{group}"


#: The job producer of each (client, group) made by ``read_committed``: what
#: ``write_transactionally`` commits through.
_JOB_PRODUCERS: dict[tuple[int, str], object] = {}


def job_producer(mq, group: str, *, fresh: bool = False):
    """The group's job producer on this client; ``fresh``: a new one (a new epoch: an
    earlier run's, here or anywhere, is fenced and its open transaction aborted)."""
    key = (id(mq), group)
    if fresh or key not in _JOB_PRODUCERS:
        _JOB_PRODUCERS[key] = mq.transactional_producer(job_transactional_id(group))
    return _JOB_PRODUCERS[key]


@dataclass
class ReadBatch:
    """What ``read_committed`` read: the dataset and the offsets it covers."""

    dataset: object                     # ray.data.Dataset
    start_offsets: dict[Queue, int]
    end_offsets: dict[Queue, int]       # {(topic, queue id): next offset}: commit these
    group: str | None = None
    producer: object = None             # the group's fenced job producer (with a group)
    _refs: list = field(default_factory=list, repr=False)  # keeps the blocks alive

    @property
    def empty(self) -> bool:
        """No new message in any queue."""
        return all(self.end_offsets[q] <= self.start_offsets[q] for q in self.end_offsets)


def read_committed(mq, topics, group: str | None = None, *, start=None,
                   max_block_rows: int = MAX_BLOCK_ROWS) -> ReadBatch:
    """Committed messages of ``topics`` from ``start`` (default: the group's committed
    offsets; ``"earliest"``; or ``{(topic, queue id): offset}``) up to each queue's last
    stable offset now, as a ``ReadBatch``; each queue's range in blocks of at most
    ``max_block_rows`` messages (a block per read task: bounded memory whatever the
    topic's size; blocks the object store cannot hold are spilled by Ray)."""
    if isinstance(max_block_rows, bool) or not isinstance(max_block_rows, int) \
            or max_block_rows < 1:
        raise InvalidMessageError(f"max_block_rows must be a positive int, not "
                                  f"{max_block_rows!r}")
    topics = [topics] if isinstance(topics, str) else list(topics)
    for t in topics:
        check_user_topic(t)
    if start is None and group is None:
        raise InvalidMessageError("read_committed needs a group (its committed offsets) or "
                                  "a start ('earliest' or {(topic, queue id): offset})")
    producer = job_producer(mq, group, fresh=True) if group else None
    routes = mq.routes_for(set(topics))
    shard_of = {(t, q): s for t in topics for q, s in enumerate(routes[t])}
    by_shard: dict[int, list[Queue]] = {}
    for q, s in shard_of.items():
        by_shard.setdefault(s, []).append(q)
    starts, ends = {}, {}
    for shard, queues in by_shard.items():
        replies = mq.transport.call(shard, "pull", [(t, q, 0, 0) for t, q in queues], 0, None,
                                    None, "read_committed", timeout_s=60)
        ends.update({(t, q): end for t, q, _b, _n, end in replies})
        if start is None:
            got = mq.transport.call(shard, "get_offsets", group, queues, timeout_s=60)
            starts.update({q: max(0, off) for q, off in got.items()})
    if start == "earliest":
        starts = {q: 0 for q in shard_of}
    elif isinstance(start, dict):
        starts = {q: int(start.get(q, 0)) for q in shard_of}
    elif start is not None:
        raise InvalidMessageError(f"start must be None, 'earliest' or a dict, not {start!r}")
    for shard, queues in by_shard.items():  # what aged out is not read: from the log start
        for q, (log_start, _end, _t) in mq.transport.call(shard, "queue_bounds", queues,
                                                           timeout_s=60).items():
            if starts[q] < log_start:
                log.warning("read_committed: %s/%d starts at its log start %d, not %d: %d "
                            "messages aged out before they were read", q[0], q[1], log_start,
                            starts[q], log_start - starts[q])
                starts[q] = log_start
    pairs = [_read_queue.options(num_returns=2).remote(
                 mq.shard_handle(shard_of[q]), shard_of[q], q[0], q[1], lo,
                 min(lo + max_block_rows, ends[q]))
             for q in sorted(shard_of) for lo in range(starts[q], ends[q], max_block_rows)]
    if pairs:
        refs = [block for block, _meta in pairs]
        dataset = _dataset(refs, ray.get([meta for _block, meta in pairs]))
    else:  # a dataset needs a block: an empty one
        refs = [ray.put(to_ipc_bytes([]))]
        dataset = ray.data.from_arrow_refs(refs)
    return ReadBatch(dataset, starts, ends, group, producer, refs)


def _dataset(refs: list, metadata: list):
    """``ray.data.from_arrow_refs(refs)`` without its metadata tasks, which read every
    block again (a task per block, each wanting a whole CPU: with Spark up, one at a
    time): the read tasks measured their blocks (``from_arrow_refs`` of the pinned Ray,
    through Ray Data's internals; their public entry when those moved)."""
    try:
        from ray.data._internal.logical.interfaces import LogicalPlan
        from ray.data._internal.logical.operators import FromArrow
        from ray.data._internal.stats import DatasetStats
        from ray.data.context import DataContext
        from ray.data.dataset import MaterializedDataset
    except ImportError:  # (another Ray)
        return ray.data.from_arrow_refs(refs)
    context = DataContext.get_current().copy()
    stats = DatasetStats(metadata={"FromArrow": metadata}, parent=None)
    return MaterializedDataset(LogicalPlan(FromArrow(refs, metadata), context), context, stats)


@ray.remote(num_cpus=0.25, max_retries=3)
def _read_queue(handle, shard: int, topic: str, qid: int, start: int, end: int):
    """The committed messages of one queue in [start, end) as an Arrow IPC stream, and
    its Ray Data block metadata (a pure read: safe to retry).  Runs in a Ray worker, near
    the data when it can."""
    from ray.data.block import BlockMetadataWithSchema
    from raymq.transport import DirectTransport
    transport = DirectTransport(lambda _i: handle, io_threads=1)
    batches, offset = [], start
    try:
        while offset < end:
            [(_t, _q, batch, nxt, _e)] = _pull(transport, shard, topic, qid, offset,
                                               min(PULL_MESSAGES, end - offset))
            if len(batch):
                keep = batch.queue_offsets < end
                if keep.any():
                    batches.append(message_record_batch(shard, topic, qid, batch, keep))
            if nxt <= offset:  # (never: a pull passes markers and aborted records)
                raise RayMQError(f"{topic}/{qid}: no progress at offset {offset} of {end}")
            offset = nxt
    finally:
        transport.close()
    block = to_ipc_bytes(batches)
    return block, BlockMetadataWithSchema.from_block(block)


def _pull(transport, shard, topic, qid, offset, n, attempts: int = 20):
    import time
    for attempt in range(attempts):
        try:
            return transport.call(shard, "pull", [(topic, qid, offset, n)], 0, None, None,
                                  "read_committed", "spans", timeout_s=60)
        except RayMQError as err:  # its shard restarting: again
            if not err.retriable or attempt == attempts - 1:
                raise
            time.sleep(min(2.0, 0.1 * 2 ** attempt))
