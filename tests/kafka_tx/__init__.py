"""Tests of Kafka-style transactions: the coordinator, its state and log, a shard's side (``raymq.actors.kafka_tx``)."""
