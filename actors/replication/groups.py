"""The controller's side of replicated shards: for each shard's group of replicas, the
leader, its epoch and the in-sync set (durable, saved with the controller's metadata),
and which replicas are alive (soft: their heartbeats).  Elections happen here.

Rules (RocketMQ 5's controller, Kafka's KRaft controller, KIP-966):

- every change of a group (leader, epoch, in-sync set) bumps its ``version`` (Kafka's
  partition epoch); an in-sync change asked with another version is refused, and the
  in-sync set grows only with what the leader of the current epoch asks for at the
  current version (a stale heartbeat never re-grows it);
- a replica may lead only if its log holds the epoch it was in sync as of (``joined``:
  Raft's up-to-date rule): a replica whose disk was replaced (no epochs) never leads
  again before it copied the log back; among candidates the one with the newest epoch,
  then the most log, leads (RocketMQ's ``electMaster``);
- every replica keeps the last assignment it was told beside its log (``group.json``)
  and reports it: a controller that lost its files (or never had any) elects nobody in
  a group until every replica reported (a new group: none knows an epoch; the first to
  heartbeat leads, epoch 1) or the newest reported assignment's in-sync replicas did
  (it is taken, and goes on from there);
- a leader whose process restarted (its disk may be new) hands over to another alive
  in-sync replica; with none, it leads again (new epoch) only holding what it had;
- a leader that has not heartbeated for ``lease_ms`` is replaced by an alive, eligible
  replica of the in-sync set, the epoch bumped, the dead removed from the set; with no
  such replica the group waits -- keeping its in-sync set, so that the first of them to
  come back leads (RocketMQ keeps dead members in its SyncStateSet for this); no
  unclean election unless an operator asks (``elect(unclean=True)``);
- the in-sync set shrinks when the leader of the current epoch asks (``alter_isr``)
  or when a follower's lease runs out while the leader lives, and grows when the
  leader asks (a restarted replica only once it holds what the leader held);
- an operator moves leadership to another in-sync replica (``elect(to=...)``).

Pure logic: no Ray, time given by the clock.
"""
from __future__ import annotations

from typing import Callable

from raymq.actors.replication.in_sync import choose_leader
from raymq.storage.clock import Clock
from raymq.storage.errors import InvalidMessageError, NotEnoughReplicasError


def replica_name(shard: int, k: int, kind: str = "shard") -> str:
    """The actor name of replica ``k`` of shard (or coordinator: ``kind``) ``shard``."""
    return f"{kind}-{shard}-r{k}"


