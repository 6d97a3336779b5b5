"""Run by test_replication_cluster, one scenario a process (each its own Ray cluster of a
head and worker nodes on this machine: ``raymq.tools.failover.Harness``).

``python -m tests.replication_scenario NAME`` exits 0 when every check held, printing
what it checks as it goes (the test asserts on those lines too).
"""
from __future__ import annotations

import os
import random
import signal
import sys
import time

os.environ["RAY_AUTH_MODE"] = "disabled"

from raymq.tools.failover import AckedLog, Harness, failovers  # noqa: E402

CHECK_MS = dict(txn_timeout_ms=1000, txn_check_interval_ms=300)


def _listener():
    from raymq.transaction_producer import LocalTransactionState as S, TransactionListener

    class ByPrefix(TransactionListener):
        """Commit ``c``/``u`` bodies, roll back ``r`` ones; ``u`` is decided by check-back."""

        def __init__(self):
            self.checked: list[bytes] = []

        def execute_local_transaction(self, msg, arg):
            return {b"c": S.COMMIT_MESSAGE, b"r": S.ROLLBACK_MESSAGE}.get(msg.body[:1], S.UNKNOW)

        def check_local_transaction(self, msg):
            self.checked.append(bytes(msg.body))
            return S.ROLLBACK_MESSAGE if msg.body[:1] == b"r" else S.COMMIT_MESSAGE
    return ByPrefix()


class Load:
    """Seeded load of every kind, a round at a time, remembering what must be seen."""

    def __init__(self, mq, seed: int):
        from raymq import Message  # noqa: F401
        self.mq, self.rnd = mq, random.Random(seed)
        for topic in ("tx", "ktx", "tm"):
            mq.create_topic(topic, queues=2)
        self.plain = AckedLog(mq, "t", seed)
        self.listener = _listener()
        self.tx = mq.transaction_producer("g-tx", self.listener)
        self.kp = mq.transactional_producer("ktx-1")
        self.timer_p = mq.producer("timers")
        self.reader = mq.consumer("g", "t")
        self.read: list[bytes] = []
        self.rocket_want, self.rocket_not = set(), set()
        self.kafka_want, self.kafka_not = set(), set()
        self.timers: dict[bytes, int] = {}  # body -> due (epoch ms)
        self.n = 0

    def _name(self, prefix: bytes) -> bytes:
        self.n += 1
        return prefix + b"%07d" % self.n

    def round(self, k: int) -> None:
        from raymq import Message
        from raymq.message import SendStatus
        self.plain.send(self.rnd.randint(50, 200))
        for prefix in (b"c", b"r", b"u"):
            body = self._name(prefix)
            self.tx.send_in_transaction(Message("tx", body))
            (self.rocket_not if prefix == b"r" else self.rocket_want).add(body)
        bodies = [self._name(b"k") for _ in range(5)]
        with self.kp.transaction():
            self.kp.send_batch([Message("ktx", b) for b in bodies])
        self.kafka_want.update(bodies)
        aborted = [self._name(b"a") for _ in range(5)]
        try:
            with self.kp.transaction():
                self.kp.send_batch([Message("ktx", b) for b in aborted])
                raise RuntimeError("abort")
        except RuntimeError:
            pass
        self.kafka_not.update(aborted)
        for _ in range(3):
            body, after = self._name(b"t"), self.rnd.randint(300, 2500)
            sent_ms = int(time.time() * 1000)
            r = self.timer_p.send(Message("tm", body, deliver_after_ms=after))
            if r.status is SendStatus.SEND_OK:
                self.timers[body] = sent_ms + after
        self.read += [bytes(m.body) for m in self.reader.poll(300, 0.5)]
        self.reader.commit()

    def check(self) -> bool:
        """Every check of the scenario; prints each."""
        lost, dup, ordered = self.plain.missing(self.mq, "check-plain")
        print(f"plain: acked {len(self.plain.acked)} lost {lost} duplicates {dup} "
              f"ordered {ordered}", flush=True)
        # the first consumer carries on from its committed offsets
        deadline = time.monotonic() + 30
        want = set(self.plain.acked)
        while not want <= set(self.read) and time.monotonic() < deadline:
            self.read += [bytes(m.body) for m in self.reader.poll(1000, 0.5)]
            self.reader.commit()
        redelivered = len(self.read) - len(set(self.read))
        print(f"consumer g: missing {len(want - set(self.read))} redelivered {redelivered}",
              flush=True)
        got = self._drain(["tx", "ktx", "tm"], "check-rest", len(self.rocket_want)
                          + len(self.kafka_want) + len(self.timers))
        bodies = [b for b, _ in got]
        rocket = [b for b in bodies if b[:1] in b"cru"]
        kafka = [b for b in bodies if b[:1] in b"ka"]
        print(f"rocket: committed seen once {sum(rocket.count(b) == 1 for b in self.rocket_want)}"
              f"/{len(self.rocket_want)} rolled back seen "
              f"{sum(b in self.rocket_not for b in rocket)}", flush=True)
        print(f"kafka: committed seen once {sum(kafka.count(b) == 1 for b in self.kafka_want)}"
              f"/{len(self.kafka_want)} aborted seen {sum(b in self.kafka_not for b in kafka)}",
              flush=True)
        early = [b for b, at in got if b in self.timers and at < self.timers[b]]
        timers = [b for b in bodies if b[:1] == b"t"]
        print(f"timers: delivered once {sum(timers.count(b) == 1 for b in self.timers)}"
              f"/{len(self.timers)} early {len(early)}", flush=True)
        return (lost == 0 and dup == 0 and ordered and not (want - set(self.read))
                and all(rocket.count(b) == 1 for b in self.rocket_want)
                and not any(b in self.rocket_not for b in rocket)
                and all(kafka.count(b) == 1 for b in self.kafka_want)
                and not any(b in self.kafka_not for b in kafka)
                and all(timers.count(b) == 1 for b in self.timers) and not early)

    def _drain(self, topics, group, want: int, timeout_s: float = 60):
        c = self.mq.consumer(group, topics)
        got = []
        deadline = time.monotonic() + timeout_s
        while len(got) < want and time.monotonic() < deadline:
            got += [(bytes(m.body), m.store_ms) for m in c.poll(1000, 0.5)]
            c.commit()
        got += [(bytes(m.body), m.store_ms) for m in c.poll(1000, 1.0)]  # (nothing more)
        c.close()
        return got


