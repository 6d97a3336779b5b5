"""``raymq bench soak``: a steady mixed load for ten minutes (x scale) -- plain batches,
RocketMQ-style transactions, Kafka-style transactions of a few messages and a
consume-transform-produce loop committing its input offsets in its transactions -- with
every message numbered, so that its end can say what was lost, duplicated or left
wedged, next to each shard's memory growth and how long a coordinator and a shard take
to restart after it.

Figures (one JSON line each): ``soak.rss_growth_mib_per_m_msgs`` (the slope over the
run's second half; target <= 1),
``soak.messages``, ``soak.transactions``, ``soak.kafka_transactions``, ``soak.lost``,
``soak.duplicated``, ``soak.ctp_lost``, ``soak.ctp_duplicated``, ``soak.wedged`` (each
expected 0), ``soak.acked_ratio`` (messages acknowledged over messages sent; target >=
0.99: a run whose sends fail is no pass however little it lost),
``soak.coordinator_restart_s`` and ``soak.shard_restart_s`` (each <= 2).  The suite
fails (after printing them all) when one misses its target.
"""
from __future__ import annotations

import os
import struct
import threading
import time
from typing import Callable

import numpy as np

from raymq.tools.bench import Bench, _bench_cluster, _teardown_cluster, suite

#: The soak's length at scale 1 (``--scale 0.05``: 30 s).
SOAK_S = 600.0
#: How often the soak samples every shard's anonymous memory.
SOAK_SAMPLE_S = 10.0
_SOAK_ID = struct.Struct("<Q")  # a soak message's number, at the start of its body
#: What each number was sent as (``_SoakLoad.kinds``).
PLAIN, ROCKET, KAFKA = 1, 2, 3


