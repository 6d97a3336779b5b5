"""An in-process replicated shard for schedules (no Ray): ``ShardReplica`` s of one shard,
a real ``Controller`` on a manual clock, the followers stepped by the test (one fetch a
step, no threads of their own), and calls between replicas that can fail (a replica
paused or down), or be held and delivered late (``hold``).

``Sim.check`` states what must hold after every step of any schedule: no acknowledged
record missing from any replica the controller could elect, never two replicas leading
one epoch, and every replica's log, once caught up, a prefix of the leader's."""
from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass, field

from raymq.actors.config import ClusterConfig
from raymq.actors.controller import Controller
from raymq.actors.replica import ShardReplica
from raymq.actors.replica_groups import replica_name
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
        if name in self.down or name in self.paused:
            raise BrokerUnavailableError(f"{name} does not answer")
        return getattr(self.replicas[name], method)(*args)

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

    def send(self, name: str, body: bytes, *, pump: bool = True, wait: bool = True):
        """A client's send of ``body`` to replica ``name`` (in a thread, the followers
        pumped meanwhile); the reply's status, or the error's class name."""
        out: dict = {}

        def run():
            try:
                shard = self.replicas[name].serving(write=True)
                out["status"] = shard.send(RecordBatch(TOPIC, 0, [body]), 0, 0).status
            except Exception as err:  # noqa: BLE001 -- the client's answer
                out["status"] = type(err).__name__
        t = threading.Thread(target=run, daemon=True)
        t.start()
        if not wait:
            return t, out
        for _ in range(200):
            t.join(0.005)
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
        (self.acked if status == "SEND_OK" else self.refused).append(body)
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
        groups = self.controller.replica_groups
        g = groups.groups["0"]
        if not g["known"]:
            return []
        return [r for r in g["in_sync"] if r not in self.down and groups.eligible(g, r)]

    def check(self) -> None:
        for epoch, names in self.leaders_by_epoch.items():
            assert len(names) == 1, f"epoch {epoch} had two leaders: {sorted(names)}"
        for name in self.electable():
            held = set(self.bodies(name))
            missing = [b for b in self.acked if b not in held]
            assert not missing, f"{name} could be elected without acknowledged {missing[:5]}"
        leader = self.leader_name()
        if leader is None or leader in self.down or self.replicas[leader].leader is None:
            return
        mine = self.bodies(leader)
        for name in self.live():
            theirs = self.bodies(name)
            if name != leader and len(theirs) <= len(mine):
                assert theirs == mine[:len(theirs)], \
                    f"{name}'s log is no prefix of leader {leader}'s"
