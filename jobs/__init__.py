"""RayMQ's data pipelines (``raymq.jobs``): committed messages as Ray Datasets, handed to
Spark through RayDP in the same cluster.

    from raymq.jobs import read_committed, spark_session
    batch = read_committed(mq, ["orders"], group="order-income")
    with spark_session(mq) as spark:
        df = batch.dataset.to_spark(spark)
        out = ...                                   # any PySpark
        write_transactionally(mq, out, topic="income", group="order-income",
                              offsets=batch.end_offsets)
"""
from raymq.jobs.read_committed import (ReadBatch, job_producer, job_transactional_id,
                                      read_committed)
from raymq.jobs.schema import MESSAGE_SCHEMA
from raymq.jobs.spark_session import check_java, spark_session
from raymq.jobs.write_back import write_transactionally

__all__ = ["read_committed", "write_transactionally", "spark_session", "ReadBatch",
           "job_producer", "job_transactional_id", "MESSAGE_SCHEMA", "check_java"]
