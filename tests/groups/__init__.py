"""Tests of consumer groups: membership, offsets, retries and dead letters (``raymq.actors.groups``)."""
