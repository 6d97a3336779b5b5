"""The replication nemesis: an in-process replicated shard (no Ray) -- ``ShardReplica`` s
of one shard, a real ``Controller`` on a manual clock, the followers stepped by the
caller (one fetch a step, no threads of their own), and calls between replicas that can
fail (a replica paused or down), be held and delivered late (``hold``), or delivered
twice (``duplicate``) -- for scripted schedules (``tests/replication/test_replication_schedules.py``)
and a seeded random search of them (``search``: the tests run thousands of steps, ``raymq
bench replication`` a longer run).

``Sim.check`` states what must hold after every step of any schedule: no acknowledged
record missing from any replica the controller could elect, never two replicas leading
one epoch; ``Sim.converged`` what must hold once the faults end: every acknowledged
record on the leader, no record refused before it was written delivered, every
replica's log the leader's."""
from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from raymq.actors.config import ClusterConfig
from raymq.actors.controller import Controller
from raymq.actors.replication.replica import ShardReplica
from raymq.actors.replication.groups import replica_name
from raymq.actors.shard import BrokerShard
from raymq.storage import RecordBatch
from raymq.storage.clock import ManualClock
from raymq.storage.errors import BrokerUnavailableError, RayMQError

LEASE_MS = 1000
TOPIC = "t"


@dataclass
class Held:
    """A call held on its way (a fetch reply delivered late): ``release`` lets it go on."""

    caller: str
    target: str
    gate: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.gate.set()


