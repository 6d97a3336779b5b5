"""The Kafka listener in front of the session cluster, for the tests of real Kafka clients
(a test module may define its own ``listener``, in front of a cluster of its own)."""
from __future__ import annotations

import pytest

from raymq.wire.listener import KafkaListener


@pytest.fixture
def listener(mq):
    lst = KafkaListener(mq, port=0).start()
    yield lst
    lst.stop()
