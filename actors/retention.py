"""A shard's retention: which of its segments may go, and a disk that never fills.
Owns the shard's ``Janitor``: the policy (cluster defaults, each topic's own), the pins
(what the shard's parts still need), the disk watermarks and the refusal of writes.

Every ``retention_check_ms`` the janitor checkpoints the store (a segment goes only once
a checkpoint covers it), asks each part of the shard from where on it still needs the
log (``pins``: a half message not yet checked back, a timer not yet due, a delay level's
next message, an open Kafka-style transaction, the group-offset commits not yet in the
offsets table), and lets the store delete the oldest segments its policy gives up
(``raymq.storage.retention``).  Above ``disk_clean_ratio`` of the data directory's
filesystem it deletes the oldest segments even before their retention; above
``disk_full_ratio`` writes are refused with a retriable ``DiskFullError`` until space
comes back (``refuse_if_full`` measures the disk every 0.2 s or MiB written).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from raymq.actors.groups.offsets import APPLIED_KEY as OFFSETS_APPLIED_KEY
from raymq.actors.kafka_tx.shard_side import KTX_INDEX_TOPIC
from raymq.actors.protocol import (HALF_TOPIC, OFFSETS_TOPIC, OP_TOPIC, SCHEDULE_TOPIC,
                                   TIMER_CANCEL_TOPIC, TIMER_DONE_TOPIC, TIMER_TOPIC)
from raymq.actors.rocketmq_tx.halves import HALF_PROGRESS, OP_PROGRESS
from raymq.actors.protocol import check_user_topic
from raymq.actors.timing.roll import roll_delays, roll_timers
from raymq.storage.errors import (ConcurrentTransactionsError, DiskFullError, InvalidMessageError,
                                  StorageError)
from raymq.storage.retention import RetentionPolicy, TopicRetention, Verdict
from raymq.storage.topics import TOPIC_DELETED

log = logging.getLogger("raymq.shard")

#: The broker's own queues: what of them is still needed is pinned, the rest goes.
PINNED_TOPICS = frozenset({SCHEDULE_TOPIC, HALF_TOPIC, OP_TOPIC, OFFSETS_TOPIC, TIMER_TOPIC,
                           TIMER_DONE_TOPIC, TIMER_CANCEL_TOPIC, KTX_INDEX_TOPIC,
                           TOPIC_DELETED})
_RECHECK_S = 0.2
_RECHECK_BYTES = 1 << 20
_NOT_PINNED = 1 << 62


class Janitor:
    def __init__(self, shard, settings: Callable[[], dict] | None = None):
        """The janitor of ``shard`` (a ``BrokerShard``: its store, its parts' pins, its
        ``drop_topic``); ``settings``: the controller's ``topic_settings`` (None: none)."""
        self.shard = shard
        self.index = shard.index
        self.store = shard.store
        self.config = shard.config
        self.clock = shard.clock
        self.metrics = shard.metrics
        self._settings = settings  # -> {"topics": {topic: {"retention_ms": ..}}, "deleted": []}
        self.topic_settings: dict[str, dict] = {}
        self.full = False
        self.used_ratio, self.free_bytes = 0.0, 0
        self._measured_s, self._measured_end = 0.0, 0
        self.last: Verdict | None = None
        self._told_clean = False
        self._lock = threading.Lock()  # one round at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ policy
    def policy(self) -> RetentionPolicy:
        default = TopicRetention(self.config.retention_ms, self.config.retention_bytes)
        topics = {topic: default.over(v) for topic, v in self.topic_settings.items()}
        return RetentionPolicy(default, topics, self.store.retention.deleted(), PINNED_TOPICS)

    def _drop_deleted(self, names: list[str], deleting: dict | None = None) -> dict:
        """Topics the controller deleted that this store still holds (the client's call to
        this shard did not come through, or was refused for now): dropped now.  Those
        ``deleting`` still waits for this shard to drop are asked of ``drop_topic`` even
        when no queue of theirs is left (their offsets and halves go too), and once it
        returned they are confirmed: the topic -> its deletion, for the controller."""
        held = {t for t, _q in self.store.queues()}
        waiting = {t: d.get("version") for t, d in (deleting or {}).items()
                   if self.index in d.get("shards", ())}
        confirmed = {}
        for topic in list(names) + [t for t in waiting if t not in names]:
            if topic not in held and topic not in waiting:
                continue
            try:
                self.shard.drop_topic(topic)
            except Exception as err:  # (refused for now: asked again next round)
                log.warning("shard-%d: deleted topic %s not dropped yet: %s", self.index,
                            topic, err)
                continue
            if topic in waiting:
                confirmed[topic] = waiting[topic]
        return confirmed

    def pinned(self, wanted: int = _NOT_PINNED) -> int:
        """The lowest log offset a part of the shard still needs.  What holds back the
        segments ending by ``wanted`` is carried forward first when it can be
        (``_carriers``: timers and delayed messages rolled to the head of the log,
        cancellations and the Kafka-style index written as a snapshot there); a half
        is carried by the check rounds, which re-put it."""
        low, by = self._lowest_pin()
        carriers, tried = self._carriers(), set()
        while low < wanted and by in carriers and by not in tried:
            tried.add(by)
            try:
                carriers[by](wanted)
            except (OSError, StorageError) as err:  # (a disk with no room for the copies:
                # what lies below this pin still goes, and makes room for the next round)
                log.warning("shard-%d: %s not carried forward: %s", self.index, by, err)
                break
            low, by = self._lowest_pin()
        return low

    def _carriers(self) -> dict[str, Callable[[int], object]]:
        sh = self.shard
        return {KTX_INDEX_TOPIC: lambda _w: sh.ktx.compact(force=True),
                TIMER_TOPIC: lambda w: roll_timers(sh.timers, w),
                SCHEDULE_TOPIC: lambda w: roll_delays(sh.delays, w),
                TIMER_CANCEL_TOPIC: lambda _w: sh.cancels.compact()}

    def _lowest_pin(self) -> tuple[int, str]:
        queue_pins, phys_pins = shard_pins(self.shard)
        low, by = min(phys_pins, default=_NOT_PINNED), ""
        retention = self.store.retention
        for topic, qid, offset in queue_pins:
            entry = self.store.read_cq(topic, qid, max(offset, retention.log_start(topic, qid)),
                                       1)
            if len(entry) and int(entry["phys"][0]) < low:
                low, by = int(entry["phys"][0]), topic
        return low, by

    # ------------------------------------------------------------- disk
    def measure(self) -> None:
        self.used_ratio, self.free_bytes = self.store.retention.disk_usage()
        self._measured_s, self._measured_end = time.monotonic(), self.store.max_phys_offset
        was, self.full = self.full, self.used_ratio > self.config.disk_full_ratio
        if self.full and not was:
            log.error("shard-%d: disk %.0f%% used (%d bytes free) is over disk_full_ratio "
                      "%.2f: writes are refused until space comes back", self.index,
                      100 * self.used_ratio, self.free_bytes, self.config.disk_full_ratio)
        elif was and not self.full:
            log.warning("shard-%d: disk %.0f%% used: writes resume", self.index,
                        100 * self.used_ratio)

    def refuse_if_full(self, batch=None) -> None:
        """``DiskFullError`` while the disk is over ``disk_full_ratio``.  The disk is measured
        again (a ``statvfs``: microseconds) every ``_RECHECK_S`` or every ``_RECHECK_BYTES``
        written, whichever comes first, so a disk filling fast is seen before it is full
        and a disk given space back takes writes again soon.  Nothing to write
        (no ``batch``, or an empty one): nothing refused."""
        if batch is None or not len(batch):
            return
        end = self.store.max_phys_offset
        if time.monotonic() - self._measured_s >= _RECHECK_S or \
                end - self._measured_end >= _RECHECK_BYTES:
            self.measure()
        if self.full:
            raise DiskFullError(f"shard-{self.index}: disk full ({self.free_bytes} bytes free, "
                                f"{100 * self.used_ratio:.0f}% used, over disk_full_ratio "
                                f"{self.config.disk_full_ratio}); retry later")

    # ------------------------------------------------------------ rounds
    def run_once(self) -> Verdict:
        with self._lock:
            if self._settings is not None:
                try:
                    got = self._settings() or {}
                    self.topic_settings = got.get("topics", {})
                    confirmed = self._drop_deleted(got.get("deleted", []),
                                                   got.get("deleting", {}))
                    if confirmed:  # (the controller then lets the name be created again)
                        self._settings(shard=self.index, dropped=confirmed)
                except Exception as err:  # (the controller away: the last settings hold)
                    log.info("shard-%d: topic settings not refreshed: %s", self.index, err)
            self.measure()
            try:
                self.store.checkpoint()
            except OSError as err:  # (a disk with no room even for that: what an earlier
                # checkpoint covers may still go, and make room)
                log.warning("shard-%d: checkpoint before retention failed: %s", self.index, err)
            force = 0
            if self.used_ratio > self.config.disk_clean_ratio:
                total = self.free_bytes / max(1e-9, 1 - self.used_ratio)
                force = int((self.used_ratio - self.config.disk_clean_ratio) * total) + 1
            policy, now = self.policy(), self.clock.now_ms()
            # (the pins are asked for only when some segment could go without them)
            wanted = self.store.retention.plan(policy, now, force_bytes=force)
            verdict = wanted if not wanted.count else self.store.retention.apply(
                policy, now, pinned=self.pinned(wanted.end), force_bytes=force)
            if verdict.count:
                log.info("shard-%d: deleted %d segments (%d for disk space); the log starts "
                         "at %d", self.index, verdict.count, verdict.forced,
                         self.store.min_phys_offset)
                self.metrics.inc("segments_deleted", verdict.count)
                self.measure()
                with self.shard.ktx.lock:  # (aborted ranges of what aged out are forgotten)
                    self.shard.ktx.state.prune_aborted(
                        lambda q: self.store.retention.log_start(*q))
            elif force and not self._told_clean:  # (once, until the disk is below it)
                log.warning("shard-%d: disk %.0f%% used is over disk_clean_ratio %.2f, and no "
                            "segment of this shard can go (%s)", self.index,
                            100 * self.used_ratio, self.config.disk_clean_ratio,
                            f"kept by {verdict.held_by}" if verdict.held_by
                            else "none is sealed yet")
            self._told_clean = bool(force)
            self.last = verdict
            return verdict

    def status(self) -> dict:
        """The log start of each queue that lost messages, what was deleted, the disk."""
        store, v = self.store, self.last
        starts = {f"{t}/{q}": s for t, q in store.queues()
                  if (s := store.retention.log_start(t, q))}
        return {"log_starts": starts, "log_start_phys": store.min_phys_offset,
                "deleted_segments": self.store.retention.deleted_segments,
                "deleted_bytes": self.store.retention.deleted_bytes,
                "disk_used_ratio": round(self.used_ratio, 4), "disk_free_bytes": self.free_bytes,
                "disk_full": self.full, "oldest_held_by": v.held_by if v else "",
                "oldest_held_bytes": v.held_bytes if v else 0}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"raymq-shard-{self.index}-retention")
        self._thread.start()

    def _loop(self) -> None:
        self.measure()
        while not self._stop.wait(self.config.retention_check_ms / 1000.0):
            try:
                self.run_once()
            except Exception:  # the loop must not die; the next round retries
                log.exception("shard-%d: retention round failed", self.index)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def shard_pins(shard) -> tuple[list[tuple[str, int, int]], list[int]]:
    """From where on each part of ``shard`` still needs the log: queue offsets of its own
    queues (and of an open Kafka-style transaction's), and physical offsets (none now)."""
    offsets = shard.store.offsets
    queue_pins = [(OFFSETS_TOPIC, 0, offsets.get(OFFSETS_APPLIED_KEY, 0)),
                  (HALF_TOPIC, 0, offsets.get(HALF_PROGRESS, 0)),
                  (OP_TOPIC, 0, offsets.get(OP_PROGRESS, 0))]
    queue_pins += [(SCHEDULE_TOPIC, lvl, shard.delays.progress(lvl + 1))
                   for lvl in range(len(shard.delays.levels_ms))]
    queue_pins += shard.timers.retention_pins() + shard.ktx.retention_pins()
    queue_pins.append(shard.cancels.retention_pin())
    # (a pending half's latest copy lies at or past the half progress: its end reads
    # that one once its first copy aged out)
    return queue_pins, []


