"""The controller's side of replicated shards: for each shard's group of replicas, the
leader, its epoch and the in-sync set (durable, saved with the controller's metadata),
and which replicas are alive (soft: their heartbeats).  Elections happen here.

Rules (RocketMQ 5's controller, Kafka's KRaft controller):

- the first replica of a new group to heartbeat leads it, epoch 1;
- a leader whose process restarted (its disk may be new) hands over to another alive
  in-sync replica; with none, it leads again (new epoch) only holding what it had;
- a leader that has not heartbeated for ``lease_ms`` is replaced by an alive replica of
  the in-sync set (the one holding the most, then by name), the epoch bumped, the dead
  removed from the set; with no such replica the group waits (no unclean election
  unless an operator asks: ``elect(unclean=True)``);
- the in-sync set shrinks when the leader of the current epoch asks (``alter_isr``)
  or when a follower's lease runs out, and grows with what the leader reports in its
  heartbeat (a restarted replica only once it holds what the leader held);
- an operator moves leadership to another in-sync replica (``elect(to=...)``).

Pure logic: no Ray, time given by the clock.
"""
from __future__ import annotations

from typing import Callable

from raymq.storage.clock import Clock
from raymq.storage.errors import InvalidMessageError, NotEnoughReplicasError


def replica_name(shard: int, k: int, kind: str = "shard") -> str:
    """The actor name of replica ``k`` of shard (or coordinator: ``kind``) ``shard``."""
    return f"{kind}-{shard}-r{k}"


