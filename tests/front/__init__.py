"""Tests of the shard's front: request checks, reads, quotas, bad input (``raymq.actors.front``)."""
