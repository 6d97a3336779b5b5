"""A DataFrame's rows written back to RayMQ with the job's input offsets in one Kafka-style
transaction: ``write_transactionally(mq, df, topic=..., group=..., offsets=...)``.

Rows: a ``body`` column (binary, or string: UTF-8), optional ``key`` and ``tags``
(strings).  Spark hands the rows to Ray (``raydp.spark.from_spark_recoverable``: the
executors cache Arrow batches, Ray tasks fetch them into the object store), and they
stream to the broker ``batch_rows`` at a time -- no process ever holds the whole result.
The transaction begins only after Spark has run, so it stays short.  The producer is the
group's job producer, fenced when ``read_committed`` read the input (a run killed before
its commit is aborted by the next run's fencing: its results are never seen by
read_committed readers, and its input is read again).
"""
from __future__ import annotations

import logging

from raymq.jobs.read_committed import job_producer
from raymq.message import Message
from raymq.storage.errors import InvalidMessageError

log = logging.getLogger("raymq.jobs")


def write_transactionally(mq, df, *, topic: str, group: str, offsets: dict,
                          producer=None, batch_rows: int = 5000) -> int:
    """Write ``df``'s rows to ``topic`` and commit ``group``'s ``offsets`` (what the input
    read: ``ReadBatch.end_offsets``) in one transaction; the number of messages."""
    if "body" not in df.columns:
        raise InvalidMessageError(f"write_transactionally needs a 'body' column; the rows have "
                                  f"{df.columns}")
    import raydp.spark
    kp = producer or job_producer(mq, group)
    src = df.select(*[c for c in ("body", "key", "tags") if c in df.columns])
    ds = raydp.spark.from_spark_recoverable(src)
    written = 0
    try:
        with kp.transaction():
            for t in ds.iter_batches(batch_format="pyarrow", batch_size=batch_rows):
                bodies = [b.encode() if isinstance(b, str) else b
                          for b in t.column("body").to_pylist()]
                keys = t.column("key").to_pylist() if "key" in t.column_names else None
                tags = t.column("tags").to_pylist() if "tags" in t.column_names else None
                kp.send_batch([Message(topic, b, key=keys[i] if keys else None,
                                       tags=tags[i] if tags else None)
                               for i, b in enumerate(bodies)])
                written += len(bodies)
            kp.send_offsets(offsets, group=group)
    finally:
        raydp.spark.release_spark_recoverable(src)
    log.info("job %s: %d messages to %s committed with its input offsets", group, written, topic)
    return written
