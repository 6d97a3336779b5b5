"""A replicated RayMQ without Ray, for the operator's views of replica groups (``raymq
status``, ``raymq shard|coordinator elect``, the console's overview): the controller's
real ``ReplicaGroups`` on a manual clock behind a fake controller client, and ``Admin``
over it.  One group per kind, three replicas: replica 0 leads (log end 500), replica 1
is in sync (500), replica 2 is alive but out of sync (200); ``lose_in_sync()`` silences
replicas 0 and 1 for more than a lease."""
from __future__ import annotations

from types import SimpleNamespace

from raymq.actors.replication.groups import ReplicaGroups, replica_name
from raymq.client import Admin
from raymq.storage.clock import ManualClock

LEASE = 1000


class FakeControl:
    """The controller client's calls ``Admin`` makes about replica groups, answered as
    ``Controller`` answers them."""

    def __init__(self, groups: dict[str, ReplicaGroups]):
        self.groups = groups

    def call(self, method: str, *args, timeout_s: float | None = None):
        if method in ("replicas", "coordinator_replicas"):
            g = self.groups["shard" if method == "replicas" else "coordinator"]
            g.tick()
            return g.describe()
        if method == "replica_elect":
            shard, to, unclean, kind = args
            return self.groups[kind].elect(shard, to=to, unclean=unclean)
        raise AssertionError(f"unexpected controller call {method}{args}")


class Scene:
    def __init__(self):
        self.clock = ManualClock()
        self.groups = {kind: ReplicaGroups(1, 3, LEASE, self.clock, lambda: None, kind=kind)
                       for kind in ("shard", "coordinator")}
        self.forgotten: list[tuple[str, int]] = []
        mq = SimpleNamespace(num_shards=1,
                             config=SimpleNamespace(num_coordinators=1, replication_factor=3,
                                                    kafka_port=0),
                             control=FakeControl(self.groups),
                             forget_leader=lambda i: self.forgotten.append(("shard", i)),
                             forget_coordinator=lambda i: self.forgotten.append(
                                 ("coordinator", i)))
        self.admin = Admin(mq)
        mq.admin = self.admin
        self.mq = mq
        for kind, g in self.groups.items():
            r0, r1, r2 = (replica_name(0, k, kind) for k in range(3))
            g.heartbeat(0, r0, f"node-{r0}", 0, 500, None)  # the first: leads, epoch 1
            g.heartbeat(0, r1, f"node-{r1}", 1, 500, None)
            g.heartbeat(0, r2, f"node-{r2}", 1, 200, None)
            g.heartbeat(0, r0, f"node-{r0}", 1, 500, [r0, r1],
                        isr_version=g.describe()[0]["version"])

    def name(self, kind: str, k: int) -> str:
        return replica_name(0, k, kind)

    def lose_in_sync(self) -> None:
        """Replicas 0 and 1 go silent for more than a lease; replica 2 goes on."""
        self.clock.advance(LEASE + 1)
        for kind, g in self.groups.items():
            g.heartbeat(0, self.name(kind, 2), f"node-{self.name(kind, 2)}", 1, 200, None)
