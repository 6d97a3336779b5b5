"""Retention: which whole commit-log segments may go (by age, by size, for disk space).
Owns the policy, a sealed segment's summary and the rule; pure logic, no I/O here.

A shard's commit log is shared by its topics, so a segment goes only when every queue
with records in it is done with them (Kafka deletes a partition's segments; RocketMQ
deletes a commit-log file when its last message is older than ``fileReservedTime``).
A queue is done with its records in segment *i* when

- its topic was deleted (``deleted``: records of that topic before its deletion), or
- the newest record of segment *i* is older than the topic's ``retention_ms``, or
- the queue holds at least its ``retention_bytes`` in the segments after *i*.

Segments go oldest first and only as a prefix (the log's start is one offset), never
the one written to, never one a checkpoint does not cover yet, and never one holding a
record something still waits on (``pinned``: a half message not yet checked back, a
timer not yet due, an open transaction: the caller says from which offset on).  Above
the disk's clean ratio the oldest segments go even before their retention (RocketMQ's
``diskMaxUsedSpaceRatio``); the pins still hold.
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: Unlimited size (the default ``retention_bytes``).
UNLIMITED = -1


@dataclass(frozen=True)
class TopicRetention:
    """A topic's retention: ``ms`` of age, ``bytes`` per queue (``UNLIMITED``: none)."""

    ms: int
    bytes: int = UNLIMITED

    def over(self, settings: dict) -> "TopicRetention":
        """A topic's own ``retention_ms`` / ``retention_bytes`` (either may be missing or
        None) over this default."""
        ms, size = settings.get("retention_ms"), settings.get("retention_bytes")
        return TopicRetention(self.ms if ms is None else int(ms),
                              self.bytes if size is None else int(size))


@dataclass
class RetentionPolicy:
    """The cluster's default and each topic's override; ``deleted``: topic -> the log
    offset of its deletion (its records before it are garbage)."""

    default: TopicRetention
    topics: dict[str, TopicRetention] = field(default_factory=dict)
    deleted: dict[str, int] = field(default_factory=dict)
    #: topics whose records are kept by pins alone (a broker's own queues: what is still
    #: needed of them is pinned, the rest may go whatever its age)
    pinned_topics: frozenset = frozenset()

    def of(self, topic: str) -> TopicRetention:
        return self.topics.get(topic, self.default)


@dataclass
class SegmentSummary:
    """A sealed segment: where it starts and ends, its newest record's store time, and the
    bytes of each queue in it."""

    base: int
    end: int
    newest_ms: int
    queue_bytes: dict[tuple[str, int], int]

    @property
    def topics(self) -> set[str]:
        return {t for t, _q in self.queue_bytes}


def summarize(base: int, end: int, frames) -> SegmentSummary:
    """The summary of a sealed segment from its ``frames``: ``(buf, pos, count)`` each."""
    from raymq.storage.recovery import _queues_of  # (one rule for a frame's queues)
    from raymq.storage.records import frame_headers, frame_producer, record_sizes
    s = SegmentSummary(base, end, 0, {})
    for buf, pos, count in frames:
        s.newest_ms = max(s.newest_ms, frame_producer(buf, pos)[2])
        h = frame_headers(buf, pos, count)
        sizes = record_sizes(h)
        for (meta_off, topic_len, qid), idx in _queues_of(h):
            key = (bytes(buf[pos + meta_off:pos + meta_off + topic_len]).decode(), qid)
            s.queue_bytes[key] = s.queue_bytes.get(key, 0) + int(sizes[idx].sum())
    return s


@dataclass(frozen=True)
class Verdict:
    """How many leading segments may go, and why the next one may not (for status)."""

    count: int
    held_by: str  # "" when every candidate goes; else a topic, "pinned", "checkpoint"
    forced: int = 0  # of ``count``, how many go only for disk space
    end: int = 0  # where the last of them ends (0: none goes)
    held_bytes: int = 0  # the bytes ``held_by`` keeps in the next segment (all of it for a pin)


def expired_prefix(summaries: list[SegmentSummary], policy: RetentionPolicy, now_ms: int, *,
                   covered_end: int, pinned: int, force: int = 0) -> Verdict:
    """How many of ``summaries`` (the sealed segments, oldest first) may be deleted.

    ``covered_end``: what a checkpoint covers (a segment past it is still re-indexed on a
    restart); ``pinned``: the lowest offset something still waits on; ``force``: how
    many bytes to free for disk space whatever the retention says.
    """
    after: dict[tuple[str, int], int] = {}  # bytes of each queue in the segments after i
    later = []
    for s in reversed(summaries):
        later.append(dict(after))
        for q, b in s.queue_bytes.items():
            after[q] = after.get(q, 0) + b
    later.reverse()
    count, freed, forced, end = 0, 0, 0, 0
    for i, s in enumerate(summaries):
        if s.end > covered_end:
            return Verdict(count, "checkpoint", forced, end, s.end - s.base)
        if s.end > pinned:
            return Verdict(count, "pinned", forced, end, s.end - s.base)
        holder = _holder(s, later[i], policy, now_ms)
        if holder:
            if freed >= force:
                return Verdict(count, holder, forced, end, sum(
                    b for (t, _q), b in s.queue_bytes.items() if t == holder))
            forced += 1
        count += 1
        freed += s.end - s.base
        end = s.end
    return Verdict(count, "", forced, end)


def _holder(s: SegmentSummary, after: dict, policy: RetentionPolicy, now_ms: int) -> str:
    """The first topic that still keeps segment ``s``; "" when none does."""
    for (topic, qid), _b in s.queue_bytes.items():
        gone = policy.deleted.get(topic)
        if (gone is not None and s.end <= gone) or topic in policy.pinned_topics:
            continue
        r = policy.of(topic)
        if now_ms - s.newest_ms > r.ms:
            continue
        if r.bytes != UNLIMITED and after.get((topic, qid), 0) >= r.bytes:
            continue
        return topic
    return ""
