"""Run by test_replication_cluster, one scenario a process (each its own Ray cluster of a
head and worker nodes on this machine: ``raymq.tools.failover.Harness``).

``python -m tests.replication_scenario NAME`` exits 0 when every check held, printing
what it checks as it goes (the test asserts on those lines too).
"""
from __future__ import annotations

import os
import random
import shutil
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
    NotEnoughReplicasError; nodes come back, the replicas copy and rejoin.

    The lease (2.5 s) outlasts the leader's wait for its replicas (half the send timeout,
    2 s): the first send after a loss is answered FLUSH_SLAVE_TIMEOUT while the lost
    follower is still in the in-sync set, and the producer sends it again until the set
    has shrunk."""
    from raymq import Message
    from raymq.storage.errors import NotEnoughReplicasError
    h = Harness(workers=3)
    try:
        mq = h.deploy(send_retries=3, replica_lease_ms=2500)
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


def _replica_status(shard: int = 0, factor: int = 3) -> dict[str, dict]:
    """Each replica of ``shard``: its status (``pid``, ``node``, ``role``, ``epoch``)."""
    from raymq import rpc
    names = [f"shard-{shard}-r{k}" for k in range(factor)]  # (their actor names)
    return {n: rpc.call(rpc.get_actor(n).ping, timeout_s=30) for n in names}


def _leader_name(g: dict) -> str | None:
    return next((r["name"] for r in g["replicas"] if r["role"] == "leader"), None)


def _wait_gone(pid: int, timeout_s: float = 30) -> bool:
    """Until process ``pid`` exited (a removed node's worker); whether it did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def controller_node_lost() -> int:
    """The controller on a node of its own (the ``raymq_controller`` resource), that node
    lost while producers send, its files with it: it restarts on a fresh node with the
    resource, takes the groups, topics and routes back from what the replicas keep, and
    elections go on (the shard-0 leader's node lost next)."""
    import threading
    h = Harness(workers=3)
    try:
        # a node no replica's bundle fits on (no CPU), holding the controller's resource
        controller_node = dict(num_cpus=0, resources={"raymq_controller": 1})
        first = h.add(**controller_node)
        mq = h.deploy()
        where = mq.control.call("node_id", timeout_s=30)
        print(f"controller on the raymq_controller node: {where == first.node_id}", flush=True)
        mq.create_topic("t", queues=2)
        log = AckedLog(mq, "t", 13)
        log.send(100)
        pid = mq.control.call("ping", timeout_s=30)["pid"]
        stop, errors = threading.Event(), []

        def produce():  # (the only user of ``log`` until joined)
            while not stop.wait(0.05):
                try:
                    log.send(20)
                except Exception as err:  # noqa: BLE001 -- not acknowledged: not in the log
                    errors.append(type(err).__name__)
                    time.sleep(0.2)
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        time.sleep(0.5)
        acked_before = len(log.acked)
        h.remove(first.node_id, replace=False)
        gone = _wait_gone(pid)
        # its files were on that node's disk (here a directory shared by every node)
        directory = os.path.join(mq.config.resolved_data_dir(), "controller")
        shutil.rmtree(directory, ignore_errors=True)
        print(f"controller's node removed: process gone {gone}, files wiped "
              f"{not os.path.exists(os.path.join(directory, 'meta.json'))}", flush=True)
        time.sleep(2.0)  # (producers go on sending to the leader meanwhile)
        acked_without = len(log.acked) - acked_before
        fresh = h.add(**controller_node)
        t0 = time.monotonic()
        ping = mq.control.call("ping", timeout_s=120)
        where = mq.control.call("node_id", timeout_s=30)
        print(f"controller restarted on the fresh node: {where == fresh.node_id}, new process "
              f"{ping['pid'] != pid}, {time.monotonic() - t0:.2f} s", flush=True)
        time.sleep(1.0)
        stop.set()
        producer.join(60)
        print(f"sent while the controller was lost and restarted: acked {len(log.acked)}/"
              f"{log.sent} ({acked_without} without a controller), errors "
              f"{sorted(set(errors))}", flush=True)
        print(f"topics after: {sorted(mq.topics())}", flush=True)
        g = h.wait_in_sync(3, timeout_s=60)
        took = log.until_acked()
        print(f"after the controller's restart: in sync {len(g['in_sync'])}, SEND_OK in "
              f"{took:.2f} s", flush=True)
        # elections still happen: the shard-0 leader's node lost next
        before = mq.admin.replicas()[0]
        t0 = time.monotonic()
        h.remove(before["leader_node"], replace=False)
        took = log.until_acked(past_epoch=before["epoch"], since=t0)
        after = mq.admin.replicas()[0]
        print(f"leader's node lost: epoch {before['epoch']} -> {after['epoch']}, "
              f"{took:.2f} s to SEND_OK", flush=True)
        h.add()
        g = h.wait_in_sync(3, timeout_s=90)
        again = log.send_again(50)
        lost, checked = log.checked(mq)
        print(f"after: in sync {len(g['in_sync'])}, acked again {again}/50, {checked}",
              flush=True)
        return 0 if lost == 0 and again == 50 and after["epoch"] > before["epoch"] and \
            "t" in mq.topics() else 1
    finally:
        h.close()


def controller_node_lost_new_topic(lease_ms: int = 10_000) -> int:
    """The controller's node lost, its files with it, right after a topic was created and
    written to (before the replicas' next heartbeats: every ``replica_lease_ms / 5``, long
    here): the topic and its acknowledged messages must survive the controller's restart."""
    h = Harness(workers=3)
    try:
        controller_node = dict(num_cpus=0, resources={"raymq_controller": 1})
        first = h.add(**controller_node)
        mq = h.deploy(replica_lease_ms=lease_ms)
        h.wait_in_sync(3, timeout_s=60)
        pid = mq.control.call("ping", timeout_s=30)["pid"]
        t0 = time.monotonic()
        mq.create_topic("t", queues=2)
        log = AckedLog(mq, "t", 29)
        log.send(50)
        h.remove(first.node_id, replace=False)
        print(f"controller's node removed {time.monotonic() - t0:.2f} s after the topic was "
              f"created, acked {len(log.acked)}/{log.sent}", flush=True)
        gone = _wait_gone(pid)
        directory = os.path.join(mq.config.resolved_data_dir(), "controller")
        shutil.rmtree(directory, ignore_errors=True)
        h.add(**controller_node)
        mq.control.call("ping", timeout_s=120)
        g = h.wait_in_sync(3, timeout_s=60)
        print(f"controller restarted (old process gone {gone}): in sync {len(g['in_sync'])}, "
              f"topics after: {sorted(mq.topics())}", flush=True)
        n, errors = len(log.acked), []
        for _ in range(5):
            try:
                log.send(10)
            except Exception as err:  # noqa: BLE001 -- printed: the topic lost?
                errors.append(f"{type(err).__name__}: {err}")
                time.sleep(0.5)
        again = len(log.acked) - n
        lost, checked = log.checked(mq, timeout_s=20)
        print(f"after: acked again {again}/50 errors {errors[:1]}, {checked}", flush=True)
        return 0 if lost == 0 and again == 50 and "t" in mq.topics() else 1
    finally:
        h.close()


def controller_files_wiped() -> int:
    """`raymq down`, the controller's directory deleted, `raymq up` with the same
    settings: the controller takes the topics, routes and groups back from the replicas;
    nothing acknowledged is lost, sends are acknowledged again."""
    h = Harness(workers=3)
    try:
        mq = h.deploy()
        mq.create_topic("t", queues=2)
        log = AckedLog(mq, "t", 17)
        log.send(300)
        epoch = mq.admin.replicas()[0]["epoch"]
        directory = os.path.join(mq.config.resolved_data_dir(), "controller")
        h.undeploy()
        shutil.rmtree(directory)
        print(f"controller's directory wiped: {not os.path.exists(directory)}", flush=True)
        mq = h.deploy()
        print(f"topics after: {sorted(mq.topics())}", flush=True)
        log.mq, log.p = mq, mq.producer("acked-t")
        g = h.wait_in_sync(3, timeout_s=90)
        again = log.send_again(100)
        lost, checked = log.checked(mq)
        print(f"after the controller's files were wiped: epoch {epoch} -> {g['epoch']}, in "
              f"sync {len(g['in_sync'])}, acked again {again}/100, {checked}", flush=True)
        return 0 if lost == 0 and again == 100 and "t" in mq.topics() else 1
    finally:
        h.close()


def leader_dir_wiped() -> int:
    """`raymq down`, the shard-0 leader replica's directory deleted (a disk replaced),
    `raymq up`: the wiped replica does not lead, copies the log back and rejoins."""
    h = Harness(workers=3)
    try:
        mq = h.deploy()
        mq.create_topic("t", queues=2)
        log = AckedLog(mq, "t", 21)
        log.send(300)
        g = h.wait_in_sync(3)
        wiped = _leader_name(g)
        node = next(r["node"] for r in g["replicas"] if r["name"] == wiped)
        directory = os.path.join(mq.config.resolved_data_dir(node), wiped)
        h.undeploy()
        shutil.rmtree(directory)
        print(f"wiped the leader's directory: {not os.path.exists(directory)}", flush=True)
        mq = h.deploy()
        first = mq.admin.replicas()[0]
        log.mq, log.p = mq, mq.producer("acked-t")
        again = log.send_again(100)
        g = h.wait_in_sync(3, timeout_s=90)
        status = _replica_status()
        print(f"leader after up: wiped one leads {_leader_name(first) == wiped}, epoch "
              f"{g['epoch']}; once in sync: wiped one leads {_leader_name(g) == wiped}; "
              f"wiped replica's log end {status[wiped]['log_end']} (leader's "
              f"{status[_leader_name(g)]['log_end']})", flush=True)
        lost, checked = log.checked(mq)
        print(f"after the leader's directory was wiped: in sync {len(g['in_sync'])}, acked "
              f"again {again}/100, {checked}", flush=True)
        return 0 if lost == 0 and again == 100 and _leader_name(first) != wiped else 1
    finally:
        h.close()


def all_in_sync_paused() -> int:
    """Every replica of shard 0 paused (SIGSTOP) past the lease, then one follower only
    resumed: it leads (a new epoch) and acknowledges (``min_insync_replicas`` 1: one
    replica may acknowledge); the rest resumed, they rejoin and nothing is lost."""
    h = Harness(workers=3)
    try:
        mq = h.deploy(min_insync_replicas=1)
        mq.create_topic("t", queues=2)
        log = AckedLog(mq, "t", 23)
        log.send(200)
        g = h.wait_in_sync(3)
        status = _replica_status()
        old = _leader_name(g)
        resumed = next(n for n in sorted(status) if n != old)
        for s in status.values():
            os.kill(s["pid"], signal.SIGSTOP)
        try:
            time.sleep(3 * mq.config.replica_lease_ms / 1000)
            os.kill(status[resumed]["pid"], signal.SIGCONT)
            t0 = time.monotonic()
            took = log.until_acked(past_epoch=g["epoch"], since=t0)
            after = mq.admin.replicas()[0]
            more = log.send_again(50)
            print(f"one follower resumed: it leads {_leader_name(after) == resumed}, epoch "
                  f"{g['epoch']} -> {after['epoch']}, {took:.2f} s to SEND_OK, acked "
                  f"{more}/50 more with the others paused", flush=True)
        finally:
            for s in status.values():
                os.kill(s["pid"], signal.SIGCONT)
        g = h.wait_in_sync(3, timeout_s=90)
        again = log.send_again(50)
        lost, checked = log.checked(mq)
        print(f"all resumed: in sync {len(g['in_sync'])}, epoch {g['epoch']}, acked again "
              f"{again}/50, {checked}", flush=True)
        return 0 if lost == 0 and again == 50 and _leader_name(after) == resumed else 1
    finally:
        h.close()


def retention_replicated() -> int:
    """(issue 35) A topic of 1 s retention on a group of three: the leader deletes its
    segments and the followers the same; a follower's node lost, a fresh one joins (its
    replica's directory new: far behind the leader's log start) and copies from the log
    start; the leader's node lost after that, the new leader keeps the log start and
    every message from it on."""
    from raymq import Message
    h = Harness(workers=3)
    try:
        mq = h.deploy(segment_size_bytes=9 << 20, retention_check_ms=200,
                      disk_clean_ratio=1.0, disk_full_ratio=1.0)
        mq.create_topic("t", 1, retention_ms=1000)
        p = mq.producer()
        body = bytes(256 * 1024)
        sent = [p.send(Message("t", b"%04d" % i + body)).queue_offset for i in range(80)]

        def retention() -> dict:
            return mq.admin.status()["shards"][0]["info"]["retention"]

        time.sleep(1.5)  # (all of it past the topic's retention)
        sent += [p.send(Message("t", b"%04d" % i + body)).queue_offset for i in range(80, 120)]
        deadline = time.monotonic() + 60
        while retention()["deleted_segments"] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        before = retention()
        print(f"leader deleted {before['deleted_segments']} log start "
              f"{before['log_start_phys']} t/0 from {before['log_starts'].get('t/0')}",
              flush=True)
        g = mq.admin.replicas()[0]
        follower = next(r["node"] for r in g["replicas"] if r["role"] == "follower")
        h.remove(follower)  # (a fresh node joins: the lost replica starts there, empty)
        sent += [p.send(Message("t", b"%04d" % i + body)).queue_offset for i in range(120, 130)]
        g = h.wait_in_sync(3, timeout_s=120)
        print(f"back: in sync {len(g['in_sync'])}", flush=True)
        h.remove(h.leader_node())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                sent.append(p.send(Message("t", b"%04d" % 130 + body)).queue_offset)
                break
            except Exception:  # (the election under way)
                time.sleep(0.2)
        after = retention()
        start = after["log_starts"].get("t/0", 0)
        print(f"new leader: log start {after['log_start_phys']} (was "
              f"{before['log_start_phys']}) t/0 from {start}", flush=True)
        c = mq.consumer("check", ["t"])
        got = []
        deadline = time.monotonic() + 60
        while len(got) < 131 - start and time.monotonic() < deadline:
            got += c.poll(200, 1.0)
        c.close()
        offsets = [m.queue_offset for m in got]
        bodies_ok = all(m.body[:4] == b"%04d" % m.queue_offset for m in got)
        print(f"read from {offsets[0] if offsets else None} to "
              f"{offsets[-1] if offsets else None}: gaps "
              f"{offsets != list(range(offsets[0], 131)) if offsets else True} "
              f"bodies {bodies_ok}", flush=True)
        ok = (before["deleted_segments"] >= 2 and after["log_start_phys"] >=
              before["log_start_phys"] and offsets and offsets[0] >= start and
              offsets == list(range(offsets[0], 131)) and bodies_ok and sent[-1] == 130)
        return 0 if ok else 1
    finally:
        h.close()


def kafka_idempotent_failover() -> int:
    """librdkafka's idempotent producer (its defaults: acks=all, enable.idempotence)
    through the Kafka listener while the leader's node is lost: every message delivered
    once, in order, no gap."""
    import threading
    from confluent_kafka import Consumer, Producer, TopicPartition
    from raymq.wire.listener import KafkaListener
    h = Harness(workers=3)
    try:
        mq = h.deploy()
        mq.create_topic("k", queues=2)
        listener = KafkaListener(mq, port=0).start()
        boot = "%s:%d" % listener.address
        p = Producer({"bootstrap.servers": boot, "enable.idempotence": True, "linger.ms": 2,
                      "message.timeout.ms": 120_000})
        failed, n, sent = [], 4000, [0]
        done = threading.Event()

        def produce():
            for i in range(n):
                while True:
                    try:
                        p.produce("k", value=b"%05d" % i, partition=i % 2,
                                  on_delivery=lambda e, _m: e is not None and failed.append(e))
                        break
                    except BufferError:
                        p.poll(0.01)
                sent[0] = i + 1
                if i % 100 == 0:
                    p.poll(0)
                    time.sleep(0.05)  # (spread over the failover)
            p.flush(180)
            done.set()
        t = threading.Thread(target=produce, daemon=True)
        t.start()
        time.sleep(0.5)
        before = mq.admin.replicas()[0]
        print(f"the leader's node removed after {sent[0]} of {n} sent", flush=True)
        h.remove(before["leader_node"], replace=False)
        h.add()
        done.wait(300)
        after = mq.admin.replicas()[0]
        print(f"failover: epoch {before['epoch']} -> {after['epoch']}; produced "
              f"{n}, failed {len(failed)}", flush=True)
        c = Consumer({"bootstrap.servers": boot, "group.id": "check",
                      "enable.auto.commit": False, "enable.partition.eof": True})
        c.assign([TopicPartition("k", q, 0) for q in range(2)])
        got: dict[int, list] = {0: [], 1: []}
        eof: set = set()
        deadline = time.monotonic() + 120
        while len(eof) < 2 and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            if m.error() is None:
                got[m.partition()].append(int(m.value()))
                eof.discard(m.partition())
            elif m.error().code() == -191:
                eof.add(m.partition())
        c.close()
        listener.stop()
        ok = True
        for q in (0, 1):
            want = list(range(q, n, 2))
            dup = len(got[q]) - len(set(got[q]))
            print(f"partition {q}: read {len(got[q])}/{len(want)} duplicates {dup} "
                  f"in order {got[q] == sorted(got[q])} complete {got[q] == want}", flush=True)
            ok = ok and got[q] == want
        return 0 if ok and not failed and after["epoch"] > before["epoch"] else 1
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
