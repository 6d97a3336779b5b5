"""Retries and dead letters (seed 003): a failed message's copy to its group's retry topic
through the delay levels, or to its dead-letter topic; the operator's ``dlq resend``.

The shard writes what this builds through its own send path (``store_request``).
"""
from __future__ import annotations

import hashlib
import threading
from typing import Callable

from raymq.actors.front.reads import stored_message
from raymq.actors.protocol import Prop, SendReply, dlq_topic, make_msg_id, retry_topic
from raymq.actors.timing.delay import for_live_topics, of_live_topic
from raymq.storage import MessageStore, RecordBatch
from raymq.storage.errors import InvalidMessageError, StorageError
from raymq.storage.producers import INTERNAL_PRODUCER_BASE
from raymq.storage.records import StoredMessage, none_if_empty

#: Dead-letter resends: this plus a 56-bit hash of the group (``dlq_resend_pid``).
DLQ_RESEND_PID_BASE = INTERNAL_PRODUCER_BASE + (1 << 61)
#: Properties a retry copy drops (it is no longer delayed or diverted).
_DIVERSION_PROPS = (Prop.DELAY, Prop.DELIVER_AT, Prop.DELIVER_AFTER, Prop.REAL_TOPIC,
                    Prop.REAL_QID, Prop.REAL_FLAGS)


def dlq_resend_pid(group: str) -> int:
    """The producer id of a group's dead-letter resends (stable across restarts)."""
    digest = hashlib.blake2b(group.encode(), digest_size=7, person=b"raymq-dlq").digest()
    return DLQ_RESEND_PID_BASE + int.from_bytes(digest, "big")


def dlq_progress_key(group: str, shard: int) -> str:
    """The offsets key of a group's dead-letter resend progress (older versions' progress)."""
    return f"dlq-resend@{group}@{shard}"