class Sim:
    def __init__(self, tmp_path, n: int = 3, **settings):
        self.tmp = tmp_path
        settings.setdefault("send_timeout_ms", 2000)
        self.cfg = ClusterConfig(data_dir=str(tmp_path), num_shards=1, replication_factor=n,
                                 replica_lease_ms=LEASE_MS, **settings)
        self.clock = ManualClock()
        self.controller = Controller(self.cfg, clock=self.clock)
        self.names = [replica_name(0, k) for k in range(n)]
        self.replicas: dict[str, ShardReplica] = {}
        self.down: set[str] = set()
        self.paused: set[str] = set()
        self.held: list[Held] = []
        self.acked: list[bytes] = []      # acknowledged to a client
        self.refused: list[bytes] = []    # answered with an error: never to be delivered
        self.leaders_by_epoch: dict[int, set[str]] = {}
        self.duplicates: set[str] = set()
        self._last_reply: dict[str, dict] = {}
        for name in self.names:
            self.start(name)

    # -------------------------------------------------------------- replicas
    def directory(self, name: str) -> str:
        return str(self.tmp / name)

    def start(self, name: str, *, wipe: bool = False) -> ShardReplica:
        if wipe:
            shutil.rmtree(self.directory(name), ignore_errors=True)
        self.down.discard(name)
        self.paused.discard(name)
        r = ShardReplica(0, name, self.cfg, self.directory(name), controller=self._control,
                         call_replica=self._call, make_shard=self._shard,
                         node=f"node-{name}", clock=self.clock, background=False,
                         fetch_threads=False)
        self.replicas[name] = r
        return r

    def kill(self, name: str) -> None:
        if name in self.down:
            return
        self.down.add(name)
        self.paused.discard(name)
        try:
            self.replicas[name].close()
        except Exception:  # (a replica whose store already failed)
            pass

    def restart_controller(self, *, wipe: bool = False) -> None:
        if wipe:
            shutil.rmtree(os.path.join(str(self.tmp), "controller"), ignore_errors=True)
        self.controller = Controller(self.cfg, clock=self.clock, restarted=True)

    def _control(self, method, *args):
        return getattr(self.controller, method)(*args)

    def _call(self, name, method, args, timeout_s):
        caller = args[0] if method == "replica_fetch" else None
        for h in list(self.held):
            if h.target == name and h.caller == caller:
                self.held.remove(h)
                h.entered.set()
                h.gate.wait(30)
        if caller is not None and caller in self.duplicates and caller in self._last_reply:
            self.duplicates.discard(caller)
            return self._last_reply[caller]  # (an earlier reply, delivered again)
        if name in self.down or name in self.paused:
            raise BrokerUnavailableError(f"{name} does not answer")
        reply = getattr(self.replicas[name], method)(*args)
        if caller is not None:
            self._last_reply[caller] = reply
        return reply

    def duplicate(self, caller: str) -> None:
        """``caller``'s next fetch gets its previous reply again (a duplicate delivery)."""
        self.duplicates.add(caller)

    def _shard(self, directory):
        sh = BrokerShard(0, self.cfg, directory=directory, clock=self.clock)
        sh.set_routes([(TOPIC, 0)])
        return sh

    def live(self) -> list[str]:
        return [n for n in self.names if n not in self.down and n not in self.paused]

    # ---------------------------------------------------------------- steps
    def beat(self, *names) -> None:
        for name in names or self.live():
            if name in self.down or name in self.paused:
                continue
            try:
                self.replicas[name].heartbeat()
            except RayMQError:
                pass
            self._note_leader(name)

    def _note_leader(self, name: str) -> None:
        leader = self.replicas[name].leader
        if leader is not None and not leader.deposed:
            self.leaders_by_epoch.setdefault(leader.epoch, set()).add(name)

    def fetch(self, name: str) -> bool:
        """One fetch of follower ``name`` (if it follows anyone); whether it applied."""
        f = self.replicas[name].following
        if f is None or name in self.down or name in self.paused:
            return False
        try:
            return f.step(0)
        except RayMQError:
            return False

    def pump(self, rounds: int = 3) -> None:
        for _ in range(rounds):
            for name in self.live():
                self.fetch(name)

    def hold(self, caller: str, target: str) -> Held:
        """Hold ``caller``'s next fetch to ``target`` until released."""
        h = Held(caller, target)
        self.held.append(h)
        return h

    def leader_name(self) -> str | None:
        return self.controller.replica_groups.leader(0)[0]

    def in_sync(self) -> list[str]:
        return self.controller.replicas()[0]["in_sync"]

    def settle(self, rounds: int = 50) -> None:
        """Heartbeats and fetches until every live replica is in sync with the leader."""
        for _ in range(rounds):
            self.beat()
            self.pump(2)
            self.beat()
            leader = self.leader_name()
            live = sorted(self.live())
            if leader in live and self.in_sync() == live and \
                    len({self.replicas[n].log_end() for n in live}) == 1:
                return
        raise AssertionError(f"did not settle: leader {self.leader_name()}, in sync "
                             f"{self.in_sync()}, live {self.live()}, ends "
                             f"{ {n: self.replicas[n].log_end() for n in self.live()} }")

    def send(self, name: str, body: bytes, *, pump: bool = True, wait: bool = True,
             rounds: int = 200):
        """A client's send of ``body`` to replica ``name`` (in a thread, the followers
        pumped meanwhile); the reply's status, or the error's class name (``Refused:``
        before it: refused before anything was written)."""
        out: dict = {}

        def run():
            try:
                shard = self.replicas[name].serving(write=True)
            except Exception as err:  # noqa: BLE001 -- the client's answer
                out["status"] = f"Refused:{type(err).__name__}"
                return
            try:
                out["status"] = shard.send(RecordBatch(TOPIC, 0, [body]), 0, 0).status
            except Exception as err:  # noqa: BLE001 -- the client's answer
                out["status"] = type(err).__name__
        t = threading.Thread(target=run, daemon=True)
        t.start()
        if not wait:
            return t, out
        for _ in range(rounds):
            t.join(0.002)
            if not t.is_alive():
                break
            if pump:
                self.pump(1)
        if t.is_alive():  # nobody copies it: the send's timeout
            self.clock.advance(self.cfg.send_timeout_ms)
            r = self.replicas[name]
            if r.leader is not None:
                with r.leader._cond:
                    r.leader._acks.notify_all()
            t.join(10)
        return self.answered(body, out.get("status", "no answer"))

    def answered(self, body: bytes, status: str) -> str:
        if status == "SEND_OK":
            self.acked.append(body)
        elif status.startswith("Refused:"):
            self.refused.append(body)
        return status

    # ------------------------------------------------------------------ reads
    def bodies(self, name: str) -> list[bytes]:
        """Every record of the topic replica ``name`` holds (confirmed or not)."""
        r = self.replicas[name]
        store = r.shard.store if r.shard is not None else r.store
        if store is None:
            return []
        return [bytes(m.body) for m in store.read_queue(TOPIC, 0, 0, 1_000_000)]

    def electable(self) -> list[str]:
        """The replicas the controller could elect now or later without an operator: in
        sync, eligible, and not down (a paused one may come back)."""
        g = self.controller.replica_groups.groups["0"]
        if not g["known"]:
            return []
        # (as the controller sees a replica when it next heartbeats: by the epochs its log
        # holds now -- a replica restarted on a new disk tells so before any election)
        return [r for r in g["in_sync"] if r not in self.down and
                self.replicas[r].epochs.latest_epoch() >= g["joined"].get(r, 0)]

    def check(self) -> None:
        for epoch, names in self.leaders_by_epoch.items():
            assert len(names) == 1, f"epoch {epoch} had two leaders: {sorted(names)}"
        for name in self.electable():
            held = set(self.bodies(name))
            missing = [b for b in self.acked if b not in held]
            assert not missing, f"{name} could be elected without acknowledged {missing[:5]}"

    def converged(self) -> None:
        """(the faults over, the group settled) Every acknowledged record on the leader,
        in order, none refused before it was written, every replica's log the leader's."""
        leader = self.leader_name()
        mine = self.bodies(leader)
        held = set(mine)
        missing = [b for b in self.acked if b not in held]
        assert not missing, f"leader {leader} lacks acknowledged {missing[:5]}"
        delivered = [b for b in self.refused if b in held]
        assert not delivered, f"refused {delivered[:5]} delivered"
        order = [b for b in mine if b in set(self.acked)]
        assert order == [b for b in self.acked if b in set(order)], "acknowledged out of order"
        for name in self.live():
            assert self.bodies(name) == mine, f"{name}'s log is not leader {leader}'s"

    def close(self) -> None:
        for h in self.held:
            h.release()
        for name in self.names:
            self.kill(name)


