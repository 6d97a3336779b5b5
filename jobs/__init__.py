"""RayMQ's data pipelines (``raymq.jobs``): committed messages as Ray Datasets, handed to
Spark through RayDP in the same cluster.

    from raymq.jobs import read_committed, spark_session
    batch = read_committed(mq, ["orders"], group="order-income")
    with spark_session(mq) as spark:
        df = batch.dataset.to_spark(spark)
"""
from raymq.jobs.read_committed import ReadBatch, job_transactional_id, read_committed
from raymq.jobs.schema import MESSAGE_SCHEMA
from raymq.jobs.spark_session import check_java, spark_session

__all__ = ["read_committed", "ReadBatch", "job_transactional_id", "MESSAGE_SCHEMA",
           "spark_session", "check_java"]