def drop_topic(shard, topic: str) -> bool:
    """The controller deleted ``topic``: what ``shard`` holds of it goes -- its pending
    RocketMQ-style halves (rolled back: nothing prepared for it is ever delivered), its
    groups' committed offsets, its queues (``MessageStore.delete_topic``: a tombstone;
    its records then go with their segments).  Refused while an open Kafka-style
    transaction writes to it (its markers would land in a deleted queue).  Idempotent;
    whether the shard held any of it."""
    check_user_topic(topic)
    shard.routes.refresh()
    if any(t == topic for t, _q in shard.routes.sorted()):
        raise InvalidMessageError(f"topic {topic!r} still exists: delete it with "
                                  f"mq.delete_topic or `raymq topic delete`")
    with shard.ktx.lock:
        held = sorted({pid for (t, _q), h in shard.ktx.state._holding.items() if t == topic
                       for pid in h})
    if held:
        raise ConcurrentTransactionsError(
            f"topic {topic!r} is written by open Kafka-style transactions (producer ids "
            f"{held[:5]}): delete it once they end, or abort them (raymq tx abort)")
    for half in shard.half_list(limit=1 << 30) + shard.half_list(expired=True, limit=1 << 30):
        if half["topic"] == topic:
            shard.resolve_half(half["origin"], "ROLLBACK")
    offsets = shard.store.offsets
    keys = [k for k in offsets.snapshot() if k.split("@")[1:2] == [topic]]
    offsets.delete(keys)
    shard.offsets.forget_groups({k.split("@")[0] for k in keys})  # (left with none: uncounted)
    # (with its Kafka-style aborted ranges: a topic created again starts at offset 0)
    dropped = shard.ktx.drop_topic(topic, shard.store.delete_topic)
    if dropped:
        log.warning("shard-%d: topic %s deleted: its queues dropped, its records go with "
                    "their segments", shard.index, topic)
    return dropped
