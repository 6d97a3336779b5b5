"""Kafka clients against the listener in front of the session cluster (issue 36): a real
client (kafka-python, none of ours) bootstraps, negotiates the API versions and sees
the cluster's user topics with their queues as partitions -- system, retry and
dead-letter topics not listed."""
from __future__ import annotations

import pytest

from raymq.wire.listener import KafkaListener
from tests.helpers import wait_for

pytestmark = pytest.mark.ray


@pytest.fixture
def listener(mq):
    lst = KafkaListener(mq, port=0).start()
    yield lst
    lst.stop()


def test_a_kafka_client_bootstraps_and_sees_the_topics_as_raymq_has_them(mq, name, listener):
    from kafka import KafkaConsumer
    mq.create_topic(name, 3)
    mq.ensure_group_topics(name + "g")  # (a retry and a dead-letter topic: never listed)
    consumer = KafkaConsumer(bootstrap_servers="%s:%d" % listener.address,
                             request_timeout_ms=20_000)
    try:
        topics = wait_for(lambda: name in (t := consumer.topics()) and t,
                          what="the topic in the client's metadata")
        assert not any(t.startswith(("RMQ_SYS_", "%RETRY%", "%DLQ%")) for t in topics)
        assert consumer.partitions_for_topic(name) == {0, 1, 2}
        assert not consumer.partitions_for_topic(name + "nope")  # (unknown: none)
    finally:
        consumer.close()
