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
controller and the other replicas.  The leader's side is ``leader``, the follower's
``follower``, the in-sync rules ``in_sync``, the controller's side ``groups``.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Callable

from raymq.actors.replication import parts
from raymq.actors.replication.assignment import (KEPT_ASSIGNMENT, KEPT_METADATA, Assignment,
                                                 read_kept)
from raymq.actors.replication.follower import Follower
from raymq.actors.replication.leader import _ACKS, LeaderState
from raymq.storage import MessageStore
from raymq.storage.clock import Clock, SystemClock
from raymq.storage.epochs import EpochCache
from raymq.storage.errors import NotLeaderError
from raymq.storage.fileutil import atomic_write
from raymq.storage.replication import cut_store, restart_store_at

log = logging.getLogger("raymq.replica")

#: What a leader serves that writes: refused while too few replicas are in sync, and
#: acknowledged once every in-sync replica holds it (a commit of offsets is a record).
WRITES = frozenset({"send", "ktx_send", "ktx_commit_batch", "commit_offsets",
                    "delete_offsets"})
CLOSE_WAIT_S = 12.0  # (a heartbeat's time-out is 10 s)


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
        self._following: Follower | None = None
        self._confirmed = 0  # the last confirmed offset learned from a leader
        self._fresh = True   # until the first heartbeat: this process just started
        self._stop = threading.Event()
        self._acting = threading.Condition()
        self._next: Assignment | None = None
        self._threads = [threading.Thread(target=loop, daemon=True, name=f"raymq-{name}-{what}")
                         for loop, what in ((self._beat_loop, "heartbeat"),
                                            (self._act_loop, "role"))] if background else []
        for t in self._threads:
            t.start()

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
                             parts=parts.parts_of(shard))
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
        self._following = Follower(self, a, thread=self._fetch_threads)
        self._following.start()

    def truncate(self, cut: int) -> None:
        """Cut this follower's log at ``cut`` (a put boundary of the leader's log) and its
        epochs with it; its parts go (they may cover records cut away)."""
        self.store.close()
        cut_store(self.directory, self.config.segment_size_bytes, cut)
        self.epochs.truncate_from_end(cut)
        parts.forget(self.directory)
        self.store = self.open_store()

    def restart_at(self, base: int) -> None:
        """Empty this follower's store and start its log at ``base`` (the leader's first
        segment: what came before aged out there); its parts go."""
        self.store.close()
        restart_store_at(self.directory, self.config.segment_size_bytes, base)
        parts.forget(self.directory)
        self.store = self.open_store()

    @property
    def following(self) -> "Follower | None":
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
        while not self._stop.wait(0.0 if self._send_meta and failing is None else every):
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
        """Stop; return once no call of this replica to the controller is in flight (a
        teardown kills the controller next), or after a heartbeat's time-out."""
        self._stop.set()
        with self._acting:
            self._acting.notify_all()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
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
