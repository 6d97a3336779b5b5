"""``raymq bench kafka``: Kafka clients through the Kafka listener against the SDK (issue 36).

On an embedded RayMQ (two shards, sync flush) with its node's Kafka listener (an actor of
its own, as ``kafka_port`` deploys it), the clients in this process:

- ``kafka.produce_ratio``: confluent-kafka (librdkafka) producing 256 B messages with its
  default batching (``acks=all``) over the SDK's ``send_batch`` of the same messages, in
  alternating slices (target >= 0.5);
- ``kafka.consume_ratio``: confluent-kafka reading the topic to its end over the SDK's
  consumer reading the same (target >= 0.5);
- ``kafka.p99_send_ms``: the p99 latency of single acknowledged sends through the
  listener (reported).

- ``kafka.eos_ratio``: a confluent-kafka transactional copy loop (read_committed input,
  the output and the input's offsets in a transaction committed every 100 ms) over the
  same loop through the SDK (a group consumer, ``transactional_producer``, ``send_offsets``)
  (target >= 0.8).
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

    from raymq.deploy import kafka_listeners
    from raymq.message import Message
    mq, data = _bench_cluster(b, "kafka")
    try:
        [(host, port)] = kafka_listeners(_free_port())  # (its own process, as deployed)
        boot = f"{host}:{port}"
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
        _consume(b, mq, boot)
        _p99(b, kp, b.n(2000, 200))
        del kp  # (its connection closed before the listener goes)
        _eos(b, mq, boot, b.n(200_000, 10_000))
        sdk.close()
    finally:
        _teardown_cluster(data)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _consume(b: Bench, mq, boot: str) -> None:
    """The topic read to its end (both partitions) by confluent-kafka, then by the SDK's
    consumer."""
    from confluent_kafka import Consumer, TopicPartition
    end = 0
    for q in range(2):
        [(_t, _q, _b, _n, e)] = mq.shard(mq.routes_for({"bench"})["bench"][q]).call(
            "pull", [("bench", q, 0, 1)], 0, None, None, "read_uncommitted", timeout_s=60)
        end += e
    b.progress(f"kafka: the topic ({end} messages) read by confluent-kafka and the SDK")
    c = Consumer({"bootstrap.servers": boot, "group.id": "bench-kafka",
                  "enable.auto.commit": False})
    c.assign([TopicPartition("bench", q, 0) for q in range(2)])
    got, t0 = 0, time.perf_counter()
    while got < end:
        got += len(c.consume(10_000, 1.0))
    kafka_s = time.perf_counter() - t0
    c.close()
    sdk = mq.consumer("bench-sdk", ["bench"], isolation="read_uncommitted")
    got = 0
    while not got:  # (its group joined first: confluent-kafka's partitions are assigned)
        got = len(sdk.poll(1, 1.0))
    t0 = time.perf_counter()
    while got < end and time.perf_counter() - t0 < 300:
        got += len(sdk.poll(10_000, 1.0))
    sdk_s = time.perf_counter() - t0
    sdk.close()
    b.emit("kafka.consume_confluent", end / kafka_s, "msgs/s", n=end, partitions=2)
    b.emit("kafka.consume_sdk", end / sdk_s, "msgs/s", n=end, queues=2)
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


def _eos(b: Bench, mq, boot: str, n: int, slices: int = 4) -> None:
    """The copy loop of ``n`` messages, through the listener and through the SDK, in
    alternating slices (a change of the machine's pace hits both)."""
    from raymq.message import Message
    mq.create_topic("eos-in", queues=2)
    for name in ("eos-out-kafka", "eos-out-sdk"):
        mq.create_topic(name, queues=2)
    body = os.urandom(_SIZE)
    p = mq.producer("bench-eos-in")
    for k in range(n // 1000):
        p.send_batch([Message("eos-in", body, key=str(k * 1000 + i)) for i in range(1000)])
    p.close()
    b.progress(f"kafka: a copy loop of {n} messages committing every 100 ms, with "
               f"confluent-kafka through the listener and with the SDK, {slices} "
               f"alternating slices")
    loops = {"kafka": _KafkaCopy(boot), "sdk": _SdkCopy(mq)}
    took = dict.fromkeys(loops, 0.0)
    for _ in range(slices):
        for name, loop in loops.items():
            took[name] += loop.copy(n // slices)
    for name, loop in loops.items():
        b.emit(f"kafka.eos_{'confluent' if name == 'kafka' else 'sdk'}", n / took[name],
               "msgs/s", n=n, transactions=loop.txns, commit_interval_ms=100, slices=slices)
        loop.close()
    b.ratio("kafka.eos_ratio", "kafka.eos_confluent", "kafka.eos_sdk")


class _KafkaCopy:
    """confluent-kafka's consume-transform-produce loop (read_committed in, the output and
    the input's offsets in a transaction committed every 100 ms)."""

    def __init__(self, boot: str):
        from confluent_kafka import Consumer, Producer, TopicPartition
        self.c = Consumer({"bootstrap.servers": boot, "group.id": "bench-eos-kafka",
                           "isolation.level": "read_committed", "enable.auto.commit": False})
        self.c.assign([TopicPartition("eos-in", q, 0) for q in range(2)])
        self.p = Producer({"bootstrap.servers": boot, "transactional.id": "bench-eos-kafka"})
        self.p.init_transactions(60)
        self.txns = 0

    def copy(self, n: int) -> float:
        """Copy ``n`` more; the seconds it took from the first one read."""
        p, c = self.p, self.c
        p.begin_transaction()
        copied, t0, last = 0, None, 0.0
        while copied < n:
            msgs = [m for m in c.consume(min(1000, n - copied), 0.2) if m.error() is None]
            if t0 is None and msgs:
                t0 = last = time.perf_counter()
            for m in msgs:
                while True:
                    try:
                        p.produce("eos-out-kafka", value=m.value(), partition=m.partition())
                        break
                    except BufferError:  # (its queue full: let it send)
                        p.poll(0.01)
            copied += len(msgs)
            if msgs and (time.perf_counter() - last >= 0.1 or copied >= n):
                p.send_offsets_to_transaction(c.position(c.assignment()),
                                              c.consumer_group_metadata(), 60)
                p.commit_transaction(60)
                self.txns += 1
                if copied < n:
                    p.begin_transaction()
                last = time.perf_counter()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.c.close()
        del self.p


class _SdkCopy:
    """The same loop through the SDK: a group consumer, ``transactional_producer``,
    ``send_offsets``."""

    def __init__(self, mq):
        self.c = mq.consumer("bench-eos-sdk", ["eos-in"], auto_commit=False)
        self.kp = mq.transactional_producer("bench-eos-sdk")
        self.txns = 0
        self._early: list = []

    def copy(self, n: int) -> float:
        from raymq.message import Message
        c, kp = self.c, self.kp
        kp.begin()
        copied, t0, last, offsets = 0, None, 0.0, {}
        while copied < n:
            msgs = self._early or c.poll(min(1000, n - copied), 0.2)
            self._early = []
            if len(msgs) > n - copied:  # (a poll may give more: the rest for the next slice)
                msgs, self._early = msgs[:n - copied], msgs[n - copied:]
            if t0 is None and msgs:
                t0 = last = time.perf_counter()
            if msgs:
                kp.send_batch([Message("eos-out-sdk", m.body) for m in msgs])
                for m in msgs:
                    offsets[(m.topic, m.queue_id)] = m.queue_offset + 1
            copied += len(msgs)
            if msgs and (time.perf_counter() - last >= 0.1 or copied >= n):
                kp.send_offsets(offsets, group="bench-eos-sdk")
                kp.commit()
                self.txns += 1
                if copied < n:
                    kp.begin()
                last = time.perf_counter()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.kp.close()
        self.c.close()
