"""Tests of the data channel and the client's transport over it (``raymq.actors.channel``)."""
