"""When written data counts as durable: group commit, flushes, checkpoints.
Owns commit-log fsyncs, the stop-after-a-failed-write latch, checkpoint writing, the flush loop.

Concurrent waiters share fsyncs (group commit): the first waiter flushes for
everybody written so far, the others wait for it.  A failed fsync or a put
left half written stops the store (``Durability.failed``): nothing written
since may be acknowledged, and no checkpoint is written, until a restart
recovers from the log.  The checkpoint records an offset below which every
consume-queue entry is durable, and a snapshot of the producer table.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Callable, Iterable

from raymq.storage import steps
from raymq.storage.clock import Clock
from raymq.storage.commitlog import CommitLog
from raymq.storage.consumequeue import ConsumeQueue
from raymq.storage.errors import StorageError
from raymq.storage.faults import crash_point
from raymq.storage.fileutil import atomic_write

log = logging.getLogger("raymq.storage")

CHECKPOINT_FORMAT = "raymq-checkpoint"


class Durability:
    """Group commit over one commit log, and the store's failure latch.  Thread-safe."""

    def __init__(self, directory: str, commit_log: CommitLog, clock: Clock,
                 flush_timeout_ms: int):
        self.directory = directory
        self._log = commit_log
        self.clock = clock
        self.flush_timeout_ms = flush_timeout_ms
        self.failed: BaseException | None = None
        self._flush_cond = threading.Condition()
        self._flushing = False

    # ------------------------------------------------------------ failures
    def fail(self, err: BaseException, what: str) -> None:
        """Stop accepting writes until a restart (which recovers from the log)."""
        if self.failed is None:
            self.failed = err
            log.error("store %s: %s (%s); refusing further writes until restart",
                      self.directory, what, err)

    def stopped(self) -> StorageError:
        return StorageError(f"store {self.directory} stopped after a failed write "
                            f"({self.failed}); restart it to recover")

    # -------------------------------------------------------------- fsyncs
    def sync_log(self) -> int:
        """fsync the commit log.  A failed fsync stops the store: Linux may drop the pages
        it could not write and report the next fsync as a success, so nothing written
        since the last good one may be acknowledged any more."""
        try:
            return self._log.sync()
        except OSError as err:
            self.fail(err, "fsync of the commit log failed")
            raise

    def wait_flushed(self, target: int) -> bool:
        """Group commit: return once an fsync covers ``target`` (False on timeout)."""
        deadline = self.clock.monotonic_ms() + self.flush_timeout_ms
        with self._flush_cond:
            while self._log.flushed_offset < target:
                if self.failed is not None:
                    raise self.stopped()
                if self._flushing:
                    remaining = deadline - self.clock.monotonic_ms()
                    if remaining <= 0:
                        return False
                    self._flush_cond.wait(remaining / 1000.0)
                    steps.mark("fsync.waited")  # (another put's fsync, or part of one)
                    continue
                self._flushing = True
                break
            else:
                return True
        steps.mark("fsync.begin")
        try:
            self.sync_log()
        finally:
            self._done_flushing()
        steps.mark("fsync.done")
        return self._log.flushed_offset >= target and self.clock.monotonic_ms() <= deadline

    def make_durable(self) -> None:
        """Return once everything written so far is durable (group commit; nothing to do
        when it already is, as after every put in sync mode)."""
        target = self._log.max_offset
        if self._log.flushed_offset < target and not self.wait_flushed(target):
            raise StorageError(f"store {self.directory}: fsync did not complete within "
                               f"{self.flush_timeout_ms} ms")

    def flush(self) -> int:
        """fsync the commit log now; return the durable offset."""
        with self._flush_cond:
            while self._flushing:
                self._flush_cond.wait()
            self._flushing = True
        try:
            return self.sync_log()
        finally:
            self._done_flushing()

    def _done_flushing(self) -> None:
        with self._flush_cond:
            self._flushing = False
            self._flush_cond.notify_all()


def write_checkpoint(path: str, offset: int, queues: Iterable[ConsumeQueue],
                     producers: dict[str, list[int]], *, rebuilding: bool = False) -> None:
    """fsync the consume ``queues``, then record ``offset`` and ``producers`` atomically.

    ``offset``: every consume-queue entry of a record below it is durable;
    ``producers``: a ``ProducerTable.snapshot()`` covering durable puts only;
    ``rebuilding``: the consume queues are being rebuilt, none of them is to be trusted
    (a start that reads this rebuilds them again).
    """
    for cq in queues:
        cq.sync()
    crash_point("checkpoint.queues_synced")
    doc = {"format": CHECKPOINT_FORMAT, "version": 1, "consume_queue_offset": offset,
           "producers": producers}
    if rebuilding:
        doc["rebuilding"] = True
    atomic_write(path, json.dumps(doc).encode(), label="checkpoint")


class FlushLoop:
    """The background thread: every ``interval_ms``, ``flush`` (if given) and then
    ``checkpoint`` when ``written_end()`` moved since the last checkpoint.

    A failing round is logged and retried the next round: the loop never dies.
    """

    def __init__(self, directory: str, interval_ms: int, *, flush: Callable[[], int] | None,
                 checkpoint: Callable[[], int], written_end: Callable[[], int]):
        self.directory = directory
        self.interval_ms = interval_ms
        self._flush = flush
        self._checkpoint = checkpoint
        self._written_end = written_end
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raymq-flush", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and wait for a round under way to end."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        interval = self.interval_ms / 1000.0
        last_ckpt = -1
        while not self._stop.wait(interval):
            try:
                if self._flush is not None:
                    self._flush()
                if self._written_end() != last_ckpt:
                    last_ckpt = self._checkpoint()
            except Exception:  # the loop must not die; the next round retries
                log.exception("store %s: background flush failed", self.directory)