def rss_anon_mib(pid: int) -> float | None:
    """A process's anonymous resident memory (``RssAnon`` of ``/proc/<pid>/status``) in
    MiB: the heap, not the commit log's file pages.  None where it cannot be read (not
    Linux, or no such process)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


class _Tally:
    """Deliveries of numbered messages to one consumer group: a count per number."""

    def __init__(self):
        self.seen = bytearray()  # number -> deliveries (saturating at 255)
        self.deliveries = 0
        self._lock = threading.Lock()

    def note(self, numbers: list[int]) -> None:
        with self._lock:
            self.deliveries += len(numbers)
            top = max(numbers, default=-1)
            if top >= len(self.seen):
                self.seen.extend(bytes(max(top + 1 - len(self.seen), 1 << 20)))
            for i in numbers:
                if self.seen[i] < 255:
                    self.seen[i] += 1

    def outcome(self, wanted: np.ndarray) -> tuple[int, int]:
        """(lost, duplicated) of the numbers where ``wanted`` is true (acknowledged ones
        of the kinds this group reads); duplicated: deliveries past the first."""
        with self._lock:
            seen = np.zeros(len(wanted), np.uint8)
            got = np.frombuffer(bytes(self.seen[:len(wanted)]), np.uint8)
            seen[:len(got)] = got
            lost = int(np.count_nonzero(wanted & (seen == 0)))
            return lost, self.deliveries - int(np.count_nonzero(seen))


class _SoakLoad:
    """The soak's load through the SDK.  Every message carries a number (``_SOAK_ID``);
    ``kinds`` says what each was sent as (0: its send failed, never acknowledged).  Groups
    ``soak-a`` and ``soak-b`` read the plain, RocketMQ-style and Kafka-style topics
    (read_committed); a consume-transform-produce loop reads ``soak`` and writes each
    message to ``soakctp`` with its input offsets in one Kafka-style transaction, and
    ``soak-ctp-check`` reads that.  ``per_shard`` counts the messages each shard stored.
    """

    GROUPS = ("soak-a", "soak-b")
    BATCH = 100
    KAFKA_BATCH = 10
    CTP_BATCH = 5000  # most messages a consume-transform-produce transaction carries

    def __init__(self, mq, *, plain_threads: int = 2, tx_threads: int = 3,
                 kafka_threads: int = 2):
        from raymq.transaction_producer import LocalTransactionState, TransactionListener

        class Commit(TransactionListener):
            def execute_local_transaction(self, msg, arg):
                return LocalTransactionState.COMMIT_MESSAGE

            def check_local_transaction(self, msg):
                return LocalTransactionState.COMMIT_MESSAGE

        self.mq = mq
        self.stop = threading.Event()
        self.draining = threading.Event()
        self._lock = threading.Lock()
        self._next = 0
        self.kinds = bytearray()  # number -> PLAIN / ROCKET / KAFKA once acknowledged
        self.sent = self.transactions = self.kafka_transactions = self.ctp_transactions = 0
        self.failed = 0
        self.per_shard: dict[int, int] = {}
        self.errors: list[str] = []
        self.tallies = {g: _Tally() for g in self.GROUPS}
        self.ctp_tally = _Tally()
        for topic, queues in (("soak", 8), ("soaktx", 4), ("soakktx", 4), ("soakctp", 4)):
            mq.create_topic(topic, queues=queues)
        self.producer = mq.producer("soak")
        self.tx = mq.transaction_producer("soak-tx", Commit())
        self.kafka = [mq.transactional_producer(f"soak-ktx-{k}") for k in range(kafka_threads)]
        self.consumers = [mq.consumer(g, ["soak", "soaktx", "soakktx"]) for g in self.GROUPS]
        self.ctp_check = mq.consumer("soak-ctp-check", ["soakctp"])
        self.senders = ([threading.Thread(target=self._loop, args=(self._plain,))
                         for _ in range(plain_threads)]
                        + [threading.Thread(target=self._loop, args=(self._transaction,))
                           for _ in range(tx_threads)]
                        + [threading.Thread(target=self._loop, args=(
                            lambda pad, kp=kp: self._kafka_transaction(kp, pad),))
                           for kp in self.kafka])
        self.ctp = threading.Thread(target=self._transform)
        self.readers = [threading.Thread(target=self._consume, args=(c, self.tallies[g]))
                        for g, c in zip(self.GROUPS, self.consumers)] + [
            threading.Thread(target=self._consume, args=(self.ctp_check, self.ctp_tally))]

    # ------------------------------------------------------------------ senders
    def _numbers(self, n: int) -> range:
        with self._lock:
            first, self._next = self._next, self._next + n
            self.kinds.extend(bytes(n))
        return range(first, first + n)

    def _stored(self, numbers: range, kind: int, results, *, transactions: int = 0) -> None:
        with self._lock:
            self.kinds[numbers.start:numbers.stop] = bytes([kind]) * len(numbers)
            self.sent += len(results)
            self.transactions += transactions
            for r in results:
                self.per_shard[r.shard] = self.per_shard.get(r.shard, 0) + 1

    def _plain(self, pad: bytes) -> None:
        from raymq.message import Message
        numbers = self._numbers(self.BATCH)
        self._stored(numbers, PLAIN, self.producer.send_batch(
            [Message("soak", _SOAK_ID.pack(i) + pad) for i in numbers]))

    def _transaction(self, pad: bytes) -> None:
        from raymq.message import Message
        from raymq.transaction_producer import LocalTransactionState
        numbers = self._numbers(1)
        out = self.tx.send_in_transaction(Message("soaktx", _SOAK_ID.pack(numbers[0]) + pad),
                                          LocalTransactionState.COMMIT_MESSAGE)
        self._stored(numbers, ROCKET, out.results, transactions=1)

    def _kafka_transaction(self, kp, pad: bytes) -> None:
        """A Kafka-style transaction of ``KAFKA_BATCH`` messages (aborted on an error:
        its numbers stay unacknowledged)."""
        from raymq.message import Message
        numbers = self._numbers(self.KAFKA_BATCH)
        with kp.transaction():
            results = kp.send_batch([Message("soakktx", _SOAK_ID.pack(i) + pad)
                                     for i in numbers])
        self._stored(numbers, KAFKA, results)
        with self._lock:
            self.kafka_transactions += 1

    def _loop(self, step: Callable[[bytes], None]) -> None:
        pad = os.urandom(256 - _SOAK_ID.size)
        while not self.stop.is_set():
            try:
                step(pad)
            except Exception as err:  # counted: its messages are not acknowledged
                with self._lock:
                    self.failed += 1
                self.errors.append(f"{type(err).__name__}: {err}")
                self.stop.wait(0.5)

    # ----------------------------------------------------------------- readers
    def _transform(self) -> None:
        """Consume ``soak``, produce each message to ``soakctp`` with the input offsets in
        one transaction (exactly once); after a failed one, a new consumer starts from
        the group's committed offsets."""
        from raymq.message import Message
        kp = self.mq.transactional_producer("soak-ctp")
        source = self.mq.consumer("soak-ctp", ["soak"], auto_commit=False)
        try:
            while not self.draining.is_set():
                msgs = source.poll(self.CTP_BATCH, 0.5)
                if not msgs:
                    continue
                try:
                    with kp.transaction():
                        kp.send_batch([Message("soakctp", m.body) for m in msgs])
                        kp.send_offsets({(m.topic, m.queue_id): m.queue_offset + 1
                                         for m in msgs}, "soak-ctp")
                    self.ctp_transactions += 1
                except Exception as err:  # aborted: read the same input again
                    self.errors.append(f"consume-transform-produce: {type(err).__name__}: "
                                       f"{err}")
                    source.close()
                    source = self.mq.consumer("soak-ctp", ["soak"], auto_commit=False)
        finally:
            source.close()
            kp.close()

    def _consume(self, consumer, tally: _Tally) -> None:
        while not self.draining.is_set():
            try:
                msgs = consumer.poll(2000, 0.5)
                if msgs:
                    tally.note([_SOAK_ID.unpack_from(m.body)[0] for m in msgs])
                    consumer.commit()
            except Exception as err:  # logged and counted; the next poll goes on
                self.errors.append(f"{type(err).__name__}: {err}")

    # ------------------------------------------------------------------- run
    def start(self) -> None:
        for t in self.senders + self.readers + [self.ctp]:
            t.start()

    def wanted(self, *kinds: int) -> np.ndarray:
        with self._lock:
            return np.isin(np.frombuffer(bytes(self.kinds), np.uint8), kinds)

    def outcomes(self) -> tuple[dict[str, tuple[int, int]], tuple[int, int]]:
        everything, plain = self.wanted(PLAIN, ROCKET, KAFKA), self.wanted(PLAIN)
        return ({g: t.outcome(everything) for g, t in self.tallies.items()},
                self.ctp_tally.outcome(plain))

    def finish(self, drain_s: float = 300.0):
        """Stop sending, let the groups (and the transform) read what was sent; their
        (lost, duplicated): per group, and the transform's output."""
        self.stop.set()
        for t in self.senders:
            t.join()
        self.tx.close()
        self.producer.close()
        for kp in self.kafka:
            kp.close()
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline:
            groups, ctp = self.outcomes()
            if not ctp[0] and not any(lost for lost, _d in groups.values()):
                break
            time.sleep(0.5)
        self.draining.set()
        for t in self.readers + [self.ctp]:
            t.join()
        for c in self.consumers + [self.ctp_check]:
            c.close()
        return self.outcomes()


