"""The shapes of the calls a shard serves: checked before anything runs (issue 12 B, E).

A call with a wrong shape is answered with one ``InvalidMessageError`` line; the
``answers_in_one_line`` wrapper turns whatever a malformed argument still trips
deeper down into the same, so no call answers with a bare Python exception.
"""
from __future__ import annotations

import functools
import logging

from raymq.actors.protocol import ISOLATIONS, EndRequest, check_group
from raymq.storage.errors import InvalidMessageError, RayMQError
from raymq.storage.records import RecordBatch
from raymq.storage.producers import INTERNAL_PRODUCER_BASE

log = logging.getLogger("raymq.shard")

#: Most queues one pull or offsets call may name.
MAX_QUEUES_PER_CALL = 10_000



def is_int(x, lo: int = 0, hi: int = 2**63 - 1) -> bool:
    return type(x) is int and lo <= x <= hi


def need(ok: bool, what: str) -> None:
    if not ok:
        raise InvalidMessageError(what)


#: What a producer may ask a send to wait for: every in-sync replica (Kafka ``acks=all``,
#: RocketMQ ``SYNC_MASTER``), or the leader's own write (``acks=1``, ``ASYNC_MASTER``).
ACKS = ("all", "leader")


def check_send(batch, producer_id, sequence, ends, acks="all") -> list[EndRequest] | None:
    """A producer request: a RecordBatch (or None), two counters, ends (or None), acks."""
    need(acks in ACKS, f"acks must be one of {', '.join(ACKS)}, not {acks!r}")
    need(batch is None or isinstance(batch, RecordBatch), "a send carries a RecordBatch")
    need(is_int(producer_id) and is_int(sequence), "producer id and sequence must be "
                                                   "integers 0..2**63-1")
    return None if not ends else check_ends(ends)


def check_ends(ends) -> list[EndRequest]:
    need(isinstance(ends, (list, tuple)) and len(ends) <= MAX_QUEUES_PER_CALL,
         "transaction ends must be a list")
    out = []
    for e in ends:
        need(isinstance(e, EndRequest) or (isinstance(e, (list, tuple)) and len(e) == 4),
             "a transaction end is (group, transaction id, origins, state)")
        end = EndRequest.of(e) if not isinstance(e, EndRequest) else e
        need(isinstance(end.group, str) and isinstance(end.transaction_id, str)
             and isinstance(end.state, str), "group, transaction id and state must be str")
        need(all(is_int(o) for o in end.origins), "origins must be physical offsets (int)")
        out.append(end)
    return out


def check_queues(queues, what: str = "queue") -> None:
    need(isinstance(queues, (list, tuple, set, dict)) and len(queues) <= MAX_QUEUES_PER_CALL,
         f"a list of at most {MAX_QUEUES_PER_CALL} {what}s")
    for q in queues:
        need(isinstance(q, tuple) and len(q) == 2 and isinstance(q[0], str)
             and is_int(q[1], 0, 2**31 - 1), f"a {what} is (topic, queue id)")


def check_producer_ids(pids) -> None:
    """Client producer ids: a list of at most ``MAX_QUEUES_PER_CALL`` ints below the
    broker's own."""
    need(isinstance(pids, (list, tuple)) and len(pids) <= MAX_QUEUES_PER_CALL,
         f"a list of at most {MAX_QUEUES_PER_CALL} producer ids")
    for p in pids:
        need(is_int(p, 1, INTERNAL_PRODUCER_BASE - 1), "a producer id is an int of a client's")


#: Where a read below a queue's log start goes on (Kafka's ``auto.offset.reset``).
RESETS = ("earliest", "latest", "error")


def check_pull_options(group, isolation, form, tags, reset) -> None:
    """A pull's options: a group name (or None), an isolation, a form, a reset policy."""

    if group is not None:
        check_group(group)
    need(isolation in ISOLATIONS, f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
    need(form in ("messages", "spans", "kafka") and not (form != "messages" and tags),
         f"form must be 'messages', 'spans' or 'kafka' (without tags), got {form!r}")
    need(reset in RESETS, f"reset must be one of {RESETS}, got {reset!r}")


def check_pull(requests, wait_ms, tags) -> None:
    need(isinstance(requests, (list, tuple)) and len(requests) <= MAX_QUEUES_PER_CALL,
         "pull takes a list of (topic, queue id, offset, max messages)")
    for r in requests:
        need(isinstance(r, (tuple, list)) and len(r) == 4,
             "a pull request is (topic, queue id, offset, max messages)")
        check_queues([tuple(r[:2])])
        need(is_int(r[2], -(2**63)) and is_int(r[3]),
             "a pull's offset and max messages are integers (max >= 0)")
    need(is_int(wait_ms), "wait_ms must be an integer >= 0")
    need(tags is None or (isinstance(tags, dict) and all(
        isinstance(t, str) and isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)
        for t, v in tags.items())), "tags: {topic: [tag, ...]}")


def check_offsets(offsets, group: str) -> None:
    """A group's offsets: a valid group name, ``{(topic, queue id): offset}``."""
    check_group(group)
    need(isinstance(offsets, dict), "offsets: {(topic, queue id): offset}")
    check_queues(list(offsets))
    need(all(is_int(o) for o in offsets.values()), "an offset is an int >= 0")


def answers_in_one_line(method):
    """A public shard call: a malformed argument that trips Python deeper down is answered
    with one ``InvalidMessageError`` line (and logged with its traceback)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except RayMQError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError, IndexError,
                OverflowError, UnicodeError) as err:
            log.warning("shard: malformed %s call", method.__name__, exc_info=True)
            raise InvalidMessageError(f"malformed {method.__name__} request: "
                                      f"{type(err).__name__}: {err}") from None
    return call
