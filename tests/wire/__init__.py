"""Tests of the Kafka wire-protocol listener (issue 36)."""
