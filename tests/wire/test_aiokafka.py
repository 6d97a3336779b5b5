"""aiokafka (asyncio, its own protocol code: none of librdkafka's or kafka-python's) against
the listener in front of the session cluster (issue 36): an idempotent producer, a
consumer group that commits, and a transactional copy with its offsets in the
transaction, an aborted transaction never read by ``read_committed``."""
from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.ray


async def _read(boot: str, topic: str, isolation: str, want: int, group: str | None = None):
    """The records a consumer of ``isolation`` reads from the start, until ``want`` (and
    nothing more comes for a second)."""
    from aiokafka import AIOKafkaConsumer
    c = AIOKafkaConsumer(topic, bootstrap_servers=boot, group_id=group,
                         isolation_level=isolation, auto_offset_reset="earliest",
                         enable_auto_commit=False, request_timeout_ms=20_000)
    await c.start()
    got = []
    try:
        async def drain():
            while len(got) < want:
                for recs in (await c.getmany(timeout_ms=500)).values():
                    got.extend(recs)
        await asyncio.wait_for(drain(), 60)
        got.extend(r for recs in (await c.getmany(timeout_ms=1000)).values() for r in recs)
        if group:
            await c.commit()
    finally:
        await c.stop()
    return got


def test_aiokafka_produces_idempotently_consumes_in_a_group_and_copies_in_transactions(
        mq, name, listener):
    from aiokafka import AIOKafkaProducer
    from aiokafka.structs import TopicPartition
    boot = "%s:%d" % listener.address
    src, dst, group = name + "-in", name + "-out", name + "-g"
    mq.create_topic(src, 2)
    mq.create_topic(dst, 2)

    async def scenario():
        p = AIOKafkaProducer(bootstrap_servers=boot, enable_idempotence=True, acks="all",
                             request_timeout_ms=20_000)
        await p.start()
        try:
            sent = await asyncio.gather(*[
                await p.send(src, b"v%d" % i, key=b"\xff%d" % i, headers=[("h", b"%d" % i)])
                for i in range(30)])
        finally:
            await p.stop()
        assert sorted(m.offset for m in sent if m.partition == 0) == \
            list(range(sum(m.partition == 0 for m in sent)))
        records = await _read(boot, src, "read_uncommitted", 30, group)
        assert sorted(r.value for r in records) == sorted(b"v%d" % i for i in range(30))
        assert {(r.key, tuple(r.headers)) for r in records if r.value == b"v7"} == {
            (b"\xff7", (("h", b"7"),))}
        committed = mq.admin.reset_offsets(group, src, to="latest", dry_run=True)
        assert sorted(before for before, _a in committed.values()) == \
            sorted(after for _b, after in committed.values())  # (each at its end)
        assert sum(before for before, _a in committed.values()) == 30

        ends = {q: 1 + max(r.offset for r in records if r.partition == q) for q in (0, 1)}
        tp = AIOKafkaProducer(bootstrap_servers=boot, transactional_id=name + "-tx",
                              request_timeout_ms=20_000)
        await tp.start()
        try:
            async with tp.transaction():  # the copy, with the copier's offsets
                for r in records:
                    await tp.send(dst, r.value.upper(), key=r.key)
                await tp.send_offsets_to_transaction(
                    {TopicPartition(src, q): ends[q] for q in ends}, name + "-copier")
            with pytest.raises(RuntimeError):
                async with tp.transaction():  # aborted: never read committed
                    await tp.send(dst, b"aborted")
                    raise RuntimeError("the application failed")
        finally:
            await tp.stop()
        copied = await _read(boot, dst, "read_committed", 30)
        assert sorted(r.value for r in copied) == sorted(b"V%d" % i for i in range(30))
        return ends
    ends = asyncio.run(scenario())
    committed = mq.admin.reset_offsets(name + "-copier", src, to="latest", dry_run=True)
    assert {q: before for q, (before, _a) in committed.items()} == {
        (src, q): end for q, end in ends.items()}