def _soak_samples(b: Bench, load: _SoakLoad, pids: dict[int, int], duration_s: float,
                  warmup_s: float) -> list[tuple[float, dict[int, tuple[float, int]]]]:
    """Sample each shard's anonymous memory about every ``SOAK_SAMPLE_S`` while the load
    runs, once at the end of the warm-up and once at the end: ``[(seconds, {shard:
    (MiB, messages it stored so far)})]``, each also shown on stderr."""
    t0 = time.monotonic()
    samples = []
    while True:
        elapsed = time.monotonic() - t0
        now = {}
        for shard, pid in pids.items():
            mib = rss_anon_mib(pid)
            if mib is None:
                raise RuntimeError(f"soak: cannot read the memory of shard-{shard} (pid "
                                   f"{pid}): not Linux, or the shard restarted")
            now[shard] = (mib, load.per_shard.get(shard, 0))
        samples.append((elapsed, now))
        b.progress(f"soak: {elapsed:5.0f} s, {load.sent} messages, {load.transactions} "
                   f"RocketMQ-style and {load.kafka_transactions} + {load.ctp_transactions} "
                   "Kafka-style transactions; RssAnon " + ", ".join(
                       f"shard-{i} {m:.1f} MiB" for i, (m, _n) in sorted(now.items())))
        if elapsed >= duration_s:
            return samples
        wait = min(SOAK_SAMPLE_S, duration_s - elapsed)
        if elapsed < warmup_s:  # a sample right at the end of the warm-up
            wait = min(wait, warmup_s - elapsed)
        time.sleep(max(wait, 0.0))