class ReplicaGroups:
    """The groups of ``num_shards`` shards of ``replication_factor`` replicas each.

    ``groups`` is the durable part as saved (``to_doc``); ``save`` is called (under the
    caller's lock) after every change of it, before the change is answered.
    """

    def __init__(self, num_shards: int, replication_factor: int, lease_ms: int,
                 clock: Clock, save: Callable[[], None], groups: dict | None = None,
                 kind: str = "shard"):
        self.num_shards, self.factor, self.lease_ms = num_shards, replication_factor, lease_ms
        self.clock, self.kind = clock, kind
        self._save = save
        self.groups: dict[str, dict] = {}
        for i in range(num_shards):
            g = (groups or {}).get(str(i)) or {"epoch": 0, "leader": None, "in_sync": []}
            g["replicas"] = [replica_name(i, k, kind) for k in range(replication_factor)]
            self.groups[str(i)] = g
        self._started = clock.monotonic_ms()
        self._seen: dict[str, int] = {}   # replica -> when it last heartbeated
        self._ends: dict[str, int] = {}   # replica -> its log end then
        self._nodes: dict[str, str] = {}  # replica -> its Ray node
        self._floor: dict[str, int] = {}  # restarted replica -> the end it must reach

    def to_doc(self) -> dict:
        return {i: {k: g[k] for k in ("epoch", "leader", "in_sync")}
                for i, g in self.groups.items()}

    def _group(self, shard: int) -> dict:
        g = self.groups.get(str(shard)) if isinstance(shard, int) else None
        if g is None:
            raise InvalidMessageError(f"no shard {shard!r} (0..{self.num_shards - 1})")
        return g

    @staticmethod
    def doc(g: dict) -> dict:
        return {"epoch": g["epoch"], "leader": g["leader"], "in_sync": list(g["in_sync"]),
                "replicas": list(g["replicas"])}

    def _alive(self, now: int) -> set[str]:
        return {r for r, t in self._seen.items() if now - t <= self.lease_ms}

    # ------------------------------------------------------------ replicas' calls
    def heartbeat(self, shard: int, name: str, node: str, epoch: int, log_end: int,
                  in_sync: list[str] | None, fresh: bool = False) -> dict:
        """A replica lives; the assignment of its group.  The leader of the current epoch
        reports its in-sync set: replicas it added join the controller's.  A ``fresh``
        replica (its process just started: its disk may be new) leaves the in-sync set
        unless it leads; it rejoins once caught up (Kafka's KIP-903 for the same)."""
        g = self._group(shard)
        if name not in g["replicas"]:
            raise InvalidMessageError(f"{name!r} is not a replica of {self.kind}-{shard}")
        now = self.clock.monotonic_ms()
        had = self._ends.get(name, -1)
        self._seen[name], self._ends[name], self._nodes[name] = now, int(log_end), node
        if g["leader"] is None and g["epoch"] == 0:
            g.update(epoch=1, leader=name, in_sync=[name])
            self._save()
        elif fresh and name == g["leader"]:
            self._leader_restarted(g, name, int(log_end), had)
        elif fresh and name != g["leader"]:
            # back in only once it holds what the leader held now (the leader may report
            # it in sync before it noticed the restart)
            self._floor[name] = self._ends.get(g["leader"], 0)
            if name in g["in_sync"]:
                g["in_sync"] = [r for r in g["in_sync"] if r != name]
                self._save()
        elif name == g["leader"] and epoch == g["epoch"] and in_sync:
            for r in [r for r in in_sync if r in self._floor]:
                if self._ends.get(r, -1) >= self._floor[r]:
                    del self._floor[r]
            grown = sorted((set(g["in_sync"]) | (set(in_sync) - set(self._floor)))
                           & set(g["replicas"]))
            if grown != g["in_sync"]:
                g["in_sync"] = grown
                self._save()
        self.tick()
        return self.doc(g)

    def _leader_restarted(self, g: dict, name: str, log_end: int, had: int) -> None:
        """The leader's process started again (its disk may be new): another in-sync
        replica leads if one lives; else it leads again, in a new epoch, only if it holds
        at least what it last reported -- otherwise the group waits for an in-sync replica
        (or an operator's unclean election)."""
        if self._elect(g, exclude={name}):
            self._floor[name] = self._ends.get(g["leader"], 0)
            g["in_sync"] = [r for r in g["in_sync"] if r != name]
            self._save()
        elif log_end >= had:
            g.update(epoch=g["epoch"] + 1)
            self._save()
        else:
            g.update(leader=None, in_sync=[r for r in g["in_sync"] if r != name])
            self._save()

    def alter_isr(self, shard: int, name: str, epoch: int,
                  in_sync: list[str]) -> tuple[bool, dict]:
        """The leader of ``epoch`` asks for the in-sync set ``in_sync``: (done?, assignment)."""
        g = self._group(shard)
        if name != g["leader"] or epoch != g["epoch"]:
            return False, self.doc(g)
        g["in_sync"] = sorted((set(in_sync) & set(g["replicas"])) | {name})
        self._save()
        return True, self.doc(g)

    # -------------------------------------------------------------- elections
    def tick(self) -> list[int]:
        """Elect a new leader wherever the leader's lease ran out; the shards that got one."""
        now = self.clock.monotonic_ms()
        out = []
        for i, g in self.groups.items():
            leader = g["leader"]
            if leader is None and g["epoch"] and self._elect(g, exclude=set()):
                out.append(int(i))  # (a group that had lost every in-sync replica)
                continue
            dead = [r for r in g["in_sync"] if r != leader
                    and now - self._seen.get(r, self._started) > self.lease_ms]
            if dead:  # (the leader adopts the smaller set at its next heartbeat)
                g["in_sync"] = [r for r in g["in_sync"] if r not in dead]
                self._save()
            if leader is not None and now - self._seen.get(leader, self._started) > self.lease_ms:
                if self._elect(g, exclude={leader}):
                    out.append(int(i))
        return out

    def elect(self, shard: int, *, to: str | None = None, unclean: bool = False) -> dict:
        """An operator moves leadership (to ``to``, else the best other in-sync replica);
        with ``unclean``, an alive replica out of the in-sync set may be chosen when no
        in-sync one lives (acknowledged writes may be lost: the operator's call)."""
        g = self._group(shard)
        now = self.clock.monotonic_ms()
        alive = self._alive(now)
        if to is not None and to not in g["replicas"]:
            raise InvalidMessageError(f"{to!r} is not a replica of shard-{shard} "
                                      f"({', '.join(g['replicas'])})")
        if not self._elect(g, exclude={g["leader"]} if to is None else set(), to=to,
                           unclean=unclean):
            raise NotEnoughReplicasError(
                f"shard-{shard}: no alive in-sync replica to lead"
                f"{f' ({to} is not one)' if to else ''}: in sync "
                f"{', '.join(g['in_sync']) or 'none'}, alive {', '.join(sorted(alive)) or 'none'}")
        return self.doc(g)

    def _elect(self, g: dict, *, exclude: set[str], to: str | None = None,
               unclean: bool = False) -> bool:
        alive = self._alive(self.clock.monotonic_ms())
        candidates = set(g["in_sync"]) & alive - exclude
        if not candidates and unclean:
            candidates = set(g["replicas"]) & alive - exclude
        if to is not None:
            candidates &= {to}
        if not candidates:
            return False
        new = max(sorted(candidates), key=lambda r: self._ends.get(r, -1))
        # the in-sync set keeps its alive members (a deposed leader alive among them)
        g.update(epoch=g["epoch"] + 1, leader=new,
                 in_sync=sorted((set(g["in_sync"]) & alive) | {new}))
        self._save()
        return True

    # ------------------------------------------------------------------ reads
    def leader(self, shard: int) -> tuple[str | None, int]:
        g = self._group(shard)
        return g["leader"], g["epoch"]

    def describe(self) -> list[dict]:
        """Per shard: leader, epoch, in-sync set and each replica's node and liveness."""
        now = self.clock.monotonic_ms()
        alive = self._alive(now)
        return [{"shard": int(i), **self.doc(g),
                 "nodes": {r: self._nodes.get(r, "") for r in g["replicas"]},
                 "alive": sorted(set(g["replicas"]) & alive),
                 "log_end": {r: self._ends.get(r, -1) for r in g["replicas"]}}
                for i, g in self.groups.items()]
