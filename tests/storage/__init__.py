"""Tests of the store: commit log, consume queues, recovery, crash points, repair (``raymq.storage``)."""