def growth_per_m_msgs(points: list[tuple[float, float, int]], duration_s: float) -> float:
    """A shard's memory growth in MiB per million messages: the least-squares slope of
    its RssAnon against the messages it stored, over the samples (``(seconds, MiB,
    messages)``) of the run's second half -- a leak keeps rising there, a plateau reached
    in the first minutes (caches, pools, arenas filling) does not.  With fewer than two
    samples in that half, the last two."""
    half = [(m, n) for t, m, n in points if t >= duration_s / 2]
    if len(half) < 2:
        half = [(m, n) for _t, m, n in points[-2:]]
    if len(half) < 2:
        return 0.0
    mean_n = sum(n for _m, n in half) / len(half)
    mean_m = sum(m for m, _n in half) / len(half)
    spread = sum((n - mean_n) ** 2 for _m, n in half)
    if spread == 0:  # (no message stored meanwhile: no rate to speak of)
        return 0.0
    return sum((n - mean_n) * (m - mean_m) for m, n in half) / spread * 1e6


def _soak_growth(b: Bench, samples: list, duration_s: float, warmup_s: float) -> float:
    """Emit ``soak.rss_growth_mib_per_m_msgs``: each shard's RssAnon growth per million
    messages it stored, the slope over the run's second half (``growth_per_m_msgs``); the
    largest over shards.  Every shard's samples go along (``series``: seconds, MiB,
    messages)."""
    growth, shards = {}, {}
    for i in sorted(samples[-1][1]):
        points = [(t, s[i][0], s[i][1]) for t, s in samples]
        growth[i] = growth_per_m_msgs(points, duration_s)
        shards[f"shard-{i}"] = {
            "start_mib": round(points[0][1], 1), "end_mib": round(points[-1][1], 1),
            "messages": points[-1][2], "mib_per_m_msgs": round(growth[i], 3),
            "series": [[round(t), round(m, 1), n] for t, m, n in points]}
    b.emit("soak.rss_growth_mib_per_m_msgs", max(growth.values()), "MiB/M msgs",
           target=1.0, duration_s=duration_s, warmup_s=warmup_s, shards=shards,
           what="slope of each shard's RssAnon against the messages it stored (transactional "
                "ones too) over the run's second half, per million messages; the largest "
                "over shards")
    return max(growth.values())


def wedged(mq) -> list[str]:
    """What nothing will move on by itself once every producer closed: transactions left
    prepared or open at a coordinator, and queues whose LSO a transaction holds (what
    ``raymq tx list`` and ``raymq tx hanging`` show)."""
    out = [f"{t['transactional_id']} {t['state']}" for t in mq.admin.tx_list()
           if t["state"] not in ("EMPTY", "COMPLETE_COMMIT", "COMPLETE_ABORT")]
    return out + [f"shard-{h['shard']} {h['queue']}: producer {h['producer_id']} holds its "
                  f"LSO {h['behind']} behind" for h in mq.admin.tx_hanging()]