class ReplicaGroups:
    """The groups of ``num_shards`` shards of ``replication_factor`` replicas each.

    ``groups`` is the durable part as saved (``to_doc``); ``save`` is called (under the
    caller's lock) after every change of it, before the change is answered.  ``known``:
    whether ``groups`` is the controller's own record (False: its files were lost, or
    never written -- each group's state is taken from what its replicas report).
    """

    def __init__(self, num_shards: int, replication_factor: int, lease_ms: int,
                 clock: Clock, save: Callable[[], None], groups: dict | None = None,
                 kind: str = "shard", known: bool = True):
        self.num_shards, self.factor, self.lease_ms = num_shards, replication_factor, lease_ms
        self.clock, self.kind = clock, kind
        self._save = save
        self.groups: dict[str, dict] = {}
        for i in range(num_shards):
            doc = (groups or {}).get(str(i))
            g = dict(doc) if doc else {"epoch": 0, "leader": None, "in_sync": []}
            g.setdefault("version", 0)
            g.setdefault("joined", {r: 0 for r in g["in_sync"]})
            g["replicas"] = [replica_name(i, k, kind) for k in range(replication_factor)]
            g["known"] = bool(doc) or known
            self.groups[str(i)] = g
        self._started = clock.monotonic_ms()
        self._seen: dict[str, int] = {}   # replica -> when it last heartbeated
        self._ends: dict[str, int] = {}   # replica -> its log end then
        self._log_epochs: dict[str, int] = {}  # replica -> the latest epoch its log holds
        self._reported: dict[str, dict | None] = {}  # replica -> the assignment it keeps
        self._nodes: dict[str, str] = {}  # replica -> its Ray node
        self._floor: dict[str, int] = {}  # restarted replica -> the end it must reach
        #: a replica an operator elected uncleanly -> that epoch: it leads although its
        #: log lacks the epoch it joined at, until it took over (its log then holds it)
        self._unclean: dict[str, int] = {}

    def to_doc(self) -> dict:
        return {i: {k: g[k] for k in ("epoch", "leader", "in_sync", "version", "joined")}
                for i, g in self.groups.items() if g["known"]}

    def _group(self, shard: int) -> dict:
        g = self.groups.get(str(shard)) if isinstance(shard, int) else None
        if g is None:
            raise InvalidMessageError(f"no shard {shard!r} (0..{self.num_shards - 1})")
        return g

    @staticmethod
    def doc(g: dict) -> dict:
        return {"epoch": g["epoch"], "leader": g["leader"], "in_sync": list(g["in_sync"]),
                "replicas": list(g["replicas"]), "version": g["version"],
                "joined": dict(g["joined"])}

    def _lives(self, replica: str | None, now: int) -> bool:
        return replica is not None and now - self._seen.get(replica, self._started) <= \
            self.lease_ms

    def _alive(self, now: int) -> set[str]:
        return {r for r, t in self._seen.items() if now - t <= self.lease_ms}

    def _changed(self, g: dict, **values) -> None:
        """Change the group (a new version), durably."""
        g.update(values)
        g["joined"] = {r: g["joined"].get(r, g["epoch"]) for r in g["in_sync"]}
        g["version"] += 1
        self._save()

    def eligible(self, g: dict, r: str) -> bool:
        """Whether replica ``r``'s log holds the epoch it was in sync as of (its latest
        epoch not reported: taken as holding it)."""
        held = self._log_epochs.get(r)
        return held is None or held >= g["joined"].get(r, 0)

    def _may_lead(self, g: dict, r: str) -> bool:
        """Whether leader ``r`` may go on leading: eligible, or elected by an operator's
        unclean election and not yet taken over (its heartbeat still tells of its log
        before it acted on the election)."""
        if self.eligible(g, r):
            if self._unclean.get(r) == g["epoch"]:
                del self._unclean[r]  # (taken over: its log holds the epoch)
            return True
        return self._unclean.get(r) == g["epoch"]

    # ------------------------------------------------------------ replicas' calls
    def heartbeat(self, shard: int, name: str, node: str, epoch: int, log_end: int,
                  in_sync: list[str] | None, fresh: bool = False, *,
                  log_epoch: int | None = None, isr_version: int | None = None,
                  kept: dict | None = None) -> dict:
        """A replica lives; the assignment of its group.  The leader of the current epoch
        asks for its in-sync set: replicas it added join the controller's, if it asks at
        the group's current ``isr_version``.  A ``fresh`` replica (its process just
        started: its disk may be new) leaves the in-sync set unless it leads; it rejoins
        once caught up (Kafka's KIP-903 for the same).  ``log_epoch``: the latest epoch
        its log holds; ``kept``: the assignment it keeps on disk (``group.json``)."""
        g = self._group(shard)
        if name not in g["replicas"]:
            raise InvalidMessageError(f"{name!r} is not a replica of {self.kind}-{shard}")
        now = self.clock.monotonic_ms()
        had = self._ends.get(name, -1)
        self._seen[name], self._ends[name], self._nodes[name] = now, int(log_end), node
        if log_epoch is not None:
            self._log_epochs[name] = int(log_epoch)
        if not g["known"]:
            self._reported[name] = kept
            self._recover(g)
            if not g["known"]:
                return self.doc(g)
        if g["leader"] is None and g["epoch"] == 0:
            self._changed(g, epoch=1, leader=name, in_sync=[name], joined={name: 1})
        elif name == g["leader"] and (fresh or not self._may_lead(g, name)):
            # (restarted -- or its log lacks its epoch: a new disk, its restart told to a
            # controller that had no record of the group yet)
            self._leader_restarted(g, name, int(log_end), had)
        elif fresh and name != g["leader"] and self._lives(g["leader"], now):
            # back in only once it holds what the leader held now (the leader may report
            # it in sync before it noticed the restart)
            self._floor[name] = self._ends.get(g["leader"], 0)
            if name in g["in_sync"]:
                self._changed(g, in_sync=[r for r in g["in_sync"] if r != name])
        elif name == g["leader"] and epoch == g["epoch"] and in_sync \
                and isr_version == g["version"]:
            self._grow(g, in_sync)
        self.tick()
        return self.doc(g)

    def _grow(self, g: dict, in_sync: list[str]) -> None:
        """The leader asks for ``in_sync`` (at the current version): replicas restarted
        join only once they hold what the leader held when they came back."""
        for r in [r for r in in_sync if r in self._floor]:
            if self._ends.get(r, -1) >= self._floor[r]:
                del self._floor[r]
        grown = sorted((set(g["in_sync"]) | (set(in_sync) - set(self._floor)))
                       & set(g["replicas"]))
        if grown != g["in_sync"]:
            for r in set(grown) - set(g["in_sync"]):
                # the leader vouches that its log reaches this epoch's start; its own next
                # heartbeat tells the epoch its log holds (a restart on a new disk: less)
                self._log_epochs[r] = max(self._log_epochs.get(r, -1), g["epoch"])
            self._changed(g, in_sync=grown)

    def _recover(self, g: dict) -> None:
        """(a group the controller has no record of) Take the newest assignment its
        replicas keep once every in-sync replica of it reported; a group none of whose
        replicas knows an epoch is new once all of them reported."""
        kept = [d for r, d in self._reported.items() if r in g["replicas"] and d]
        if not kept:
            if set(g["replicas"]) <= set(self._reported) and \
                    all(self._log_epochs.get(r, -1) < 1 for r in g["replicas"]):
                g["known"] = True  # (new: the heartbeat makes its first leader)
            return
        newest = max(kept, key=lambda d: (d["epoch"], d.get("version", 0)))
        reported = set(self._reported) & set(g["replicas"])
        waited = self.clock.monotonic_ms() - self._started > self.lease_ms
        in_sync = set(newest["in_sync"])
        joined = dict(newest.get("joined") or {r: 0 for r in in_sync})
        holding = [r for r in in_sync & reported
                   if self._log_epochs.get(r, -1) >= joined.get(r, 0)]
        majority = waited and 2 * len(reported) > len(g["replicas"])
        if not holding and not (set(g["replicas"]) <= reported or majority):
            return  # (no in-sync replica of it holds its epoch: wait for the others)
        if not in_sync <= reported and not majority:
            return  # (an in-sync replica may know newer: a lease for it, then a majority)
        if not in_sync <= reported or not holding:
            # a majority reported, not every in-sync replica -- or all reported and no
            # in-sync one holds its epoch (the newest record's set was wiped; a newer one
            # died with it): those whose logs hold the newest epoch any of them holds may
            # lead, the one holding the most elected (RocketMQ's electMaster)
            top = max(self._log_epochs.get(r, -1) for r in reported)
            newer = {r for r in reported if self._log_epochs.get(r, -1) == top}
            in_sync |= newer
            joined.update({r: top for r in newer - set(joined)})
        g.update(epoch=int(newest["epoch"]), leader=newest["leader"],
                 in_sync=sorted(in_sync), known=True,
                 joined={r: joined.get(r, 0) for r in in_sync},
                 version=int(newest.get("version", 0)) + 1)
        if g["leader"] is not None and not self.eligible(g, g["leader"]):
            g["leader"] = None  # (its log lacks its epoch: an in-sync replica is elected)
        self._save()

    def _leader_restarted(self, g: dict, name: str, log_end: int, had: int) -> None:
        """The leader's process started again (its disk may be new): another in-sync
        replica leads if one lives; else it leads again, in a new epoch, only if its log
        holds its epoch and at least what it last reported -- otherwise the group waits
        for an in-sync replica (or an operator's unclean election)."""
        if self._elect(g, exclude={name}):
            self._floor[name] = self._ends.get(g["leader"], 0)
            if name in g["in_sync"]:
                self._changed(g, in_sync=[r for r in g["in_sync"] if r != name])
        elif log_end >= had and self.eligible(g, name):
            self._changed(g, epoch=g["epoch"] + 1)
        else:
            self._changed(g, leader=None, in_sync=[r for r in g["in_sync"] if r != name])

    def alter_isr(self, shard: int, name: str, epoch: int, in_sync: list[str],
                  version: int | None = None) -> tuple[bool, dict]:
        """The leader of ``epoch`` asks for the in-sync set ``in_sync`` at the group's
        ``version`` (None: any -- a shrink only): (done?, assignment).  A grown set
        takes only replicas that hold what they must (``_grow``)."""
        g = self._group(shard)
        if not g["known"] or name != g["leader"] or epoch != g["epoch"] or \
                (version is not None and version != g["version"]):
            return False, self.doc(g)
        wanted = (set(in_sync) & set(g["replicas"])) | {name}
        if version is None:
            wanted &= set(g["in_sync"])
        if sorted(wanted - set(g["in_sync"])):
            self._grow(g, sorted(wanted))
            wanted &= set(g["in_sync"])
        if sorted(wanted) != g["in_sync"]:
            self._changed(g, in_sync=sorted(wanted))
        return True, self.doc(g)

    # -------------------------------------------------------------- elections
    def tick(self) -> list[int]:
        """Elect a new leader wherever the leader's lease ran out; the shards that got one."""
        now = self.clock.monotonic_ms()
        out = []
        for i, g in self.groups.items():
            if not g["known"]:
                continue
            leader = g["leader"]
            if leader is None and g["epoch"] and self._elect(g, exclude=set()):
                out.append(int(i))  # (a group that had lost every in-sync replica)
                continue
            leader_alive = leader is not None and \
                now - self._seen.get(leader, self._started) <= self.lease_ms
            dead = [r for r in g["in_sync"] if r != leader
                    and now - self._seen.get(r, self._started) > self.lease_ms]
            if dead and leader_alive:  # (the leader adopts the smaller set at its next
                # heartbeat; while it is dead too, nothing is acknowledged and the set stays)
                self._changed(g, in_sync=[r for r in g["in_sync"] if r not in dead])
            if leader is not None and not leader_alive:
                if self._elect(g, exclude={leader}):
                    out.append(int(i))
        return out

    def elect(self, shard: int, *, to: str | None = None, unclean: bool = False) -> dict:
        """An operator moves leadership (to ``to``, else the best other in-sync replica);
        with ``unclean``, an alive replica out of the in-sync set may be chosen when no
        in-sync one lives (acknowledged writes may be lost: the operator's call)."""
        g = self._group(shard)
        now = self.clock.monotonic_ms()
        if to is not None and to not in g["replicas"]:
            raise InvalidMessageError(f"{to!r} is not a replica of {self.kind}-{shard} "
                                      f"({', '.join(g['replicas'])})")
        if not g["known"] and unclean:
            g["known"] = True  # (the operator's call: no more waiting for reports)
        if not self._elect(g, exclude={g["leader"]} if to is None else set(), to=to,
                           unclean=unclean):
            why = "; ".join(f"{r}: {c}" for r, c in self.candidacy(g, now).items())
            raise NotEnoughReplicasError(
                f"{self.kind}-{shard}: no alive in-sync replica to lead"
                f"{f' ({to} is not one)' if to else ''}: {why}")
        return self.doc(g)

    def candidacy(self, g: dict, now: int) -> dict[str, str]:
        """Per replica: whether it could be elected now, and why not."""
        alive = self._alive(now)
        out = {}
        for r in g["replicas"]:
            if r not in alive:
                out[r] = "not alive"
            elif not g["known"]:
                out[r] = "waiting for the group's replicas to report"
            elif r not in g["in_sync"]:
                out[r] = "not in sync"
            elif not self.eligible(g, r):
                out[r] = (f"its log lacks epoch {g['joined'].get(r, 0)} (holds up to epoch "
                          f"{self._log_epochs.get(r)}: a new disk?)")
            else:
                out[r] = "leader" if r == g["leader"] else "electable"
        return out

    def _elect(self, g: dict, *, exclude: set[str], to: str | None = None,
               unclean: bool = False) -> bool:
        alive = self._alive(self.clock.monotonic_ms())
        candidates = {r for r in set(g["in_sync"]) & alive - exclude if self.eligible(g, r)}
        if not candidates and unclean:
            candidates = set(g["replicas"]) & alive - exclude
        if to is not None:
            candidates &= {to}
        if not candidates:
            return False
        new = choose_leader(candidates, lambda r: (self._log_epochs.get(r, -1),
                                                   self._ends.get(r, -1)))
        epoch = g["epoch"] + 1
        # the in-sync set keeps its alive members (a deposed leader alive among them)
        in_sync = sorted((set(g["in_sync"]) & alive) | {new})
        joined = {r: g["joined"].get(r, 0) for r in in_sync}
        joined[new] = epoch if new not in g["in_sync"] or unclean and \
            not self.eligible(g, new) else joined.get(new, 0)
        if unclean and not self.eligible(g, new):
            self._unclean[new] = epoch  # (the operator's call: see ``_may_lead``)
        self._changed(g, epoch=epoch, leader=new, in_sync=in_sync, joined=joined)
        return True

    # ------------------------------------------------------------------ reads
    def leader(self, shard: int) -> tuple[str | None, int]:
        g = self._group(shard)
        return g["leader"], g["epoch"]

    def describe(self) -> list[dict]:
        """Per shard: leader, epoch, in-sync set, each replica's node and liveness, and who
        could be elected now (``candidacy``)."""
        now = self.clock.monotonic_ms()
        alive = self._alive(now)
        return [{"shard": int(i), **self.doc(g),
                 "nodes": {r: self._nodes.get(r, "") for r in g["replicas"]},
                 "alive": sorted(set(g["replicas"]) & alive),
                 "log_end": {r: self._ends.get(r, -1) for r in g["replicas"]},
                 "candidacy": self.candidacy(g, now)}
                for i, g in self.groups.items()]