@dataclass
class SearchResult:
    steps: int
    sends: int
    acked: int
    faults: dict[str, int]
    seconds: float


def search(seed: int, steps: int, directory: str | None = None,
           trace: list | None = None) -> SearchResult:
    """A seeded random schedule of ``steps`` steps on a group of three (min in sync 2):
    sends to the leader (and to a deposed one), fetches, heartbeats and time, one fault at
    a time -- a replica paused, killed, restarted with or without its disk; the controller
    restarted with or without its files; a fetch reply delayed or delivered twice --
    ``Sim.check`` after every step, ``Sim.converged`` at the end.  AssertionError naming
    the seed and step where a check failed."""
    rng = random.Random(seed)
    own = directory is None
    root = Path(tempfile.mkdtemp(prefix="raymq-nemesis-") if own else directory)
    sim = Sim(root)
    faults: dict[str, int] = {}
    held: list[tuple[Held, threading.Thread, int]] = []
    sends = 0
    t0 = time.monotonic()
    step = 0

    def fault(kind: str) -> None:
        faults[kind] = faults.get(kind, 0) + 1

    try:
        sim.settle()
        for step in range(steps):
            impaired = set(sim.paused) | set(sim.down) | {
                n for n in sim.live() if n not in sim.electable()}
            leader = sim.leader_name()
            roll = rng.random()
            if roll < 0.30 and leader in sim.live():
                sends += 1
                sim.send(leader, b"s%d-%d" % (seed, step), rounds=20)
            elif roll < 0.34:
                stale = [n for n in sim.live() if sim.replicas[n].leader is not None]
                if stale:
                    sends += 1
                    sim.send(rng.choice(stale), b"x%d-%d" % (seed, step), rounds=5)
            elif roll < 0.55:
                sim.pump(1)
            elif roll < 0.72:
                sim.clock.advance(LEASE_MS // 5 + 1)
                sim.beat()
            elif roll < 0.77 and not impaired:
                victim = rng.choice(sim.live())
                sim.paused.add(victim)
                fault("pause")
            elif roll < 0.82 and sim.paused:
                sim.paused.discard(rng.choice(sorted(sim.paused)))
            elif roll < 0.85 and not impaired:
                sim.kill(rng.choice(sim.live()))
                fault("kill")
            elif roll < 0.89 and sim.down:
                wipe = rng.random() < 0.4
                sim.start(rng.choice(sorted(sim.down)), wipe=wipe)
                fault("restart_wiped" if wipe else "restart")
            elif roll < 0.91:
                wipe = rng.random() < 0.5
                sim.restart_controller(wipe=wipe)
                fault("controller_wiped" if wipe else "controller_restart")
            elif roll < 0.95:
                followers = [n for n in sim.live() if sim.replicas[n].following is not None]
                if followers and not held:
                    caller = rng.choice(followers)
                    h = sim.hold(caller, sim.replicas[caller].following.a.leader)
                    t = threading.Thread(target=sim.fetch, args=(caller,), daemon=True)
                    t.start()
                    held.append((h, t, step + rng.randint(1, 8)))
                    fault("delayed_reply")
            else:
                followers = [n for n in sim.live() if sim.replicas[n].following is not None]
                if followers:
                    sim.duplicate(rng.choice(followers))
                    fault("duplicate_reply")
            if trace is not None:
                g = sim.controller.replica_groups.groups["0"]
                trace.append((step, round(roll, 3), g["leader"], g["epoch"], list(g["in_sync"]),
                              sorted(sim.paused), sorted(sim.down),
                              {n: sim.replicas[n].log_end() for n in sim.names},
                              sim.acked[-1:] if sim.acked else None, dict(faults)))
            for h, t, due in list(held):
                if step >= due or not h.entered.is_set():
                    h.release()
                    t.join(10)
                    held.remove((h, t, due))
            try:
                sim.check()
            except AssertionError as err:
                raise AssertionError(f"seed {seed}, step {step}: {err}") from None
        for h, t, _due in held:
            h.release()
            t.join(10)
        sim.paused.clear()
        for name in sorted(sim.down):
            sim.start(name)
        sim.held.clear()
        sim.duplicates.clear()
        sim.settle(rounds=200)
        try:
            sim.converged()
        except AssertionError as err:
            raise AssertionError(f"seed {seed}, at the end: {err}") from None
        return SearchResult(steps, sends, len(sim.acked), faults, time.monotonic() - t0)
    finally:
        sim.close()
        if own:
            shutil.rmtree(root, ignore_errors=True)