def failover_all(seed: int = 11) -> int:
    """Five removals of the leader's node under every kind of load."""
    h = Harness(workers=4)
    try:
        mq = h.deploy(**CHECK_MS)
        mq.create_topic("t", queues=2)
        load = Load(mq, seed)
        load.round(-1)
        times = failovers(h, 5, load.plain, per_round=load.round)
        times.sort()
        print(f"failover p50 {times[2]:.2f} s max {times[-1]:.2f} s", flush=True)
        ok = load.check()
        print("checks held" if ok else "CHECKS FAILED", flush=True)
        return 0 if ok else 1
    finally:
        h.close()


def follower_loss() -> int:
    """Followers' nodes lost one, then two: sends go on with two in sync, then fail with
    NotEnoughReplicasError; nodes come back, the replicas copy and rejoin."""
    from raymq import Message
    from raymq.storage.errors import NotEnoughReplicasError
    h = Harness(workers=3)
    try:
        mq = h.deploy(send_retries=1)
        mq.create_topic("t", queues=2)
        log = AckedLog(mq, "t", 3)
        log.send(100)
        g = mq.admin.replicas()[0]
        followers = [r["node"] for r in g["replicas"] if r["role"] == "follower"]
        h.remove(followers[0], replace=False)
        log.send(100)
        print(f"one follower lost: acked {len(log.acked)}/{log.sent}", flush=True)
        h.remove(followers[1], replace=False)
        deadline = time.monotonic() + 30
        err = None
        while err is None and time.monotonic() < deadline:
            try:
                log.p.send(Message("t", b"short"))
            except NotEnoughReplicasError as e:
                err = e
        print(f"two lost: {type(err).__name__}: {err}", flush=True)
        h.add()
        h.add()
        g = h.wait_in_sync(3, timeout_s=90)
        log.send(100)
        print(f"back: in sync {len(g['in_sync'])}, acked {len(log.acked)}/{log.sent}",
              flush=True)
        lost, dup, ordered = log.missing(mq, "check")
        print(f"lost {lost} duplicates {dup} ordered {ordered}", flush=True)
        return 0 if err is not None and lost == 0 and len(log.acked) >= 300 else 1
    finally:
        h.close()


