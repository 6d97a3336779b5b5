"""Tests of delay levels and timer messages (``raymq.actors.timing``)."""
