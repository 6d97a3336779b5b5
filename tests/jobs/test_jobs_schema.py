"""Committed message datasets' rows (``raymq.jobs.schema``): every column as a consumer
sees the message, built from what a shard's pull returns.  No Ray, no Spark."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from raymq.actors.protocol import Prop, make_msg_id
from raymq.jobs.schema import (MESSAGE_SCHEMA, _cut, from_ipc_bytes, message_record_batch,
                               msg_id_array, properties_map, to_ipc_bytes)
from raymq.message import messages_ext
from raymq.storage import MessageStore, RecordBatch, StoreConfig


def stored_batch(tmp_path):
    """Messages of every kind of column, as a pull returns them."""
    with MessageStore(str(tmp_path), StoreConfig(flush_mode="async"), background=False) as store:
        store.put(RecordBatch("t", 0, [b"plain", b"\x00binary\xff", b"copy", b"tx"],
                              keys=[None, "k1", "k2", None], tags=["a", None, "b", None],
                              properties=[None, {"app": "1", "x": "y=z"},
                                          {Prop.PRODUCER_MSG_ID: "0001000000000000002A"},
                                          {Prop.TRANSACTION_ID: "tx-9"}],
                              born_ms=[5, 6, 7, 8]))
        store.put(RecordBatch("t", 0, [b"bare"]))  # no keys, tags or properties at all
        entries = store.read_cq("t", 0, 0, 10)
        return store.records_at(entries)


def test_each_row_is_the_message_a_consumer_gets(tmp_path):
    batch = stored_batch(tmp_path)
    rb = message_record_batch(3, "t", 0, batch)
    assert rb.schema == MESSAGE_SCHEMA
    rows = rb.to_pylist()
    want = messages_ext(3, batch.decode())
    assert len(rows) == len(want) == 5
    for row, m in zip(rows, want):
        assert (row["topic"], row["queue_id"], row["queue_offset"], row["msg_id"], row["key"],
                row["tags"], dict(row["properties"] or []), row["body"], row["born_ms"],
                row["store_ms"], row["transaction_id"]) == \
            (m.topic, m.queue_id, m.queue_offset, m.msg_id, m.key, m.tags, m.properties, m.body,
             m.born_ms, m.store_ms, m.transaction_id)
    assert rows[2]["msg_id"] == "0001000000000000002A"  # a copy: its producer's id
    assert rows[3]["transaction_id"] == "tx-9"


def test_rows_left_out_and_the_ipc_round_trip(tmp_path):
    batch = stored_batch(tmp_path)
    keep = np.array([True, False, True, False, True])
    rb = message_record_batch(0, "t", 0, batch, keep)
    assert rb.column("body").to_pylist() == [b"plain", b"copy", b"bare"]
    assert rb.column("queue_offset").to_pylist() == [0, 2, 4]
    table = from_ipc_bytes(to_ipc_bytes([rb, message_record_batch(0, "t", 0, batch)]))
    assert table.schema == MESSAGE_SCHEMA and table.num_rows == 8
    assert from_ipc_bytes(to_ipc_bytes([])).num_rows == 0  # an empty queue: a valid stream
    big = rb.take(np.zeros(80_000, np.int64))  # a block of some MB (written in huge pages)
    data = to_ipc_bytes([big, rb])
    assert type(data) is bytes and len(data) > 5 << 20
    assert from_ipc_bytes(data).equals(pa.Table.from_batches([big, rb]))


def test_the_schema_uses_only_types_spark_reads():
    for field in MESSAGE_SCHEMA:
        t = field.type
        assert not (pa.types.is_large_string(t) or pa.types.is_large_binary(t)
                    or pa.types.is_unsigned_integer(t) or pa.types.is_dictionary(t)), field


def test_properties_decode_like_the_store_does():
    got = properties_map([b"", b"a\x01b", b"a\x01b\x02c\x01d=e\x01f"]).to_pylist()
    assert [dict(x or []) for x in got] == [{}, {"a": "b"}, {"a": "b", "c": "d=e\x01f"}]


def test_message_ids_built_in_numpy_are_the_ids_consumers_get():
    rng = np.random.default_rng(7)
    offsets = np.concatenate([[0, 1, 2**63 - 1, 2**64 - 1, 0xDEADBEEF],
                              rng.integers(0, 2**63, 1000, dtype=np.uint64)]).astype(np.uint64)
    for shard in (0, 3, 0xABCD):
        ids = msg_id_array(shard, offsets)
        assert ids.type == pa.string()
        assert ids.to_pylist() == [make_msg_id(shard, int(p)) for p in offsets]
    assert msg_id_array(1, np.zeros(0, np.uint64)).to_pylist() == []


def test_columns_cut_from_a_sparse_read_equal_the_decoded_messages(tmp_path):
    """A queue whose records lie far apart in the log is read in pieces joined into one
    buffer; the columns cut from it are the messages a consumer decodes."""
    with MessageStore(str(tmp_path), StoreConfig(flush_mode="async"), background=False) as store:
        for i in range(40):
            store.put(RecordBatch("t", 0, [f"small-{i}".encode()], keys=[f"k{i}"],
                                  properties=[{"i": str(i)}] if i % 3 else None))
            store.put(RecordBatch("t", 1, [bytes(64 << 10)]))
        spans = store.records_at(store.read_cq("t", 0, 0, 100))
    assert len(spans) == 40 and len(spans.buf) < 40 * (64 << 10)  # pieces, not the span
    rows = message_record_batch(1, "t", 0, spans).to_pylist()
    want = messages_ext(1, spans.decode())
    assert [(r["body"], r["key"], dict(r["properties"] or []), r["msg_id"]) for r in rows] == \
        [(m.body, m.key, m.properties, m.msg_id) for m in want]


def test_ranges_out_of_order_are_cut_the_slow_way_with_the_same_values():
    data = pa.py_buffer(b"0123456789abcdef")
    starts, ends = np.array([10, 0, 4, 4]), np.array([12, 3, 4, 8])
    got = _cut(data, starts, ends, pa.binary()).to_pylist()
    assert got == [b"ab", b"012", b"", b"4567"]
    assert _cut(data, np.array([0, 5]), np.array([3, 9]), pa.string()).to_pylist() == \
        ["012", "5678"]


def test_compacted_spans_keep_only_their_records_bytes_and_decode_the_same(tmp_path):
    with MessageStore(str(tmp_path), StoreConfig(flush_mode="async"), background=False) as store:
        for i in range(6):  # two queues' batches interleaved: a read of one spans both
            store.put(RecordBatch("t", 0, [f"q0-{i}-{j}".encode() * 20 for j in range(50)],
                                  keys=[f"k{j}" for j in range(50)],
                                  properties=[{"j": str(j)} for j in range(50)]))
            store.put(RecordBatch("t", 1, [bytes(1000)] * 50))
        spans = store.records_at(store.read_cq("t", 0, 25, 500))  # from mid-frame
    small = spans.compact()
    assert len(small.buf) < len(spans.buf) / 2
    a, b = spans.decode(), small.decode()
    assert (a.bodies, a.keys, a.properties, a.phys_offsets) == \
        (b.bodies, b.keys, b.properties, b.phys_offsets)
    assert len(a) == 6 * 50 - 25
    assert message_record_batch(0, "t", 0, small).equals(message_record_batch(0, "t", 0, spans))


def test_a_pull_without_any_properties_has_null_maps_and_the_records_own_ids(tmp_path):
    with MessageStore(str(tmp_path), StoreConfig(flush_mode="async"), background=False) as store:
        store.put(RecordBatch("t", 0, [b"a", b"b"], keys=["k", None]))
        spans = store.records_at(store.read_cq("t", 0, 0, 10))
    rb = message_record_batch(2, "t", 0, spans)
    assert rb.schema == MESSAGE_SCHEMA
    want = messages_ext(2, spans.decode())
    assert [(r["msg_id"], r["key"], r["properties"], r["transaction_id"]) for r in rb.to_pylist()] \
        == [(m.msg_id, m.key, None, None) for m in want]
    assert [m.properties for m in want] == [{}, {}]


def test_headers_leave_the_columns_as_they_were_and_a_binary_key_is_null(tmp_path):
    """Records with headers and binary keys (a Kafka client's) in a Spark dataset: the
    properties and bodies cut as before (the header block is not read as properties);
    the ``key`` column is text, so a key that is not is null there."""
    with MessageStore(str(tmp_path), StoreConfig(flush_mode="async"), background=False) as store:
        store.put(RecordBatch("t", 0, [b"a", b"b", b"c"], keys=["text", b"\xff\xfe", None],
                              headers=[[("h", b"\x00" * 9)], None, [("h", None)]],
                              properties=[{"p": "1"}, None, {"q": "2"}]))
        spans = store.records_at(store.read_cq("t", 0, 0, 10))
    rows = message_record_batch(0, "t", 0, spans).to_pylist()
    assert [(r["body"], r["key"], dict(r["properties"] or [])) for r in rows] == [
        (b"a", "text", {"p": "1"}), (b"b", None, {}), (b"c", None, {"q": "2"})]
