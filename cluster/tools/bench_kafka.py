"""``raymq bench kafka``: Kafka clients through the Kafka listener against the SDK (issue 36).

On an embedded RayMQ (two shards, sync flush) with a listener in this process:

- ``kafka.produce_ratio``: confluent-kafka (librdkafka) producing 256 B messages with its
  default batching (``acks=all``) over the SDK's ``send_batch`` of the same messages, in
  alternating slices (target >= 0.5);
- ``kafka.consume_ratio``: confluent-kafka reading a partition to its end over the SDK's
  consumer reading the same (target >= 0.5);
- ``kafka.p99_send_ms``: the p99 latency of single acknowledged sends through the
  listener (reported).

``kafka.eos_ratio`` (a transactional copy loop) waits for the listener's transactions.
"""
from __future__ import annotations

import os
import time

import numpy as np

from raymq.tools.bench import Bench, _bench_cluster, _teardown_cluster, suite

_SIZE = 256


@suite("kafka")
def bench_kafka(b: Bench) -> None:
    from confluent_kafka import Producer

    from raymq.message import Message
    from raymq.wire.listener import KafkaListener
    mq, data = _bench_cluster(b, "kafka")
    listener = KafkaListener(mq, port=0).start()
    boot = "%s:%d" % listener.address
    try:
        mq.create_topic("bench", queues=2)
        body = os.urandom(_SIZE)
        n, slices = b.n(100_000, 5_000), 3
        kp = Producer({"bootstrap.servers": boot, "acks": "all"})
        sdk = mq.producer("bench")
        batch = [Message("bench", body) for _ in range(1000)]

        def kafka_slice():
            for i in range(n):
                while True:
                    try:
                        kp.produce("bench", value=body, partition=i % 2)
                        break
                    except BufferError:  # (its queue full: let it send)
                        kp.poll(0.01)
            kp.flush(120)

        def sdk_slice():
            for _ in range(n // 1000):
                sdk.send_batch(batch)
        b.progress(f"kafka: {slices} alternating slices of {n} messages of {_SIZE} B, "
                   f"confluent-kafka through the listener and the SDK")
        kafka_slice()  # (warm-up: metadata, connections)
        took = {"kafka": 0.0, "sdk": 0.0}
        for _ in range(slices):
            for name, fn in (("kafka", kafka_slice), ("sdk", sdk_slice)):
                t0 = time.perf_counter()
                fn()
                took[name] += time.perf_counter() - t0
        total = slices * n
        b.emit("kafka.produce_confluent", total / took["kafka"], "msgs/s", n=total, size=_SIZE,
               acks="all", batching="librdkafka defaults")
        b.emit("kafka.produce_sdk", total / took["sdk"], "msgs/s", n=total, size=_SIZE,
               batch=1000)
        b.ratio("kafka.produce_ratio", "kafka.produce_confluent", "kafka.produce_sdk")
        _consume(b, mq, boot, n)
        _p99(b, kp, b.n(2000, 200))
        sdk.close()
    finally:
        listener.stop()
        _teardown_cluster(data)


def _consume(b: Bench, mq, boot: str, n: int) -> None:
    """Partition 0 read to its end by confluent-kafka, then by the SDK's consumer."""
    from confluent_kafka import Consumer, TopicPartition
    [(_t, _q, _b, _n, end)] = mq.shard(mq.routes_for({"bench"})["bench"][0]).call(
        "pull", [("bench", 0, 0, 1)], 0, None, None, "read_uncommitted", timeout_s=60)
    b.progress(f"kafka: partition 0 ({end} messages) read by confluent-kafka and the SDK")
    c = Consumer({"bootstrap.servers": boot, "group.id": "bench-kafka",
                  "enable.auto.commit": False})
    c.assign([TopicPartition("bench", 0, 0)])
    got, t0 = 0, time.perf_counter()
    while got < end:
        got += len(c.consume(10_000, 1.0))
    kafka_s = time.perf_counter() - t0
    c.close()
    sdk = mq.consumer("bench-sdk", ["bench"], isolation="read_uncommitted")
    got, t0 = 0, time.perf_counter()
    while got < end:
        got += sum(1 for m in sdk.poll(10_000, 1.0) if m.queue_id == 0)
        if time.perf_counter() - t0 > 300:
            break
    sdk_s = time.perf_counter() - t0
    sdk.close()
    b.emit("kafka.consume_confluent", end / kafka_s, "msgs/s", n=end)
    b.emit("kafka.consume_sdk", end / sdk_s, "msgs/s", n=end,
           note="the SDK's group consumer reads both queues; partition 0's are counted")
    b.ratio("kafka.consume_ratio", "kafka.consume_confluent", "kafka.consume_sdk")


def _p99(b: Bench, kp, n: int) -> None:
    b.progress(f"kafka: {n} single acknowledged sends through the listener")
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        kp.produce("bench", value=b"x" * _SIZE, partition=0)
        kp.flush(30)
        lat.append(time.perf_counter() - t0)
    b.emit("kafka.p99_send_ms", 1000 * float(np.percentile(lat, 99)), "ms", n=n,
           p50_ms=round(1000 * float(np.percentile(lat, 50)), 3))