class DeadLetters:
    """Retry copies and dead letters of one shard."""

    def __init__(self, shard: int, store: MessageStore, config, levels_ms: tuple[int, ...],
                 store_request: Callable[..., SendReply], metrics):
        self.shard = shard
        self.store = store
        self.config = config
        self.levels_ms = levels_ms
        self._store_request = store_request  # (batch, producer id, sequence, ends) -> reply
        self.metrics = metrics
        self._resend_lock = threading.Lock()  # one resend of all dead letters at a time

    def send_back(self, group: str, phys_offset: int, *, reason: str,
                  dead_letter: bool, retry_after_ms: int | None = None) -> dict:
        """A consumer failed on a message: redeliver it later, or dead-letter it.

        The copy goes to the group's retry topic (queue = this shard) through
        the delay levels (``retry_first_level`` + reconsume count), or the timer when the
        consumer asked for ``retry_after_ms``; once the
        reconsume count reaches ``max_reconsume`` it goes to the group's
        dead-letter topic instead.
        """
        m = stored_message(self.store, self.shard, phys_offset)
        props = dict(m.properties)
        count = m.reconsume_count + 1
        props[Prop.PRODUCER_MSG_ID] = props.get(Prop.PRODUCER_MSG_ID) \
            or make_msg_id(self.shard, phys_offset)
        props[Prop.RETRY_TOPIC] = props.get(Prop.RETRY_TOPIC, m.topic)
        props[Prop.CONSUME_GROUP] = group
        for p in _DIVERSION_PROPS:
            props.pop(p, None)
        if count > self.config.max_reconsume or dead_letter:
            topic = dlq_topic(group)
            props[Prop.DLQ_REASON] = reason.encode()[:500].decode(errors="ignore") \
                or "max reconsume count reached"
            self.metrics.inc("dead_letters", 1, group=group)
        else:
            topic = retry_topic(group)
            if retry_after_ms is not None:
                props[Prop.DELIVER_AFTER] = str(retry_after_ms)
            else:
                level = min(self.config.retry_first_level + count - 1, len(self.levels_ms))
                props[Prop.DELAY] = str(level)
            self.metrics.inc("retries", 1, group=group)
        batch = RecordBatch(topic, self.shard, [m.body], keys=[m.key], tags=[m.tags],
                            properties=[props], born_ms=m.born_ms, reconsume=count,
                            headers=none_if_empty([m.headers]))
        reply = self._store_request(batch, 0, 0, None)
        return {"topic": topic, "reconsume_count": count, "phys": reply.phys[0]}

    def list(self, group: str, offset: int, max_messages: int) -> list[StoredMessage]:
        """The group's dead letters from ``offset`` (those of a topic deleted since they
        were written are gone with it)."""
        return for_live_topics(self.store, self.store.read_queue(
            dlq_topic(group), self.shard, offset, max_messages))

    def resend(self, group: str, phys_offsets: list[int] | None) -> list[str]:
        """Send dead letters back to the group's retry topic, reconsume count reset.

        Without ``phys_offsets``: every dead letter not resent before, exactly
        once.  The copies are written as an idempotent producer of the shard's
        own (one per group) whose sequence is the dead-letter queue offset they
        reach, so the progress is stored with the copies themselves: a resend
        cut short after its copies and before its progress (a crash) is
        neither lost nor, when run again, written twice.  Returns the ids of
        the resent dead letters.  With ``phys_offsets`` (an operator's pick)
        each call resends them again.
        """
        if phys_offsets is not None:
            return self._resend(group, self._picked(group, phys_offsets), 0, 0)
        with self._resend_lock:  # two at once would read the same progress and overlap
            msgs = self._not_resent(group)
            sequence = msgs[-1].queue_offset + 1 if msgs else 0
            ids = self._resend(group, for_live_topics(self.store, msgs),
                               dlq_resend_pid(group), sequence)
            if msgs:
                self.store.save_offsets({dlq_progress_key(group, self.shard): sequence})
            return ids

    def _not_resent(self, group: str) -> list[StoredMessage]:
        topic = dlq_topic(group)
        end = self.store.max_queue_offset(topic, self.shard)
        done = max(self.store.offsets.get(dlq_progress_key(group, self.shard), 0),
                   self.store.last_sequence(dlq_resend_pid(group)))
        start = min(max(0, done), end)
        return self.store.read_queue(topic, self.shard, start, end - start)

    def _picked(self, group: str, phys_offsets: list[int]) -> list[StoredMessage]:
        msgs = [stored_message(self.store, self.shard, p) for p in phys_offsets]
        bad = [m for m in msgs if m.topic != dlq_topic(group)]
        if bad:
            raise InvalidMessageError(f"{make_msg_id(self.shard, bad[0].phys_offset)} is not "
                                      f"a dead letter of group {group!r}")
        gone = [m for m in msgs if not of_live_topic(self.store, m)]
        if gone:
            raise InvalidMessageError(f"dead letter {make_msg_id(self.shard, gone[0].phys_offset)}"
                                      f" was of topic {gone[0].properties.get(Prop.RETRY_TOPIC)!r},"
                                      f" deleted since: it went with its topic")
        return msgs

    def _resend(self, group: str, msgs: list[StoredMessage], pid: int,
                sequence: int) -> list[str]:
        """Write the copies (reconsume count reset, reason dropped); their ids."""
        if not msgs:
            return []
        props = []
        for m in msgs:
            p = dict(m.properties)
            p.pop(Prop.DLQ_REASON, None)
            props.append(p)
        sent = self._store_request(
            RecordBatch(retry_topic(group), self.shard, [m.body for m in msgs],
                        keys=[m.key for m in msgs], tags=[m.tags for m in msgs],
                        properties=props, born_ms=[m.born_ms for m in msgs],
                        headers=none_if_empty([m.headers for m in msgs])),
            pid, sequence, None)
        if sent.status != "SEND_OK":
            raise StorageError(f"dead letters of {group!r} resent but not durable "
                               f"({sent.status}); resend them again")
        return [make_msg_id(self.shard, m.phys_offset) for m in msgs]