def paused_leader() -> int:
    """The leader's process stopped (SIGSTOP) until another is elected, then resumed: the
    write it held acknowledges nothing, and it is cut away when the old leader rejoins."""
    from raymq import rpc
    from raymq.storage import RecordBatch
    h = Harness(workers=3)
    try:
        mq = h.deploy()
        mq.create_topic("t", queues=1)
        log = AckedLog(mq, "t", 5)
        log.send(50)
        old = mq.shard_handle(0)
        status = rpc.call(old.ping, timeout_s=30)
        os.kill(status["pid"], signal.SIGSTOP)
        try:
            held = old.send.remote(RecordBatch("t", 0, [b"held-by-paused-leader"]), 0, 0)
            t = log.until_acked()  # the SDK finds the new leader
            print(f"new leader acknowledged after {t:.2f} s", flush=True)
        finally:
            os.kill(status["pid"], signal.SIGCONT)
        try:
            reply = rpc.get(held, 30)
            answer = reply.status
        except Exception as err:  # noqa: BLE001
            answer = type(err).__name__
        print(f"paused leader's answer: {answer}", flush=True)
        g = h.wait_in_sync(3, timeout_s=60)
        log.send(50)
        # the operator moves leadership back to the old leader's node (`raymq shard elect`)
        from raymq.tools.cli import _print_replicas
        back = mq.admin.elect(0, status["node"][:12])
        print(f"elected back: {back['leader_node'] == status['node']} epoch {back['epoch']}",
              flush=True)
        log.send(50)
        _print_replicas(mq.admin.replicas())
        g = mq.admin.replicas()[0]
        lost, dup, ordered = log.missing(mq, "check")
        c = mq.consumer("peek", "t")
        seen = [bytes(m.body) for m in c.poll(100_000, 2.0)]
        c.close()
        print(f"epoch {g['epoch']} lost {lost} duplicates {dup} held write delivered "
              f"{b'held-by-paused-leader' in seen}", flush=True)
        return 0 if answer != "SEND_OK" and lost == 0 and \
            b"held-by-paused-leader" not in seen else 1
    finally:
        h.close()


def half_check() -> int:
    """A half message whose leader is lost before its check-back: the new leader checks
    it, and it is committed exactly once."""
    from raymq import Message
    from raymq.transaction_producer import LocalTransactionState as S, TransactionListener

    class Unknown(TransactionListener):
        checks = 0

        def execute_local_transaction(self, msg, arg):
            return S.UNKNOW

        def check_local_transaction(self, msg):
            Unknown.checks += 1
            return S.COMMIT_MESSAGE
    h = Harness(workers=4)
    try:
        mq = h.deploy(txn_timeout_ms=3000, txn_check_interval_ms=300)
        mq.create_topic("h", queues=1)
        tx = mq.transaction_producer("g-half", Unknown())
        tx.send_in_transaction(Message("h", b"half-1"))
        h.remove(h.leader_node())
        c = mq.consumer("hc", "h")
        got = []
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            got += [bytes(m.body) for m in c.poll(10, 0.5)]
        got += [bytes(m.body) for m in c.poll(10, 3.0)]
        c.close()
        print(f"half after failover: delivered {got.count(b'half-1')} time(s), checks "
              f"{Unknown.checks}", flush=True)
        return 0 if got.count(b"half-1") == 1 else 1
    finally:
        h.close()


