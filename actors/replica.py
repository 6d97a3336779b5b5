"""One replica of a replicated shard (``replication_factor`` > 1): a leader serving the
shard, or a follower copying the leader's commit log; the controller says which.

RocketMQ 5's shape (commit-log byte replication, a controller electing a new master
from the in-sync set, an epoch file that truncates a returning master) with Kafka's
rules for acknowledging and fencing:

- every replica heartbeats the controller (``replica_heartbeat``) each
  ``replica_lease_ms / 5``; the answer is its group's assignment (leader, epoch,
  in-sync set), and a replica acts on a new one at once (``apply``);
- a **leader** is a whole ``BrokerShard`` over its directory (recovery rebuilds
  halves, Kafka-style transactions, timers and delays from the log, as after a
  restart).  A write is acknowledged only once every in-sync replica holds it
  (``LeaderState.wait_replicated``, the store's replication hook): the in-sync set
  shrinks only with the controller's consent for the current epoch, so a deposed
  leader -- whose in-sync set holds the new leader, which no longer fetches from it --
  acknowledges nothing more.  Readers see up to the confirmed offset only;
- a **follower** first cuts its log where its epochs diverge from the leader's
  (``EpochCache.truncation_offset``), then long-polls the leader (``replica_fetch``)
  and writes the frames at the same physical offsets (``MessageStore.append_replicated``);
  the leader's group offsets come with a fetch whenever they changed.

A plain class (no Ray): the actor (``raymq.deploy``) hands in how to reach the
controller and the other replicas.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable

from raymq.actors import replica_state
from raymq.actors.replica_set import Ack, ReplicaSet
from raymq.actors.replica_state import Part, Shipper
from raymq.storage import MessageStore
from raymq.storage.clock import Clock, SystemClock
from raymq.storage.epochs import EpochCache
from raymq.storage.fileutil import atomic_write
from raymq.storage.errors import (InvalidMessageError, NotEnoughReplicasError, NotLeaderError,
                                  RayMQError)
from raymq.storage.commitlog import SEGMENT_HEADER_BYTES
from raymq.storage.replication import truncate_log
from raymq.storage.store import PutStatus

log = logging.getLogger("raymq.replica")

#: What a leader serves that writes: refused while too few replicas are in sync, and
#: acknowledged once every in-sync replica holds it (a commit of offsets is a record).
WRITES = frozenset({"send", "ktx_send", "commit_offsets"})

#: The sends of this thread ask for the leader's write only (``ShardReplica.call``).
_ACKS = threading.local()

#: Most bytes of log one fetch carries; how long a fetch waits for new records.
FETCH_MAX_BYTES = 8 << 20
FETCH_WAIT_MS = 200


@dataclass(frozen=True)
class Assignment:
    """What the controller says of a group: who leads with which epoch, who is in sync."""

    epoch: int
    leader: str | None
    in_sync: tuple[str, ...]
    replicas: tuple[str, ...]
    version: int = 0  # the group's version (Kafka's partition epoch): every change bumps it

    @classmethod
    def of(cls, doc: dict) -> "Assignment":
        return cls(doc["epoch"], doc["leader"], tuple(doc["in_sync"]), tuple(doc["replicas"]),
                   doc.get("version", 0))


#: The assignment a replica was last told, kept beside its log: a controller that lost its
#: files takes each group's state from what the group's replicas keep.
KEPT_ASSIGNMENT = "group.json"


#: The controller's topics and routes, as a replica keeps them (``Controller._mirror``).
KEPT_METADATA = "controller-meta.json"


def read_kept(directory: str, name: str = KEPT_ASSIGNMENT) -> dict | None:
    try:
        with open(os.path.join(directory, name), "rb") as f:
            doc = json.loads(f.read())
    except FileNotFoundError:
        return None
    except ValueError:  # (written atomically: damage is the disk's; the others report)
        log.warning("%s: %s is damaged; not reported", directory, name)
        return None
    return doc if isinstance(doc, dict) else None


class LeaderState:
    """A leader's side of one epoch: its ``ReplicaSet``, the writes waiting for it, and
    the followers' fetches it serves."""

    def __init__(self, shard: int, name: str, a: Assignment, store: MessageStore,
                 epochs: EpochCache, *, min_insync: int, lag_max_ms: int, timeout_ms: int,
                 confirmed: int, clock: Clock, wake_readers: Callable[[], None],
                 parts: list[Part] = ()):
        self.name, self.store, self.epochs, self.clock = name, store, epochs, clock
        self.timeout_ms = timeout_ms
        self.rs = ReplicaSet(shard, list(a.replicas), name, a.epoch, min_insync, lag_max_ms,
                             in_sync=set(a.in_sync) | {name})
        now = clock.monotonic_ms()
        for f in self.rs.followers.values():
            f.caught_up_ms = now  # (in sync as of the election)
        self.rs.took_over(store.max_phys_offset)
        self.rs.confirmed = min(confirmed, store.max_phys_offset)
        self._wake_readers = wake_readers
        self._cond = threading.Lock()  # one lock, two conditions: who waits for what
        self._acks = threading.Condition(self._cond)  # writes waiting for the confirmed offset
        self._data = threading.Condition(self._cond)  # fetches waiting for new records
        self._answered_end: dict[str, int] = {}  # the leader's end when a fetch was answered
        self._offsets_held: dict[str, int] = {}  # the offsets version each follower holds
        self.shipper = Shipper(list(parts), clock)  # what it keeps beside the log
        self.deposed = False

    @property
    def epoch(self) -> int:
        return self.rs.epoch

    def confirmed(self) -> int:
        return self.rs.confirmed

    def _moved(self, before: int) -> None:
        """(under the lock) wake what a new confirmed offset lets go on."""
        if self.rs.confirmed != before:
            self._acks.notify_all()
            self._wake_readers()

    # --------------------------------------------------------------- writes
    def refuse_if_short(self) -> None:
        if self.deposed:
            raise NotLeaderError(f"shard-{self.rs.shard}: {self.name} no longer leads")
        self.rs.refuse_if_short()

    def wait_replicated(self, end: int) -> PutStatus:
        """The store's replication hook: wait until every in-sync replica holds the log up
        to ``end``.  ``FLUSH_SLAVE_TIMEOUT`` when they did not within the timeout (the
        write stays; a resend waits again); ``NotEnoughReplicasError`` when too few are
        in sync; ``NotLeaderError`` once this replica was deposed."""
        deadline = self.clock.monotonic_ms() + self.timeout_ms
        with self._cond:
            before = self.rs.confirmed
            self.rs.appended(self.store.max_phys_offset)
            self._moved(before)
            if getattr(_ACKS, "leader", False):  # (acks of the leader only: written here)
                if self.deposed:
                    raise NotLeaderError(f"shard-{self.rs.shard}: {self.name} was deposed")
                return PutStatus.PUT_OK
            while True:
                if self.deposed:
                    raise NotLeaderError(f"shard-{self.rs.shard}: {self.name} was deposed "
                                         f"before the write was replicated (not acknowledged)")
                ack = self.rs.ack(end)
                if ack is Ack.OK:
                    return PutStatus.PUT_OK
                if ack is Ack.NOT_ENOUGH:
                    self.rs.refuse_if_short()
                left = deadline - self.clock.monotonic_ms()
                if left <= 0:
                    return PutStatus.FLUSH_SLAVE_TIMEOUT
                self._acks.wait(left / 1000.0)

    # -------------------------------------------------------------- fetches
    def serve_fetch(self, follower: str, epoch: int, from_phys: int, wait_ms: int,
                    max_bytes: int, offsets_version: int, held: dict | None = None,
                    last_epoch: int | None = None) -> dict:
        """A follower holding the log up to ``from_phys`` (group offsets of
        ``offsets_version``, the parts ``held``: ``raymq.actors.replica_state``), whose
        latest leader epoch is ``last_epoch``, asks for what follows.

        A position this leader's log does not hold -- past its end, or after where the
        follower's last epoch ends here -- is not counted: the reply is ``{"diverging":
        (epoch, end)}`` (Kafka's diverging epoch, KIP-320/595) and the follower cuts its
        log and asks again, as many rounds as it takes (KIP-279)."""
        if follower not in self.rs.followers:
            raise InvalidMessageError(f"shard-{self.rs.shard}: {follower!r} is not a replica")
        deadline = self.clock.monotonic_ms() + max(0, min(wait_ms, 5000))
        with self._cond:
            self._check(epoch)
            diverging = self._diverging(from_phys, last_epoch)
            if diverging is not None:
                return {"diverging": diverging, "epochs": self.epochs.entries()}
            before = self.rs.confirmed
            self.rs.appended(self.store.max_phys_offset)
            self.rs.fetched(follower, from_phys, self._answered_end.get(follower, 1 << 62),
                            self.clock.monotonic_ms())
            if offsets_version > self._offsets_held.get(follower, -1):
                self._acks.notify_all()  # (a commit waiting for its offsets here)
            self._moved(before)
            self._offsets_held[follower] = offsets_version
            while self.store.max_phys_offset <= from_phys and not self.deposed and \
                    self.store.offsets.version == offsets_version:
                left = deadline - self.clock.monotonic_ms()
                if left <= 0:
                    break
                self._data.wait(left / 1000.0)
            self._check(epoch)
            end_then = self.store.max_phys_offset
            self._answered_end[follower] = end_then
            confirmed = self.rs.confirmed
        # the parts and offsets are read before the frames, and go only with every record
        # written before they were read, so that they never pass what the follower holds
        parts = self.shipper.due(follower, held) if held is not None and \
            from_phys + max_bytes >= end_then else {}
        version, table = self.store.offsets.versioned()
        covered = self.store.max_phys_offset  # (>= end_then: a leader's log only grows)
        start, data = self.store.read_frames(from_phys, max_bytes)
        caught_up = start + len(data) >= covered
        if caught_up and parts:
            self.shipper.sent(follower, parts)
        return {"start": start, "data": data, "leader_end": end_then, "confirmed": confirmed,
                "epochs": self.epochs.entries(), "offsets_version": version,
                "offsets": table if caught_up and version != offsets_version else None,
                "parts": parts if caught_up else {}}

    def _diverging(self, from_phys: int, last_epoch: int | None):
        """(under the lock) ``(epoch, end)`` when a follower at ``from_phys`` with latest
        epoch ``last_epoch`` holds what this log does not; None when its log is a prefix."""
        empty = from_phys <= SEGMENT_HEADER_BYTES  # (an empty log: its first header)
        return None if empty else self.epochs.diverging(self.store.max_phys_offset,
                                                        last_epoch, from_phys)

    def wait_offsets(self) -> bool:
        """After group offsets changed: wait until every in-sync follower holds them (a new
        leader then carries on from them); whether they did within the timeout."""
        version = self.store.offsets.version
        deadline = self.clock.monotonic_ms() + self.timeout_ms
        with self._cond:
            self._data.notify_all()  # (a follower long-polling takes them now)
            while not self.deposed:
                behind = [r for r in self.rs.in_sync if r != self.name
                          and self._offsets_held.get(r, -1) < version]
                left = deadline - self.clock.monotonic_ms()
                if not behind or left <= 0:
                    return not behind
                self._acks.wait(left / 1000.0)
        return False

    def _check(self, epoch: int) -> None:
        if self.deposed or epoch != self.rs.epoch:
            raise NotLeaderError(f"shard-{self.rs.shard}: {self.name} leads epoch "
                                 f"{self.rs.epoch}{' no more' if self.deposed else ''}, "
                                 f"not epoch {epoch}")

    def wake(self) -> None:
        """New records (the store's written hook): long-polling fetches answer."""
        with self._cond:
            self._data.notify_all()

    # ------------------------------------------------------------ in-sync set
    def shrink_candidates(self) -> list[str]:
        """Followers not caught up within the lag limit (to ask the controller about)."""
        now = self.clock.monotonic_ms()
        with self._cond:
            return self.rs.lagging(now)

    def in_sync(self) -> list[str]:
        with self._cond:
            return sorted(self.rs.in_sync)

    def set_in_sync(self, in_sync: set[str]) -> None:
        """The controller agreed: the in-sync set is now ``in_sync``."""
        with self._cond:
            before = self.rs.confirmed
            self.rs.set_in_sync(set(in_sync) | {self.name})
            self._moved(before)
            self._acks.notify_all()

    def depose(self) -> None:
        with self._cond:
            self.deposed = True
            self._acks.notify_all()
            self._data.notify_all()

    def status(self) -> dict:
        with self._cond:
            end = self.store.max_phys_offset
            return {"confirmed": self.rs.confirmed, "in_sync": sorted(self.rs.in_sync),
                    "lag_bytes": {r: max(0, end - f.log_end)
                                  for r, f in self.rs.followers.items()}}


