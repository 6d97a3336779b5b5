"""The replica group of one shard, as its leader and the controller see it: who leads
with which epoch, which replicas are in sync, how far each has copied, the confirmed
offset (Kafka's high watermark, RocketMQ's confirm offset) and whether a write may be
acknowledged, and the choice of a new leader.  Pure logic: no Ray, no I/O, time given.

Rules (Kafka's ``Partition``, RocketMQ 5's SyncStateSet):

- a follower is *caught up* when a fetch shows it holds everything the leader had when
  that fetch was asked; it stays in sync while it was caught up within
  ``lag_max_ms`` (``replica_lag_max_ms``), and leaves the set otherwise (``shrink``);
  one out of the set rejoins once it holds the confirmed offset (``fetched``);
- the confirmed offset is the least log end of the in-sync replicas (the leader's
  included), moving only while at least ``min_insync`` are in sync and never going
  back; readers see only up to it;
- a write ending at ``offset`` is acknowledged once the confirmed offset reached it and
  at least ``min_insync`` replicas are in sync (``ack``: else ``NOT_ENOUGH_REPLICAS``);
- a new leader is elected from the in-sync set only (``choose_leader``, the controller's
  ``ReplicaGroups._elect``), with the epoch bumped: a deposed leader's requests carry the
  old epoch and are refused (``check_epoch``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from raymq.storage.errors import NotEnoughReplicasError, NotLeaderError


def choose_leader(candidates, rank) -> str:
    """The one election rule (the controller's ``ReplicaGroups._elect`` applies it): the
    candidate ranking highest -- the controller ranks by the newest epoch a log holds,
    then the most log (RocketMQ's ``electMaster``) -- and among equals the first by name."""
    return max(sorted(candidates), key=rank)


class Ack(enum.Enum):
    """What a write ending at some offset can be answered now."""

    OK = "SEND_OK"              # min_insync replicas hold it
    WAIT = "WAIT"               # enough replicas in sync; not all of them hold it yet
    NOT_ENOUGH = "SLAVE_NOT_AVAILABLE"  # too few in sync (RocketMQ's status name)


@dataclass
class Follower:
    log_end: int = 0               # how far it holds the leader's log
    caught_up_ms: int = 0          # when a fetch last showed it caught up


@dataclass
class ReplicaSet:
    """One shard's group.  ``replicas`` are node ids, the leader among them."""

    shard: int
    replicas: list[str]
    leader: str
    epoch: int
    min_insync: int
    lag_max_ms: int
    in_sync: set[str] = field(default_factory=set)
    followers: dict[str, Follower] = field(default_factory=dict)
    leader_end: int = 0
    confirmed: int = 0
    epoch_start: int = 0           # where the current leader's epoch starts in the log

    def __post_init__(self):
        if self.leader not in self.replicas:
            raise ValueError(f"shard-{self.shard}: leader {self.leader} is not a replica")
        if not 1 <= self.min_insync <= len(self.replicas):
            raise ValueError(f"shard-{self.shard}: min_insync {self.min_insync} must be "
                             f"1..{len(self.replicas)}")
        self.in_sync = set(self.in_sync or self.replicas)
        for r in self.replicas:
            if r != self.leader:
                self.followers.setdefault(r, Follower())

    # --------------------------------------------------------------- leader side
    def check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise NotLeaderError(f"shard-{self.shard}: epoch {epoch} is not the current "
                                 f"{self.epoch} (leader {self.leader})")

    def took_over(self, log_end: int) -> None:
        """The elected leader starts its epoch at its log end ``log_end`` (what it writes
        next is the epoch's; it records (epoch, log_end) in its epoch file)."""
        self.leader_end = self.epoch_start = log_end
        self._advance()

    def appended(self, log_end: int) -> None:
        """The leader's log now ends at ``log_end``."""
        self.leader_end = max(self.leader_end, log_end)
        self._advance()

    def fetched(self, replica: str, log_end: int, leader_end_when_asked: int,
                now_ms: int) -> None:
        """A follower's fetch, asked when the leader's log ended at
        ``leader_end_when_asked``, shows it holds up to ``log_end``."""
        f = self.followers[replica]
        f.log_end = log_end  # (it goes back when the follower cut its log or lost its disk)
        if log_end >= leader_end_when_asked:
            f.caught_up_ms = now_ms
        elif log_end < self.confirmed:  # it lacks what was acknowledged: out at once
            f.caught_up_ms = -(1 << 62)
        if replica not in self.in_sync and f.log_end >= max(self.confirmed, self.epoch_start) \
                and now_ms - f.caught_up_ms <= self.lag_max_ms:
            self.in_sync.add(replica)  # back in sync (holding all of this epoch's start)
        self._advance()

    def lagging(self, now_ms: int) -> list[str]:
        """The in-sync followers not caught up within ``lag_max_ms``."""
        return [r for r in sorted(self.in_sync) if r != self.leader
                and now_ms - self.followers[r].caught_up_ms > self.lag_max_ms]

    def shrink(self, now_ms: int) -> list[str]:
        """Followers not caught up within ``lag_max_ms`` leave the in-sync set; who."""
        out = self.lagging(now_ms)
        self.in_sync.difference_update(out)
        self._advance()
        return out

    def set_in_sync(self, in_sync: set[str]) -> None:
        """The in-sync set as the controller agreed it (the leader in it)."""
        self.in_sync = set(in_sync) & (set(self.replicas))
        self._advance()

    def ack(self, offset: int) -> Ack:
        """Whether a write ending at ``offset`` can be acknowledged now."""
        if len(self.in_sync) < self.min_insync:
            return Ack.NOT_ENOUGH
        return Ack.OK if self.confirmed >= offset else Ack.WAIT

    def refuse_if_short(self) -> None:
        """``NotEnoughReplicasError`` (one line) when too few replicas are in sync."""
        if len(self.in_sync) < self.min_insync:
            raise NotEnoughReplicasError(
                f"shard-{self.shard}: {len(self.in_sync)} replica(s) in sync "
                f"({', '.join(sorted(self.in_sync))}), min_insync_replicas is "
                f"{self.min_insync}")

    def _advance(self) -> None:
        """The confirmed offset: held by every in-sync replica (any of them may be the next
        leader), and only while at least ``min_insync`` are in sync (so it is what that
        many hold)."""
        if len(self.in_sync) < self.min_insync:
            return
        ends = [self.leader_end] + [self.followers[r].log_end for r in self.in_sync
                                    if r != self.leader]
        self.confirmed = max(self.confirmed, min(ends))

    # ---------------------------------------------------------- controller side