def coordinator_loss(seed: int = 3) -> int:
    """The node of the transaction coordinator's leader lost, twice, while Kafka-style
    transactions run: a coordinator replica takes over from the replicated log; every
    committed transaction is seen once, no aborted one, nothing is left open."""
    from raymq import Message
    rnd = random.Random(seed)
    h = Harness(workers=4)
    try:
        mq = h.deploy(num_coordinators=1)
        mq.create_topic("ktx", queues=2)
        kp = mq.transactional_producer("ktx-c")
        want, unwanted, n = set(), set(), 0

        def transactions(k):
            nonlocal n
            for _ in range(k):
                bodies = [b"k%07d" % (n + i) for i in range(rnd.randint(1, 8))]
                n += len(bodies)
                abort = rnd.random() < 0.3
                try:
                    with kp.transaction():
                        kp.send_batch([Message("ktx", b) for b in bodies])
                        if abort:
                            raise RuntimeError("abort")
                except RuntimeError:
                    pass
                (unwanted if abort else want).update(bodies)
        transactions(20)
        for round_ in range(2):
            g = mq.control.call("coordinator_replicas", timeout_s=30)[0]
            before = g["epoch"]
            t0 = time.monotonic()
            h.remove(g["nodes"][g["leader"]], replace=False)
            transactions(5)  # (the first ones wait for the new coordinator)
            after = mq.control.call("coordinator_replicas", timeout_s=30)[0]["epoch"]
            print(f"coordinator failover {round_}: epoch {before} -> {after}, "
                  f"{time.monotonic() - t0:.2f} s for 5 transactions", flush=True)
            h.add()
            transactions(10)
        kp.close()
        c = mq.consumer("check", "ktx")
        got = []
        deadline = time.monotonic() + 60
        while not want <= set(got) and time.monotonic() < deadline:
            got += [bytes(m.body) for m in c.poll(1000, 0.5)]
        got += [bytes(m.body) for m in c.poll(1000, 1.0)]
        c.close()
        open_txns = [t for t in mq.admin.tx_list() if t["state"] not in
                     ("EMPTY", "COMPLETE_COMMIT", "COMPLETE_ABORT")]
        once = sum(got.count(b) == 1 for b in want)
        print(f"kafka after coordinator failovers: committed seen once {once}/{len(want)} "
              f"aborted seen {sum(b in unwanted for b in got)} left open {len(open_txns)}",
              flush=True)
        return 0 if once == len(want) and not any(b in unwanted for b in got) and \
            not open_txns else 1
    finally:
        h.close()


def down_up() -> int:
    """`raymq down` then `raymq up` with the same settings: every replica restarts in its
    bundle (on its node, with its files), a leader is elected, nothing is lost."""
    h = Harness(workers=3)
    try:
        mq = h.deploy()
        mq.create_topic("t", queues=2)
        log = AckedLog(mq, "t", 9)
        log.send(300)
        epoch = mq.admin.replicas()[0]["epoch"]
        h.undeploy()
        mq = h.deploy()
        log.mq, log.p = mq, mq.producer("acked-t")
        g = h.wait_in_sync(3, timeout_s=90)
        log.send(100)
        lost, dup, ordered = log.missing(mq, "check")
        print(f"after down and up: epoch {epoch} -> {g['epoch']}, in sync "
              f"{len(g['in_sync'])}, acked {len(log.acked)}/{log.sent}, lost {lost} "
              f"duplicates {dup} ordered {ordered}", flush=True)
        _print_console_overview(mq)
        return 0 if lost == 0 and len(log.acked) == 400 else 1
    finally:
        h.close()


def _print_console_overview(mq) -> None:
    """What the web console's overview shows of a replicated cluster (its JSON)."""
    from raymq.tools.console_pages import Pages
    ov = Pages(mq).overview()
    for group in ov["replicas"]:
        roles = sorted(r["role"] for r in group["replicas"])
        print(f"console: shard-{group['shard']} roles {' '.join(roles)} in sync "
              f"{len(group['in_sync'])}", flush=True)
    kinds = sorted({a["kind"] for a in ov["actors"] if a["alive"]})
    dead = [a["name"] for a in ov["actors"] if not a["alive"]]
    print(f"console: alive kinds {', '.join(kinds)}; not answering {dead}; nodes "
          f"{sum(n['alive'] for n in ov['nodes'])}", flush=True)


if __name__ == "__main__":
    sys.exit(globals()[sys.argv[1]]())
