"""The order-income job of seed 002: income per minute and shop from the ``orders`` topic,
written to the ``income`` topic exactly once, whatever fails.

An order message's body is JSON with ``amount`` (an integer), a shop (``currency``, else
``shop``, else ``account``) and optionally ``ts_ms`` (when the order was placed; else the
message's ``born_ms``).  Each run reads the committed orders since the group's committed
offsets (``read_committed``), sums them per (minute, shop) in Spark, and writes one
message per (minute, shop) -- JSON ``{"minute", "shop", "income", "orders"}``, key
``shop@minute`` -- together with the input offsets in one transaction
(``write_transactionally``).  A minute's orders may arrive over several runs: each run
writes what its own input adds (a partial sum), and a minute's income is the sum of its
messages (``income_totals``).  A run with no new order writes nothing.
"""
from __future__ import annotations

import json
import logging
import time

from raymq.jobs.read_committed import read_committed
from raymq.jobs.write_back import write_transactionally
from raymq.storage.errors import UnknownTopicError

log = logging.getLogger("raymq.jobs")

SOURCE, TARGET, GROUP = "orders", "income", "order-income"


def income_rows(df):
    """Orders (a committed-message DataFrame) -> one row per (minute, shop): ``body``
    (JSON) and ``key``.  Bodies that are not orders (no integer ``amount``) are left out."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T
    order = T.StructType([T.StructField(n, t) for n, t in (
        ("amount", T.LongType()), ("currency", T.StringType()), ("shop", T.StringType()),
        ("account", T.LongType()), ("ts_ms", T.LongType()))])
    o = df.select(F.from_json(F.col("body").cast("string"), order).alias("o"), "born_ms")
    o = o.where(F.col("o.amount").isNotNull()).select(
        F.col("o.amount").alias("amount"),
        F.coalesce("o.currency", "o.shop", F.col("o.account").cast("string")).alias("shop"),
        (F.floor(F.coalesce("o.ts_ms", "born_ms") / 60000) * 60000).cast("long").alias("minute"))
    agg = o.groupBy("minute", "shop").agg(F.sum("amount").alias("income"),
                                          F.count(F.lit(1)).alias("orders"))
    return agg.select(F.to_json(F.struct("minute", "shop", "income", "orders")).alias("body"),
                      F.concat_ws("@", F.col("shop"), F.col("minute").cast("string"))
                      .alias("key"))


def run_once(mq, spark, *, source: str = SOURCE, target: str = TARGET,
             group: str = GROUP) -> dict:
    """One run: what it read and wrote (``{"orders_read", "messages", "seconds"}``)."""
    t0 = time.monotonic()
    try:
        mq.routes_for({target})
    except UnknownTopicError:  # a first run: its output topic comes with it
        mq.create_topic(target)
    batch = read_committed(mq, [source], group=group)
    if batch.empty:
        return {"orders_read": 0, "messages": 0, "seconds": round(time.monotonic() - t0, 2)}
    read = sum(batch.end_offsets[q] - batch.start_offsets[q] for q in batch.end_offsets)
    out = income_rows(batch.dataset.to_spark(spark))
    written = write_transactionally(mq, out, topic=target, group=group,
                                    offsets=batch.end_offsets)
    return {"orders_read": read, "messages": written, "seconds": round(time.monotonic() - t0, 2)}


def income_totals(messages) -> dict[tuple[int, str], dict]:
    """{(minute, shop): {"income", "orders"}} summed over the job's income messages."""
    totals: dict[tuple[int, str], dict] = {}
    for m in messages:
        row = json.loads(m.body)
        t = totals.setdefault((row["minute"], row["shop"]), {"income": 0, "orders": 0})
        t["income"] += row["income"]
        t["orders"] += row["orders"]
    return totals


def run(mq, spark, *, every_s: float | None = None, say=print, **names) -> None:
    """``run_once``, then again every ``every_s`` seconds until interrupted (None: once)."""
    while True:
        stats = run_once(mq, spark, **names)
        say(f"order-income: {stats['orders_read']} orders read, {stats['messages']} income "
            f"messages written with their offsets, in {stats['seconds']} s")
        if every_s is None:
            return
        time.sleep(every_s)
