"""A put's records checked and cut into frames, before anything is written.
Owns the put-time checks (body size, topic names, queue ids) and the frame split.

A put is encoded whole before its first frame is written, so that a bad record
fails the put with nothing on disk.  Frames are chunked by estimated size and
split again when one came out over the limit (large keys or properties); only
the last frame of a put is flagged LAST.
"""
from __future__ import annotations

import re

import numpy as np

from raymq.storage.commitlog import SEGMENT_HEADER_BYTES
from raymq.storage.config import StoreConfig
from raymq.storage.errors import InvalidMessageError, MessageTooLargeError
from raymq.storage.records import REC_HEADER_BYTES, EncodedFrame, RecordBatch, encode_frame

TOPIC_RE = re.compile(r"^[A-Za-z0-9_%|.\-]{1,127}$")
_VALID_TOPICS_KEPT = 100_000


def check_topic_name(topic: object) -> str:
    if not isinstance(topic, str) or not TOPIC_RE.match(topic) or topic in (".", ".."):
        raise InvalidMessageError(
            f"invalid topic name {topic!r}: use 1-127 characters of letters, digits, "
            "'_', '-', '.', '%' or '|'")
    return topic


class PutFramer:
    """Checks and frames puts for a log of ``segment_size`` bytes per segment.

    Not thread-safe: the store calls ``encode`` under its write lock
    (``validate`` only adds to a cache of topic names already checked).
    """

    def __init__(self, config: StoreConfig, segment_size: int):
        self.config = config
        self.segment_size = segment_size
        self._valid_topics: set[str] = set()

    def validate(self, batch: RecordBatch) -> np.ndarray:
        """Check what can be checked before writing; return the body lengths.

        (A body that is not bytes is caught when the frame is encoded.)
        """
        limit = self.config.max_message_bytes
        try:
            sizes = list(map(len, batch.bodies))
        except TypeError:
            bad = next(b for b in batch.bodies if not hasattr(b, "__len__"))
            raise InvalidMessageError(f"message body must be bytes, got "
                                      f"{type(bad).__name__}") from None
        lens = np.array(sizes, np.int64)
        # (a few records: Python's max; numpy's costs ~4 us however few they are)
        biggest = max(sizes) if len(sizes) <= 16 else int(lens.max())
        if biggest > limit:
            raise MessageTooLargeError(f"message body of {biggest} bytes exceeds the maximum "
                                       f"of {limit} bytes (max_message_bytes)")
        topics = batch.topics
        for topic in (set(topics) if isinstance(topics, list) else (topics,)):
            if topic not in self._valid_topics:
                check_topic_name(topic)
                if len(self._valid_topics) < _VALID_TOPICS_KEPT:
                    self._valid_topics.add(topic)
        qids = batch.queue_ids
        for qid in ((qids,) if not isinstance(qids, list) else set(qids)):
            if isinstance(qid, bool) or not isinstance(qid, int) or not 0 <= qid < 2**31:
                raise InvalidMessageError(f"invalid queue id {qid!r}")
        return lens

    def encode(self, batch: RecordBatch, body_lens: np.ndarray, qoffs: np.ndarray,
               store_ms: int, producer_id: int,
               sequence: int) -> list[tuple[int, int, EncodedFrame]]:
        """The frames of a put as ``(lo, hi, frame)``: records ``[lo, hi)`` in ``frame``."""
        limit = min(self.config.max_frame_bytes, self.segment_size - SEGMENT_HEADER_BYTES)
        work = list(self._chunks(body_lens))
        frames = []
        i = 0
        while i < len(work):
            lo, hi = work[i]
            frame = encode_frame(batch.slice(lo, hi), qoffs[lo:hi], store_ms, body_lens[lo:hi],
                                 producer_id=producer_id, sequence=sequence,
                                 last=(i == len(work) - 1))
            if frame.size > limit:
                if hi - lo == 1:
                    raise MessageTooLargeError(f"a record of {frame.size} bytes cannot fit a "
                                               f"frame of at most {limit} bytes")
                mid = (lo + hi) // 2
                work[i:i + 1] = [(lo, mid), (mid, hi)]
                continue
            frames.append((lo, hi, frame))
            i += 1
        return frames

    def _chunks(self, body_lens: np.ndarray):
        """Index ranges whose frames stay under max_frame_bytes."""
        budget = min(self.config.max_frame_bytes, self.segment_size - 64)
        n = len(body_lens)
        est = body_lens + (REC_HEADER_BYTES + 2048)
        if est.sum() <= budget:
            yield 0, n
            return
        lo, acc = 0, 0
        for i, size in enumerate(est.tolist()):
            if acc + size > budget and i > lo:
                yield lo, i
                lo, acc = i, 0
            acc += size
        yield lo, n
