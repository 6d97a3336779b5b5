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


def test_a_listener_actor_on_each_node_serves_kafka_clients_until_raymq_goes_down(mq, name):
    """``kafka_port`` (``raymq up --kafka-port``, ``connect(kafka_port=...)``): a Ray actor
    on each node, reached at the node's address; a port that cannot be bound is said in
    one line; ``raymq down`` stops them with the rest."""
    import socket
    from confluent_kafka import Consumer, Producer, TopicPartition
    from raymq import rpc
    from raymq.deploy import NAMESPACE, kafka_listeners
    from raymq.storage.errors import RayMQError
    from raymq.wire.actor import LISTENER_PREFIX
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    [(host, got_port)] = kafka_listeners(port)
    try:
        assert (host, got_port) == (rpc.node_ip(), port)
        assert mq.kafka_bootstrap() == f"{host}:{port}"
        assert kafka_listeners(port) == [(host, port)]  # (there: not made again)
        mq.create_topic(name, 1)
        p = Producer({"bootstrap.servers": mq.kafka_bootstrap()})
        p.produce(name, value=b"through the node's listener", partition=0)
        assert p.flush(30) == 0
        del p
        c = Consumer({"bootstrap.servers": mq.kafka_bootstrap(), "group.id": name})
        c.assign([TopicPartition(name, 0, 0)])
        m = wait_for(lambda: c.poll(0.5), what="the message back")
        assert m.value() == b"through the node's listener"
        c.close()
    finally:
        for n in rpc.named_actors(NAMESPACE):
            if n.startswith(LISTENER_PREFIX):
                rpc.kill(rpc.get_actor(n, NAMESPACE))
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        with pytest.raises(RayMQError, match="cannot listen on port .*in use"):
            kafka_listeners(busy.getsockname()[1])
    assert not [n for n in rpc.named_actors(NAMESPACE) if n.startswith(LISTENER_PREFIX)]
