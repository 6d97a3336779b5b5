"""The storage format's binary keys and repeated binary headers (frame version 2): they
round-trip through every way a record is written and read, survive a reopen and a
re-index, travel with a record's copies, and a frame without them is written as before
(version 1, which every reader since the first reads).  No Ray."""
from __future__ import annotations

import os

import numpy as np
import pytest

from raymq.storage import Record, RecordBatch
from raymq.storage.errors import InvalidMessageError
from raymq.storage.records import (FRAME, FRAME_VERSION, FRAME_VERSION_HEADERS, SysFlag,
                                   decode_headers, encode_frame, encode_headers)
from tests.helpers import forget_checkpoint, open_store

HEADERS = [("trace", b"\x00\x01"), ("trace", b""), ("none", None), ("ü", b"\xff" * 300)]


def _batch(topic: str, n: int) -> RecordBatch:
    """n records: text, binary and no keys; repeated, null-valued and no headers."""
    keys = [f"k{i}" if i % 3 == 0 else (b"\xff\x00%d" % i if i % 3 == 1 else None)
            for i in range(n)]
    headers = [HEADERS[: i % 5] or None for i in range(n)]
    return RecordBatch(topic, 0, [b"body %d" % i for i in range(n)], keys=keys,
                       headers=headers, properties=[{"p": str(i)} if i % 2 else None
                                                    for i in range(n)])


def _check(messages, n: int) -> None:
    want = _batch("x", n)
    assert len(messages) == n
    for i, m in enumerate(messages):
        assert m.body == b"body %d" % i
        assert m.key == want.keys[i] and type(m.key) is type(want.keys[i])
        assert m.headers == want.headers[i]
        assert m.properties == ({"p": str(i)} if i % 2 else {})
        assert bool(m.flags & SysFlag.BINARY_KEY) == isinstance(want.keys[i], bytes)
        assert bool(m.flags & SysFlag.HEADERS) == bool(want.headers[i])


@pytest.mark.parametrize("n", [7, 50])  # (the struct path of small frames; the columns)
def test_binary_keys_and_repeated_headers_round_trip_and_survive_a_reopen(tmp_path, n):
    with open_store(tmp_path) as store:
        res = store.put(_batch("t", n))
        _check(store.read_queue("t", 0, 0, n), n)
        _check([store.get_message(p) for p in res.phys_offsets], n)
        _check(store.read_batch("t", 0, 0, n).messages(), n)
        store.put(RecordBatch("t", 1, [b"plain"], keys=["k"], properties=[{"a": "b"}]))
    forget_checkpoint(tmp_path)  # the index rebuilt from the log: the new frames re-read
    with open_store(tmp_path) as store:
        _check(store.read_queue("t", 0, 0, n), n)
        [m] = store.read_queue("t", 1, 0, 1)
        assert (m.key, m.headers, m.flags) == ("k", None, 0)


def test_only_a_frame_with_a_binary_key_or_headers_is_version_2():
    """Frames without them are byte for byte what version 1 wrote: logs and readers of
    before are untouched."""
    def version(batch):
        return FRAME.unpack_from(encode_frame(batch, np.arange(len(batch)), 5).parts[0])[3]
    plain = RecordBatch("t", 0, [b"a", b"b"], keys=["k", None], properties=[{"a": "b"}, None])
    assert version(plain) == FRAME_VERSION == 1
    assert version(RecordBatch("t", 0, [b"a"], keys=[b"\xff"])) == FRAME_VERSION_HEADERS
    assert version(RecordBatch("t", 0, [b"a"], headers=[[("h", None)]])) == 2
    assert version(RecordBatch("t", 0, [b"a"], headers=[[]])) == 1  # (no header: none)


def test_a_copy_keeps_key_and_headers_and_stale_flags_are_cleared(tmp_path):
    """A stored record made a Record again (retries, dead letters, commits of halves and
    timers copy records this way) keeps both; a copy that came with the flags but not the
    fields (an older caller's) is written without them, never with a block it has not."""
    with open_store(tmp_path) as store:
        m = store.get_message(store.put(_batch("t", 5)).phys_offsets[4])
        assert m.key == b"\xff\x004" and m.headers == HEADERS[:4]
        copy = m.to_record()
        copy.topic = "copies"
        again = store.get_message(store.put([copy]).phys_offsets[0])
        assert (again.key, again.headers, again.body) == (m.key, m.headers, m.body)
        stale = Record("copies", 0, b"x", "text", flags=int(SysFlag.BINARY_KEY | SysFlag.HEADERS
                                                           | SysFlag.TRANSACTION_COMMIT))
        got = store.get_message(store.put([stale]).phys_offsets[0])
        assert (got.key, got.headers) == ("text", None)
        assert got.flags == SysFlag.TRANSACTION_COMMIT


def test_the_small_frame_encoder_writes_the_column_encoders_bytes_with_headers(monkeypatch):
    from raymq.storage import records
    for n in (1, 3, 16):
        b = _batch("t", n)
        qoffs = np.arange(n, dtype=np.int64)
        small = b"".join(encode_frame(b, qoffs, 5).parts)
        monkeypatch.setattr(records, "SMALL_FRAME_RECORDS", 0)
        column = b"".join(encode_frame(b, qoffs, 5).parts)
        monkeypatch.setattr(records, "SMALL_FRAME_RECORDS", 16)
        assert small == column


def test_a_header_block_decodes_to_what_was_encoded_and_bad_headers_are_refused(tmp_path):
    block = encode_headers(HEADERS)
    assert decode_headers(b"pad" + block, 3) == HEADERS
    assert encode_headers(None) == encode_headers([]) == b""
    for bad, why in (({"a": b"1"}, "list of"), ([("a",)], "pair"), ([(1, b"x")], "name"),
                     ([("a", "text")], "bytes or None"), ("ab", "list of"),
                     ([("a", os.urandom(70_000))], "more than")):
        with pytest.raises(InvalidMessageError, match=why):
            encode_headers(bad)
    with open_store(tmp_path) as store:  # refused before anything is written
        end = store.max_phys_offset
        with pytest.raises(InvalidMessageError, match="bytes or None"):
            store.put(RecordBatch("t", 0, [b"a", b"b"], headers=[None, [("h", 5)]]))
        with pytest.raises(InvalidMessageError, match="longer than"):
            store.put(RecordBatch("t", 0, [b"a"], keys=[b"k" * 2000]))
        assert store.max_phys_offset == end