class ShardReplica:
    """One replica of shard ``index``, named ``name``, keeping its files in ``directory``.

    ``controller(method, *args)`` calls the controller; ``call_replica(name, method,
    args, timeout_s)`` calls another replica of the group; ``make_shard(directory)``
    builds the ``BrokerShard`` a leader serves.  ``background`` starts the heartbeat
    loop (tests drive ``heartbeat`` themselves).
    """

    def __init__(self, index: int, name: str, config, directory: str, *,
                 controller: Callable, call_replica: Callable, make_shard: Callable,
                 node: str = "", clock: Clock | None = None, background: bool = True,
                 fetch_threads: bool = True):
        self.index, self.name, self.config, self.directory = index, name, config, directory
        self.node = node
        self.clock = clock or SystemClock()
        self._controller, self._call, self._make_shard = controller, call_replica, make_shard
        self._fetch_threads = fetch_threads  # (False: a test steps ``following`` itself)
        os.makedirs(directory, exist_ok=True)
        self.epochs = EpochCache(os.path.join(directory, "epochs"))
        self._kept = read_kept(directory)
        self._meta = read_kept(directory, KEPT_METADATA) or {"meta_version": 0}
        self._send_meta = True  # (the first heartbeat brings it: the controller may lack it)
        self._lock = threading.RLock()  # role changes, one at a time
        self.assignment: Assignment | None = None
        self.shard = None                      # the BrokerShard, while leading
        self.leader: LeaderState | None = None
        self.store: MessageStore | None = self.open_store()  # a follower's
        self._following: _Follower | None = None
        self._confirmed = 0  # the last confirmed offset learned from a leader
        self._fresh = True   # until the first heartbeat: this process just started
        self._stop = threading.Event()
        self._acting = threading.Condition()
        self._next: Assignment | None = None
        if background:
            for loop, what in ((self._beat_loop, "heartbeat"), (self._act_loop, "role")):
                threading.Thread(target=loop, daemon=True, name=f"raymq-{name}-{what}").start()

    def open_store(self) -> MessageStore:
        """This replica's store, opened as a follower uses it (recovery on open)."""
        return MessageStore(self.directory, self.config.store_config(), self.clock)

    # ------------------------------------------------------------ the role
    def serving(self, write: bool = False):
        """The shard, while this replica leads; else ``NotLeaderError`` (the SDK asks the
        controller again).  A write is refused while too few replicas are in sync."""
        shard, leader = self.shard, self.leader
        if shard is None or leader is None or leader.deposed:
            a = self.assignment
            raise NotLeaderError(f"shard-{self.index}: {self.name} does not lead (leader: "
                                 f"{a.leader if a else 'not known yet'})")
        if write:
            leader.refuse_if_short()
        return shard

    def call(self, served: type, name: str, args: tuple, kwargs: dict):
        """Method ``name`` of the served class on the shard this replica leads (what a
        client asks of a replica): a write is refused while too few replicas are in sync,
        unless a send asks for the leader's write only (``acks="leader"``), which is then
        answered once written here."""
        acks = kwargs.get("acks", args[4] if name == "send" and len(args) > 4 else "all")
        leader_only = name == "send" and acks == "leader"
        shard = self.serving(write=name in WRITES and not leader_only)
        if not leader_only:
            return getattr(served, name)(shard, *args, **kwargs)
        _ACKS.leader = True
        try:
            return getattr(served, name)(shard, *args, **kwargs)
        finally:
            _ACKS.leader = False

    def offsets_replicated(self) -> bool:
        """After a commit of group offsets: wait until the in-sync followers hold them."""
        leader = self.leader
        return leader.wait_offsets() if leader is not None else False

    def log_end(self) -> int:
        shard, store = self.shard, self.store
        if shard is not None:
            return shard.store.max_phys_offset
        return store.max_phys_offset if store is not None else 0

    def heartbeat(self, *, act: bool = True) -> Assignment:
        """Tell the controller this replica lives (and, leading, its in-sync set); act on
        the assignment it answers (``act=False``: the role thread does, so that a role
        change -- a leader's recovery takes a while on a big log -- never holds up the
        heartbeats that keep this replica's lease)."""
        leader = self.leader
        known = self.assignment
        epoch = known.epoch if known else 0
        doc = self._controller("replica_heartbeat", self.index, self.name, self.node, epoch,
                               self.log_end(), leader.in_sync() if leader else None,
                               self._fresh, self._report(known))
        self._fresh = False
        a = Assignment.of(doc)
        self._keep(doc)
        self._keep_meta(doc)
        if act:
            self.act(a)
        else:
            with self._acting:
                self._next = a
                self._acting.notify()
        return a

    def _report(self, known: Assignment | None) -> dict:
        """What a heartbeat tells beside the log end: the latest epoch the log holds, the
        group version the in-sync set is asked at, what this replica keeps of the group
        and of the controller's metadata (the latter whole only when asked)."""
        out = {"log_epoch": self.epochs.latest_epoch(),
               "isr_version": known.version if known else None, "kept": self._kept,
               "meta_version": self._meta.get("meta_version", 0)}
        if self._send_meta and out["meta_version"]:
            out["meta"] = self._meta
        return out

    def _keep_meta(self, doc: dict) -> None:
        self._send_meta = bool(doc.get("send_meta"))
        meta = doc.get("meta")
        if meta and meta.get("meta_version", 0) > self._meta.get("meta_version", 0):
            atomic_write(os.path.join(self.directory, KEPT_METADATA),
                         json.dumps(meta, sort_keys=True).encode())
            self._meta = meta

    def _keep(self, doc: dict) -> None:
        """Keep the newest assignment told (before acting on it: a controller that lost
        its files learns the group back from its replicas)."""
        kept = self._kept
        if doc.get("leader") is None and not doc.get("epoch"):
            return
        if kept is not None and (kept["epoch"], kept.get("version", 0)) >= \
                (doc["epoch"], doc.get("version", 0)):
            return
        keep = {k: doc[k] for k in ("epoch", "leader", "in_sync", "version", "joined")
                if k in doc}
        atomic_write(os.path.join(self.directory, KEPT_ASSIGNMENT),
                     json.dumps(keep, sort_keys=True).encode())
        self._kept = keep

    def act(self, a: Assignment) -> None:
        """Take the assignment ``a``; leading, adopt the controller's in-sync set where it
        let a dead follower go, and ask it to let lagging ones go."""
        self.apply(a)
        leader = self.leader
        if leader is not None and leader.epoch == a.epoch:
            mine = set(leader.in_sync())
            if not mine <= set(a.in_sync):  # the controller let a dead follower go
                leader.set_in_sync(mine & set(a.in_sync))
            self._shrink()

    def _shrink(self) -> None:
        """Followers past the lag limit leave the in-sync set, the controller agreeing first
        (it elects only from its own set, which must never hold a replica without what
        was acknowledged)."""
        leader = self.leader
        out = leader.shrink_candidates()
        if not out:
            return
        keep = sorted(set(leader.in_sync()) - set(out))
        a = self.assignment
        ok, doc = self._controller("replica_alter_isr", self.index, self.name, leader.epoch,
                                   keep, a.version if a is not None else None)
        self._keep(doc)
        if ok:
            log.warning("shard-%d: %s leaves the in-sync set (not caught up within %d ms)",
                        self.index, ", ".join(out), leader.rs.lag_max_ms)
            leader.set_in_sync(set(doc["in_sync"]))
        else:
            self.apply(Assignment.of(doc))

    def apply(self, a: Assignment) -> None:
        """Act on the controller's assignment (an older epoch than known is ignored)."""
        with self._lock:
            known = self.assignment
            if known is not None and (a.epoch, a.version) < (known.epoch, known.version):
                return
            self.assignment = a
            if a.leader == self.name:
                if self.leader is None or self.leader.epoch != a.epoch:
                    self._lead(a)
                return
            if self.leader is not None:
                self._step_down()
            if a.leader is not None and (self._following is None
                                         or self._following.a.epoch != a.epoch):
                self._follow(a)

    def _lead(self, a: Assignment) -> None:
        self._stop_following()
        if self.leader is not None:  # re-elected: the same shard goes on in a new epoch
            self.leader.depose()
            self._confirmed = self.leader.confirmed()
        if self.shard is None:
            end = self.store.complete_end
            if end < self.store.max_phys_offset:  # a put copied in part: it never happened
                log.warning("shard-%d: %s cuts an unfinished put (%d..%d) before leading",
                            self.index, self.name, end, self.store.max_phys_offset)
                self.truncate(end)
            self.epochs.truncate_from_end(end + 1)
            self.epochs.assign(a.epoch, end)  # before anything of the new epoch is written
            self.store.close()
            self.store = None
            try:
                shard = self._make_shard(self.directory)
            except BaseException:  # not leading after all: tried again on the next beat
                self.store = self.open_store()
                raise
        else:
            shard = self.shard
            self.epochs.assign(a.epoch, shard.store.max_phys_offset)
        cfg = self.config
        reads = getattr(shard, "reads", None)
        leader = LeaderState(self.index, self.name, a, shard.store, self.epochs,
                             min_insync=cfg.min_insync, lag_max_ms=cfg.replica_lag_max_ms,
                             timeout_ms=min(cfg.send_timeout_ms // 2, 5000),
                             confirmed=self._confirmed, clock=self.clock,
                             wake_readers=reads.wake if reads is not None else _nothing,
                             parts=replica_state.parts_of(shard))
        shard.store.replication = leader.wait_replicated
        shard.store.written = leader.wake
        if reads is not None:  # (a shard's readers; a coordinator has none)
            reads.confirmed = leader.confirmed
        self.shard, self.leader = shard, leader
        log.warning("shard-%d: %s leads, epoch %d, from offset %d", self.index, self.name,
                    a.epoch, shard.store.max_phys_offset)

    def _step_down(self) -> None:
        leader, shard = self.leader, self.shard
        leader.depose()
        self._confirmed = leader.confirmed()
        self.shard = self.leader = None
        shard.close()
        self.store = self.open_store()
        log.warning("shard-%d: %s no longer leads (epoch %d)", self.index, self.name,
                    leader.epoch)

    def _follow(self, a: Assignment) -> None:
        self._stop_following()
        self._following = _Follower(self, a, thread=self._fetch_threads)
        self._following.start()

    def truncate(self, cut: int) -> None:
        """Cut this follower's log at ``cut`` (a put boundary of the leader's log) and its
        epochs with it; its parts go (they may cover records cut away)."""
        self.store.close()
        truncate_log(os.path.join(self.directory, "commitlog"),
                     self.config.segment_size_bytes, cut)
        self.epochs.truncate_from_end(cut)
        replica_state.forget(self.directory)
        self.store = self.open_store()

    @property
    def following(self) -> "_Follower | None":
        return self._following

    def _stop_following(self) -> None:
        f, self._following = self._following, None
        if f is not None:
            f.stop()

    # ------------------------------------------------------- leader's calls
    def replica_fetch(self, follower: str, epoch: int, from_phys: int, wait_ms: int,
                      max_bytes: int, offsets_version: int, held: dict | None = None,
                      last_epoch: int | None = None) -> dict:
        leader = self.leader
        if leader is None:
            raise NotLeaderError(f"shard-{self.index}: {self.name} does not lead")
        reply = leader.serve_fetch(follower, epoch, from_phys, wait_ms, max_bytes,
                                   offsets_version, held, last_epoch)
        reply["kept"] = self._kept  # (the followers keep the group's newest assignment)
        return reply

    def replica_epoch_end(self, epoch: int) -> tuple[int, int]:
        """Where ``epoch`` ends in this leader's log (``EpochCache.end_offset_for``)."""
        shard = self.serving()
        return self.epochs.end_offset_for(epoch, shard.store.max_phys_offset)

    def status(self) -> dict:
        a, leader = self.assignment, self.leader
        out = {"shard": self.index, "name": self.name, "node": self.node, "pid": os.getpid(),
               "role": "leader" if leader is not None else "follower",
               "epoch": a.epoch if a else 0, "log_end": self.log_end(),
               "confirmed": leader.confirmed() if leader else self._confirmed}
        if leader is not None:
            out.update(leader.status())
        return out

    # --------------------------------------------------------------- loops
    def _beat_loop(self) -> None:
        every = self.config.replica_lease_ms / 5000.0
        failing = None
        while not self._stop.wait(every):
            try:
                self.heartbeat(act=False)
                failing = None
            except Exception as err:  # (the controller restarting, say): the next beat
                said = f"{type(err).__name__}: {err}"
                (log.warning if said != failing else log.debug)(
                    "shard-%d: %s heartbeat failed: %s", self.index, self.name, said)
                failing = said

    def _act_loop(self) -> None:
        """The role thread: acts on the latest assignment the heartbeats brought."""
        while not self._stop.is_set():
            with self._acting:
                while self._next is None and not self._stop.is_set():
                    self._acting.wait(1.0)
                a, self._next = self._next, None
            if a is None:
                continue
            try:
                self.act(a)
            except Exception:  # the next assignment tries again; never a dead role thread
                log.exception("shard-%d: %s acting on epoch %d failed", self.index,
                              self.name, a.epoch)

    def close(self) -> None:
        self._stop.set()
        with self._acting:
            self._acting.notify_all()
        with self._lock:
            self._stop_following()
            if self.leader is not None:
                self.leader.depose()
            if self.shard is not None:
                self.shard.close()
            if self.store is not None:
                self.store.close()


def _nothing() -> None:
    pass


class _Follower:
    """A follower's copying from the leader of assignment ``a`` (a thread, or ``step``
    driven by a test).

    A reply is applied only while this follower still copies from that leader and the
    log still ends where the fetch was asked from (Kafka's fetch state: leader, epoch,
    offset); ``stop`` takes the same lock, so once it returns nothing more of this
    follower's is written, even from a fetch still in flight."""

    def __init__(self, replica: ShardReplica, a: Assignment, *, thread: bool = True):
        self.replica, self.a = replica, a
        self._stop = threading.Event()
        self._apply = threading.Lock()
        self._offsets_version = -1
        self._held: dict = {}  # the versions of the leader's parts this replica holds
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"raymq-{replica.name}-fetch") if thread else None

    def start(self) -> None:
        if self._thread is not None:
            self._thread.start()

    def stop(self) -> None:
        with self._apply:  # (a reply being applied finishes first; none after)
            self._stop.set()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(2.0)  # (a fetch in flight may outlive this: it applies nothing)

    def _run(self) -> None:
        r = self.replica
        while not self._stop.is_set():
            try:
                self.step(FETCH_WAIT_MS)
            except Exception as err:  # the leader gone or deposed: the heartbeat says whom next
                if not isinstance(err, RayMQError):
                    log.warning("shard-%d: %s fetching from %s: %s: %s", r.index, r.name,
                                self.a.leader, type(err).__name__, err)
                self._stop.wait(0.1)

    def step(self, wait_ms: int = 0) -> bool:
        """One fetch from the leader, applied if still current; whether it was."""
        r = self.replica
        store = r.store
        if self._stop.is_set() or store is None:
            return False
        from_phys, last_epoch = store.max_phys_offset, r.epochs.latest_epoch()
        reply = r._call(self.a.leader, "replica_fetch",
                        (r.name, self.a.epoch, from_phys, wait_ms, FETCH_MAX_BYTES,
                         self._offsets_version, self._held, last_epoch), 30.0)
        with self._apply:
            if self._stop.is_set() or r.store is not store or \
                    store.max_phys_offset != from_phys or r.epochs.latest_epoch() != last_epoch:
                return False  # (asked of a leader this replica no longer follows, or stale)
            if "diverging" in reply:
                self._truncate(*reply["diverging"])
                return True
            self._take(reply)
            return True

    def _truncate(self, e: int, end: int) -> None:
        """Cut the log where it diverges from the leader's (KIP-279): one round; the next
        fetch, carrying the new latest epoch, says whether another is needed."""
        r = self.replica
        log_end = r.store.max_phys_offset
        cut = max(SEGMENT_HEADER_BYTES, r.epochs.truncation_offset(e, end, log_end))
        if cut >= log_end:
            # (nothing to cut, yet the leader does not take the position: the epochs
            # past the log end go, so the next fetch asks by an epoch the log holds)
            r.epochs.truncate_from_end(log_end)
            return
        log.warning("shard-%d: %s cuts its log from %d to %d (where it diverges from leader "
                    "%s, epoch %d)", r.index, r.name, log_end, cut, self.a.leader, e)
        r.truncate(cut)

    def _take(self, reply: dict) -> None:
        r = self.replica
        store = r.store
        if reply["data"]:
            store.append_replicated(reply["start"], reply["data"])
        end = store.max_phys_offset
        for e, s in reply["epochs"]:
            if e > r.epochs.latest_epoch() and s <= end:
                r.epochs.assign(e, s)
        r._confirmed = max(r._confirmed, min(reply["confirmed"], end))
        if reply.get("kept"):
            r._keep(reply["kept"])
        if reply["offsets"] is not None:
            store.offsets.replace(reply["offsets"])
            self._offsets_version = reply["offsets_version"]
        if reply["parts"]:
            store.flush()  # (what they cover durable here first)
            replica_state.install(r.directory, reply["parts"])
            self._held.update({n: p["version"] for n, p in reply["parts"].items()})
