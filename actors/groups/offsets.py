"""Consumer groups' committed offsets on one shard, their lag, and offsets cut back at start.

Offsets are ``group@topic@queue`` keys in the store's offset table.  A commit is first a
record of the shard's log (``OFFSETS_TOPIC``, Kafka's ``__consumer_offsets``): written,
made durable and replicated as a send is -- refused while too few replicas are in sync,
not acknowledged by a deposed leader -- and then applied to the table.  The table keeps
the index of the last record it applied (``APPLIED_KEY``, saved with it); opening the
shard applies the records after it, so a new leader holds every acknowledged commit.
"""
from __future__ import annotations

import json
import logging

from raymq.actors.rocketmq_tx.halves import HALF_PROGRESS, OP_PROGRESS
from raymq.actors.protocol import HALF_TOPIC, OFFSETS_TOPIC, OP_TOPIC, dlq_topic
from raymq.storage import MessageStore, RecordBatch
from raymq.storage.errors import OffsetOutOfRangeError, QuotaExceededError, RequestTimeoutError
from raymq.storage.store import PutStatus

#: The offset table's key holding the index of the next commit record to apply.
APPLIED_KEY = "offsets-log@applied"

log = logging.getLogger("raymq.shard")


def offset_key(group: str, topic: str, queue_id: int) -> str:
    return f"{group}@{topic}@{queue_id}"


def _group_of(key: str) -> str | None:
    """The group of an offset table key (``offset_key``); None for the shard's own keys
    (its progress, a dead-letter resend's ``dlq-resend@group@shard``)."""
    parts = key.rsplit("@", 2)
    if len(parts) != 3 or not parts[2].isdigit() or parts[0] == "dlq-resend":
        return None
    return parts[0]


