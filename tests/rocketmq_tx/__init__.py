"""Tests of RocketMQ-style transactions: halves, check-backs, their pure rules (``raymq.actors.rocketmq_tx``)."""
