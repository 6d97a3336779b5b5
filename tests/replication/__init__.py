"""Tests of replicated shards: the nemesis schedules, the group's rules, multi-node scenarios (``raymq.actors.replication``)."""