class GroupOffsets:
    """Committed offsets of the consumer groups reading a shard's queues."""

    def __init__(self, shard: int, store: MessageStore, max_groups: int = 10_000):
        self.shard = shard
        self.store = store
        self.max_groups = max_groups
        self.replay()
        self._groups = {g for key in store.offsets.snapshot() if (g := _group_of(key))}

    def forget_groups(self, groups) -> None:
        """Of ``groups``, whose offsets here were deleted, those with none left no longer
        count against ``max_groups`` (a group is counted once admitted, before its commit
        is written: only these are looked at, never a group in the middle of one)."""
        held = {_group_of(key) for key in self.store.offsets.snapshot()}
        self._groups -= set(groups) - held

    def commit(self, group: str, offsets: dict[tuple[str, int], int]) -> None:
        """Set committed offsets of a group (next offset to consume).  Idempotent.  Returns
        once the commit's record is durable (and held by every in-sync replica)."""
        values = self.values(group, offsets)
        if not values:
            return
        self.admit(group)
        applied = self._logged({"g": group, "o": values},
                               f"the commit of group {group!r}'s offsets", "commit again")
        self.store.offsets.update({**values, APPLIED_KEY: applied}, durable=False)

    def delete(self, group: str, queues: list[tuple[str, int]]) -> None:
        """Forget a group's committed offsets of ``queues`` (Kafka's OffsetDelete): a
        record of the log as a commit is, then applied to the table."""
        keys = [offset_key(group, t, q) for t, q in queues]
        if not keys:
            return
        applied = self._logged({"g": group, "o": {}, "d": keys},
                               f"deleting group {group!r}'s offsets", "delete again")
        self.store.offsets.delete(keys)
        self.store.offsets.update({APPLIED_KEY: applied}, durable=False)
        self.forget_groups([group])

    def _logged(self, record: dict, what: str, again: str) -> int:
        """Write ``record`` to the offsets log, durable (and held by every in-sync replica);
        the index of the next record to apply after it."""
        self.store.make_durable()  # (what the offsets pass, first: ``save_offsets``)
        body = json.dumps(record, separators=(",", ":")).encode()
        result = self.store.put(RecordBatch(OFFSETS_TOPIC, 0, [body]))
        if result.status is not PutStatus.PUT_OK:  # (written; a retry writes it again)
            raise RequestTimeoutError(f"shard-{self.shard}: {what} was not acknowledged "
                                      f"({result.status.name}); {again}")
        self.store.make_durable()  # (durable in every flush mode, as a commit was before)
        return result.queue_offsets[-1] + 1

    def replay(self) -> int:
        """Apply the commit (and delete) records the table does not hold yet; how many."""
        start = self.store.offsets.get(APPLIED_KEY, 0)
        end = self.store.max_queue_offset(OFFSETS_TOPIC, 0)
        if start >= end:
            return 0
        values: dict[str, int] = {}
        gone: set[str] = set()
        for m in self.store.scan_queue(OFFSETS_TOPIC, 0, start):
            record = json.loads(bytes(m.body))
            values.update(record["o"])
            gone -= set(record["o"])
            for key in record.get("d", ()):  # (in the log's order: a later commit wins)
                values.pop(key, None)
                gone.add(key)
        values[APPLIED_KEY] = end
        if gone:
            self.store.offsets.delete(gone)
        self.store.offsets.update(values)
        log.info("shard-%d: applied %d commits of offsets from the log", self.shard,
                 end - start)
        return end - start

    def values(self, group: str, offsets: dict[tuple[str, int], int]) -> dict[str, int]:
        """The offset table's entries of ``offsets``; ``OffsetOutOfRangeError`` for one past
        the end of its queue."""
        values = {}
        for (topic, qid), off in offsets.items():
            end = self.store.max_queue_offset(topic, qid)
            if not isinstance(off, int) or off < 0 or off > end:
                raise OffsetOutOfRangeError(
                    f"cannot commit offset {off!r} for {topic}/{qid} of group {group!r}: "
                    f"the queue holds offsets 0..{end}")
            values[offset_key(group, topic, qid)] = off
        return values

    def admit(self, group: str) -> None:
        """Count ``group`` among the groups with offsets here; ``QuotaExceededError`` when
        it is new and the shard holds ``max_groups`` already."""
        if group not in self._groups:
            if len(self._groups) >= self.max_groups:
                raise QuotaExceededError(f"cannot commit offsets of group {group!r}: shard-"
                                         f"{self.shard} holds offsets of {len(self._groups)} "
                                         f"groups, the most it takes (max_groups)")
            self._groups.add(group)

    def get(self, group: str, queues: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Committed offsets (-1: none yet)."""
        return {(t, q): self.store.offsets.get(offset_key(group, t, q)) for t, q in queues}

    def lag(self) -> dict[str, dict[str, int]]:
        """group -> {"topic/queue": messages not consumed yet}."""
        groups: dict[str, dict[str, int]] = {}
        for key, off in self.store.offsets.snapshot().items():
            parts = key.split("@")
            if len(parts) == 3:
                group, topic, qid = parts
                end = self.store.max_queue_offset(topic, int(qid))
                groups.setdefault(group, {})[f"{topic}/{qid}"] = end - off
        return groups

    def cut_back(self) -> None:
        """Offsets past the end of their queue would skip the records written next: cut
        back to the end.  (Possible with data written before offsets waited for what they
        pass, then lost to a power loss.)  Consumer offsets and dead-letter progress of a
        queue this shard does not have are left alone; its own transaction progress is
        always checked."""
        own = {HALF_PROGRESS: (HALF_TOPIC, 0), OP_PROGRESS: (OP_TOPIC, 0)}
        known = set(self.store.queues())
        cut = {}
        for key, value in self.store.offsets.snapshot().items():
            queue = own.get(key)
            if queue is None:
                parts = key.split("@")  # group@topic@queue, or dlq-resend@group@shard
                if len(parts) != 3 or not parts[2].isdigit():
                    continue
                topic = dlq_topic(parts[1]) if parts[0] == "dlq-resend" else parts[1]
                queue = (topic, int(parts[2]))
                if queue not in known:
                    continue
            end = self.store.max_queue_offset(*queue)
            if value > end:
                cut[key] = end
        if cut:
            log.warning("shard-%d: offsets past the end of their queues cut back: %s",
                        self.shard, cut)
            self.store.offsets.update(cut)
