"""The store's producer table keeps the results of a producer's last puts (what a resend
is answered with) only while the producer is around: a client that went away leaves its
last sequence (duplicates stay duplicates) and nothing per record.

Before, every producer id kept its last 8 puts' offset arrays (24 bytes a record: ~190
KiB for puts of 1000) until ``producer_expiry_ms``, a week: each client instance that
came and went (one id per lane and shard) added that much to every shard it wrote to.
"""
from __future__ import annotations

from raymq.storage import MessageStore, RecordBatch
from raymq.storage.clock import ManualClock
from raymq.storage.config import StoreConfig
from raymq.storage.producers import RECENT_RESULTS_MS


def retained_bytes(store: MessageStore) -> int:
    """Bytes of put results the store keeps for resends."""
    return sum(p.phys.nbytes + p.queue_offsets.nbytes + p.sizes.nbytes
               for s in store._producers._states.values() for p in s.recent.values())


def test_a_producer_gone_for_a_while_keeps_its_sequence_and_no_results(tmp_path):
    clock = ManualClock()
    batch = RecordBatch("t", 0, [b"x" * 10] * 100)
    with MessageStore(str(tmp_path), StoreConfig(flush_mode="async"), clock,
                      background=False) as store:
        gone, live = range(1, 51), 99
        for pid in [*gone, live]:
            for seq in range(1, 9):
                store.put(batch, producer_id=pid, sequence=seq)
        assert retained_bytes(store) == 51 * 8 * 100 * 24
        clock.advance(RECENT_RESULTS_MS + 1)
        last = store.put(batch, producer_id=live, sequence=9)
        store.checkpoint()  # the store's periodic checkpoint expires producers
        assert retained_bytes(store) == 8 * 100 * 24  # the live producer's last 8 puts
        end = store.max_phys_offset
        again = store.put(batch, producer_id=1, sequence=8)  # a very late resend
        assert again.duplicate and len(again) == 0 and store.max_phys_offset == end
        assert store.last_sequence(1) == 8
        resent = store.put(batch, producer_id=live, sequence=9)
        assert resent.duplicate and resent.phys_offsets == last.phys_offsets