def restart_s(handle) -> float:
    """Seconds from killing an actor (Ray restarts it) until it answers ``ping``."""
    import ray

    from raymq import rpc
    before = rpc.call(handle.ping, timeout_s=60)["pid"]
    t0 = time.monotonic()
    ray.kill(handle, no_restart=False)
    while True:
        try:
            if rpc.call(handle.ping, timeout_s=60)["pid"] != before:
                return time.monotonic() - t0
        except Exception:  # noqa: BLE001 -- dead or restarting: ask again
            pass
        time.sleep(0.02)


@suite("soak", long=True)
def bench_soak(b: Bench) -> None:
    """Steady mixed load for ``SOAK_S`` x scale (see the module doc for its figures)."""
    duration_s = max(10.0, SOAK_S * b.scale)
    # the first ~15 s fill the shards' caches, pools and connections (not growth)
    warmup_s = min(60.0, max(15.0, 0.2 * duration_s), 0.5 * duration_s)
    mq, data = _bench_cluster(b, "soak", txn_check_interval_ms=5000)
    try:
        pids = {i: mq.shard(i).call("ping", timeout_s=60)["pid"] for i in range(mq.num_shards)}
        load = _SoakLoad(mq)
        b.progress(f"soak: {duration_s:.0f} s of plain batches of {load.BATCH}, RocketMQ-style "
                   f"transactions, Kafka-style ones of {load.KAFKA_BATCH} and a "
                   f"consume-transform-produce loop; groups {', '.join(load.GROUPS)}; "
                   f"warm-up {warmup_s:.0f} s")
        load.start()
        try:
            samples = _soak_samples(b, load, pids, duration_s, warmup_s)
        finally:
            groups, ctp = load.finish()
        checks = {"soak.rss_growth_mib_per_m_msgs": _soak_growth(b, samples, duration_s,
                                                                 warmup_s) <= 1.0}
        attempted = len(load.kinds)
        b.emit("soak.messages", load.sent, "msgs", per_s=round(load.sent / duration_s, 1),
               batch=load.BATCH)
        b.emit("soak.transactions", load.transactions, "transactions")
        b.emit("soak.kafka_transactions", load.kafka_transactions + load.ctp_transactions,
               "transactions", small=load.kafka_transactions,
               consume_transform_produce=load.ctp_transactions)
        for name, value, extra in (
                ("soak.lost", sum(lost for lost, _d in groups.values()),
                 {"groups": {g: lost for g, (lost, _d) in groups.items()}}),
                ("soak.duplicated", sum(d for _l, d in groups.values()),
                 {"groups": {g: d for g, (_l, d) in groups.items()}}),
                ("soak.ctp_lost", ctp[0], {}), ("soak.ctp_duplicated", ctp[1], {})):
            b.emit(name, value, "msgs", expected=0, **extra)
            checks[name] = value == 0
        stuck = wedged(mq)
        b.emit("soak.wedged", len(stuck), "transactions", expected=0, first=stuck[:5])
        checks["soak.wedged"] = not stuck
        acked = (attempted - load.kinds.count(0)) / max(attempted, 1)
        b.emit("soak.acked_ratio", acked, "ratio", target=0.99, failed_calls=load.failed)
        checks["soak.acked_ratio"] = acked >= 0.99
        for name, handle in (("soak.coordinator_restart_s", mq.coordinator_handle(0)),
                             ("soak.shard_restart_s", mq.shard_handle(0))):
            took = restart_s(handle)
            b.emit(name, took, "s", target=2.0, transactions_before=(
                load.transactions + load.kafka_transactions + load.ctp_transactions))
            checks[name] = took <= 2.0
        if load.errors:
            b.progress(f"soak: {len(load.errors)} call(s) failed; the first: {load.errors[0]}")
        missed = sorted(name for name, ok in checks.items() if not ok)
        if missed:
            raise RuntimeError(f"soak: missed its targets: {', '.join(missed)}")
    finally:
        mq.close()
        _teardown_cluster(data)
