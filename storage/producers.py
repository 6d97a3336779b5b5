"""Idempotent producers: the last sequence of every producer id, and recent results.
Owns the in-memory ``ProducerTable``: duplicate detection, expiry, its snapshot.

A producer numbers its put requests to a shard (1, 2, 3...).  A request whose
sequence is not above the last one seen from that producer is a duplicate --
a resend after a timeout whose first attempt did land -- and is answered with
the original result instead of being stored again (seed 003, cases 1-4).

The table is rebuilt on start from a snapshot taken at the checkpoint plus the
frames written after it (each frame carries its producer id and sequence), so
it survives restarts.  Pure logic: no I/O here.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


#: Producer ids at or above this are the broker's own (clients draw theirs below 2**62).
INTERNAL_PRODUCER_BASE = 1 << 62
#: A producer's recent put results (the offsets a resend of one of its last puts is
#: answered with: up to 24 bytes a record, ``results_per_producer`` puts) are dropped
#: once it has not been seen for this long; its last sequence stays until
#: ``producer_expiry_ms``, so a later resend is still known as one, answered without
#: offsets (as after a restart).  A client resends within its send timeout x retries.
RECENT_RESULTS_MS = 10 * 60 * 1000


@dataclass
class CachedPut:
    sequence: int
    phys: np.ndarray
    queue_offsets: np.ndarray
    sizes: np.ndarray
    end_offset: int


@dataclass
class ProducerState:
    last_sequence: int
    last_seen_ms: int
    recent: "OrderedDict[int, CachedPut]"


class ProducerTable:
    def __init__(self, results_per_producer: int = 8):
        self.results_per_producer = results_per_producer
        self._states: dict[int, ProducerState] = {}
        self._next_sweep_ms = 0  # when ``expire`` next drops idle producers' results

    def __len__(self) -> int:
        return len(self._states)

    def last_sequence(self, producer_id: int) -> int | None:
        state = self._states.get(producer_id)
        return None if state is None else state.last_sequence

    def is_duplicate(self, producer_id: int, sequence: int) -> bool:
        state = self._states.get(producer_id)
        return state is not None and sequence <= state.last_sequence

    def cached(self, producer_id: int, sequence: int) -> CachedPut | None:
        state = self._states.get(producer_id)
        return None if state is None else state.recent.get(sequence)

    def record(self, producer_id: int, sequence: int, phys: np.ndarray,
               queue_offsets: np.ndarray, sizes: np.ndarray, end_offset: int,
               now_ms: int) -> None:
        """Note a stored put (or one more frame of it, during recovery)."""
        state = self._states.get(producer_id)
        if state is None:
            state = self._states[producer_id] = ProducerState(sequence, now_ms, OrderedDict())
        state.last_sequence = max(state.last_sequence, sequence)
        state.last_seen_ms = max(state.last_seen_ms, now_ms)
        prev = state.recent.get(sequence)
        if prev is not None:  # another frame of the same put
            prev.phys = np.concatenate([prev.phys, phys])
            prev.queue_offsets = np.concatenate([prev.queue_offsets, queue_offsets])
            prev.sizes = np.concatenate([prev.sizes, sizes])
            prev.end_offset = max(prev.end_offset, end_offset)
            return
        state.recent[sequence] = CachedPut(sequence, phys, queue_offsets, sizes, end_offset)
        while len(state.recent) > self.results_per_producer:
            state.recent.popitem(last=False)

    def expire(self, now_ms: int, expiry_ms: int) -> int:
        """Forget producers not seen for ``expiry_ms``; return how many.  Also drops the
        recent results of producers not seen for ``RECENT_RESULTS_MS`` (looked at once
        every tenth of that): a client that went away leaves its last sequence only.

        Ids from ``INTERNAL_PRODUCER_BASE`` up belong to the broker's own writers
        (the delay scheduler keeps its progress as their sequence): never expired.
        """
        step = RECENT_RESULTS_MS // 10
        if not 0 < self._next_sweep_ms - now_ms <= step:  # due (or the clock stepped back)
            self._next_sweep_ms = now_ms + step
            for s in self._states.values():
                if s.recent and now_ms - s.last_seen_ms > RECENT_RESULTS_MS:
                    s.recent.clear()
        old = [pid for pid, s in self._states.items()
               if pid < INTERNAL_PRODUCER_BASE and now_ms - s.last_seen_ms > expiry_ms]
        for pid in old:
            del self._states[pid]
        return len(old)

    def cut_back(self, firsts: dict[int, int]) -> None:
        """The log was cut where each producer of ``firsts`` had its put of sequence
        ``firsts[id]`` (its first one cut): its last sequence goes back to the one before
        (sequences only grow along the log), and its cut results go."""
        for producer_id, first in firsts.items():
            state = self._states.get(producer_id)
            if state is None or state.last_sequence < first:
                continue
            state.last_sequence = first - 1
            for seq in [s for s in state.recent if s >= first]:
                del state.recent[seq]

    def snapshot(self) -> dict[str, list[int]]:
        return {str(pid): [s.last_sequence, s.last_seen_ms] for pid, s in self._states.items()}

    @classmethod
    def restore(cls, snap: dict[str, list[int]], results_per_producer: int = 8) -> "ProducerTable":
        table = cls(results_per_producer)
        for pid, (seq, seen) in snap.items():
            table._states[int(pid)] = ProducerState(int(seq), int(seen), OrderedDict())
        return table
