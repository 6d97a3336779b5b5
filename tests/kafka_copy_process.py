"""A Kafka transactional copy loop in its own process (confluent-kafka, through a
listener), for a test that kills it at random points.

python -m tests.kafka_copy_process BOOTSTRAP SOURCE DESTINATION GROUP TRANSACTIONAL_ID PAUSE_S
Copies SOURCE to DESTINATION, uppercased, with the input's offsets in each transaction
(a few messages each, PAUSE_S seconds between its writes and its commit: a kill lands
in the middle of one more often), for ever; prints a line per commit.
"""
from __future__ import annotations

import sys
import time

from confluent_kafka import Consumer, Producer


def main() -> None:
    boot, src, dst, group, tid, pause = sys.argv[1:7]
    c = Consumer({"bootstrap.servers": boot, "group.id": group, "enable.auto.commit": False,
                  "isolation.level": "read_committed", "auto.offset.reset": "earliest",
                  "session.timeout.ms": 6000, "heartbeat.interval.ms": 300})
    c.subscribe([src])
    p = Producer({"bootstrap.servers": boot, "transactional.id": tid, "linger.ms": 1})
    p.init_transactions(60)
    print("ready", flush=True)
    while True:
        msgs = [m for m in c.consume(7, 0.2) if m.error() is None]
        if not msgs:
            continue
        p.begin_transaction()
        for m in msgs:
            p.produce(dst, value=m.value().upper(), partition=m.partition())
        time.sleep(float(pause))
        p.send_offsets_to_transaction(c.position(c.assignment()), c.consumer_group_metadata(),
                                      60)
        p.commit_transaction(60)
        print(f"committed {len(msgs)}", flush=True)


if __name__ == "__main__":
    main()
