"""``raymq kafka`` as an operator runs it: a process of its own that joins the cluster,
prints the bootstrap address, serves a Kafka client, and stops on Ctrl-C."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_the_kafka_command_joins_the_cluster_serves_a_client_and_stops_on_ctrl_c(mq, name):
    from kafka import KafkaConsumer
    from raymq import rpc
    mq.create_topic(name, 2)
    proc = subprocess.Popen([sys.executable, "-m", "raymq.tools.cli", "--address",
                             rpc.gcs_address(), "kafka", "--port", "0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        first = proc.stdout.readline()
        assert first.startswith("RayMQ Kafka listener: bootstrap.servers=127.0.0.1:"), \
            first + proc.stderr.read()
        boot = first.rsplit("=", 1)[1].strip()
        consumer = KafkaConsumer(bootstrap_servers=boot, request_timeout_ms=20_000)
        try:
            wait_for(lambda: name in consumer.topics(), what="the topic through the command")
            assert consumer.partitions_for_topic(name) == {0, 1}
        finally:
            consumer.close()
    finally:
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "kafka listener stopped" in err, err[-2000:]
