"""The Kafka listener as a Ray actor: one on each node RayMQ runs on (``kafka_port``),
bound on all of the node's addresses and advertised at the node's IP.  Thin: it joins
RayMQ as any client does (``connect``) and serves a ``KafkaListener`` over it."""
from __future__ import annotations

from raymq import rpc

#: Each listener's actor name: this, then the start of its node's id.
LISTENER_PREFIX = "kafka-listener-"


def listener_name(node: str) -> str:
    return LISTENER_PREFIX + node[:16]


class KafkaListenerActor:
    def __init__(self):
        from raymq.client import connect
        self._mq = connect(deploy=False)
        self._host = rpc.node_ip()
        self._listener = None

    def start(self, port: int) -> tuple[str, int]:
        """Listen on ``port`` (once); where clients reach it (``bootstrap.servers``).
        ``ConfigError`` when the port cannot be listened on."""
        from raymq.storage.errors import ConfigError
        from raymq.wire.listener import KafkaListener
        if self._listener is None:
            try:
                self._listener = KafkaListener(self._mq, "0.0.0.0", port,
                                               advertised_host=self._host).start()
            except OSError as err:
                raise ConfigError(f"the Kafka listener on node {self._host} cannot listen on "
                                  f"port {port}: {err.strerror or err} (kafka_port)") from None
        return self.address()

    def address(self) -> tuple[str, int]:
        if self._listener is None:
            raise RuntimeError("not listening")
        return self._host, self._listener.address[1]

    def close(self) -> None:
        if self._listener is not None:
            self._listener.stop()
        self._mq.close()
