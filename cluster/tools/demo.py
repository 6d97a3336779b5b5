"""``raymq demo``: the seeds' shopping scenario on an embedded local cluster -- its order
and points services, the failures it injects, and the consistency report that judges it.

The order service debits the buyer's account and inserts the order in one
SQLite transaction inside ``execute_local_transaction``, and publishes an
``orders`` message that commits or rolls back with it; ``check_local_transaction``
looks the order up.  The points service consumes ``orders`` and credits
points idempotently (deduplicating by order id in its own SQLite file).

Failures injected along the way (seeds 000-003):
- the order service is killed (os._exit) after its database commit, before
  end_transaction; a new order-service process answers the check-back;
- end_transaction is lost for some orders (check-back commits them);
- local transactions fail: an account without funds (rollback) and a
  database error raised inside the transaction (unknown -> check -> rollback);
- the points service fails on the first delivery of some messages (retries).

Then a consistency report: orders paid = orders credited with points, no
points for a rolled-back order, no half message left unresolved, no dead
letter.  Exit status 1 if anything is inconsistent.

``--sabotage check-always-commits`` breaks the order service on purpose: its
check-back answers COMMIT without looking at its database, so orders whose
local transaction failed get points.  The report catches it (exit status 1):
the check shows what the report is worth.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time

TOPIC = "orders"
GROUP = "order-service"
POINTS_GROUP = "points-service"
ACCOUNTS = 6
START_BALANCE = 500
DEMO_CONFIG = dict(num_shards=2, txn_timeout_ms=1500, txn_check_interval_ms=500,
                   txn_max_checks=15, txn_check_backoff_max_ms=4000, producer_lease_ms=3000,
                   delay_levels="300ms 600ms 1s 2s 3s 5s 10s 30s 1m", retry_first_level=1,
                   max_reconsume=6, heartbeat_interval_ms=300, session_timeout_ms=2000)


#: The minute the demo's orders start in (they spread over three: the income job's minutes).
DEMO_MINUTE_MS = 1_700_000_040_000


def plan(n: int) -> dict[int, dict]:
    """What each order is and which failure it meets (deterministic)."""
    orders = {}
    for i in range(n):
        account = i % ACCOUNTS
        amount = 40 + (i * 37) % 90
        fault = None
        if i == n // 3:
            fault = "crash"            # producer dies after the DB commit
        elif i % 9 == 4:
            fault = "lost_end"         # end_transaction never arrives
        elif i % 11 == 7:
            fault = "db_error"         # the local transaction raises
        orders[i] = {"order_id": f"o-{i:04d}", "account": account, "amount": amount,
                     "fault": fault, "ts_ms": DEMO_MINUTE_MS + (i % 3) * 60_000 + i}
    return orders


# ------------------------------------------------------------------ order service
def init_order_db(path: str) -> None:
    con = sqlite3.connect(path)
    with con:
        con.execute("CREATE TABLE IF NOT EXISTS accounts(id INTEGER PRIMARY KEY, balance INTEGER)")
        con.execute("CREATE TABLE IF NOT EXISTS orders(order_id TEXT PRIMARY KEY, tx TEXT, "
                    "account INTEGER, amount INTEGER, placed_ms INTEGER)")
        con.executemany("INSERT OR IGNORE INTO accounts VALUES (?, ?)",
                        [(a, START_BALANCE) for a in range(ACCOUNTS)])
    con.close()


SABOTAGE = ("check-always-commits",)
#: Fewest orders for which every planned failure happens (a crash, a lost end, a local error).
MIN_ORDERS = 12
#: set in the order services' environment by a verbose demo
VERBOSE_ENV = "RAYMQ_DEMO_VERBOSE"


def order_service(address: str, db: str, first: int, n: int, out,
                  sabotage: str | None = None) -> None:
    """Runs in a child process; prints one JSON line per order, and per check-back answered."""
    from raymq import rpc
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not os.environ.get(VERBOSE_ENV):  # the driver narrates the faults it injects
        logging.getLogger("raymq").setLevel(logging.ERROR)
    rpc.init(address, logging_level="ERROR")
    from raymq import LocalTransactionState as S
    from raymq import Message, TransactionListener, connect
    orders = plan(n)
    txids: dict[str, str] = {}  # transaction id -> order id (the lost-end fault needs it)
    print_lock = threading.Lock()  # check-backs answer from other threads

    class OrderListener(TransactionListener):
        def execute_local_transaction(self, msg, order):
            txids[msg.transaction_id] = order["order_id"]
            con = sqlite3.connect(db, timeout=30)
            try:
                with con:  # one local transaction: debit + order row
                    if order["fault"] == "db_error":
                        raise sqlite3.OperationalError("disk I/O error (injected)")
                    (balance,) = con.execute("SELECT balance FROM accounts WHERE id = ?",
                                             (order["account"],)).fetchone()
                    if balance < order["amount"]:
                        return S.ROLLBACK_MESSAGE  # insufficient funds: nothing happens
                    con.execute("UPDATE accounts SET balance = balance - ? WHERE id = ?",
                                (order["amount"], order["account"]))
                    con.execute("INSERT INTO orders VALUES (?, ?, ?, ?, ?)",
                                (order["order_id"], msg.transaction_id, order["account"],
                                 order["amount"], order["ts_ms"]))
            finally:
                con.close()
            if order["fault"] == "crash":
                print(json.dumps({"order": order["order_id"], "event": "crash"}), file=out,
                      flush=True)
                os._exit(3)  # killed after the DB commit, before end_transaction
            return S.COMMIT_MESSAGE

        def check_local_transaction(self, msg):
            con = sqlite3.connect(db, timeout=30)
            try:
                row = con.execute("SELECT 1 FROM orders WHERE tx = ?",
                                  (msg.transaction_id,)).fetchone()
            finally:
                con.close()
            state = S.COMMIT_MESSAGE if row else S.ROLLBACK_MESSAGE
            if sabotage == "check-always-commits":
                state = S.COMMIT_MESSAGE  # the bug the report must catch
            with print_lock:
                print(json.dumps({"order": json.loads(msg.body)["order_id"], "event": "check",
                                  "answer": state.value}), file=out, flush=True)
            return state

    mq = connect()
    lost = {o["order_id"] for o in orders.values() if o["fault"] == "lost_end"}
    tp = mq.transaction_producer(GROUP, OrderListener(),
                                 drop_end=lambda tx: txids.get(tx) in lost)
    for i in range(first, n):
        order = orders[i]
        msg = Message(TOPIC, json.dumps(order).encode(), key=order["order_id"], tags="order")
        res = tp.send_in_transaction(msg, order)
        with print_lock:
            print(json.dumps({"order": order["order_id"], "event": res.local_state.value,
                              "end_lost": order["order_id"] in lost}), file=out, flush=True)
    with print_lock:
        print(json.dumps({"event": "done"}), file=out, flush=True)
    # stay up to answer check-backs until the driver stops this process
    while True:
        time.sleep(1)


# ----------------------------------------------------------------- points service
class PointsService:
    def __init__(self, mq, db: str):
        self.db = db
        con = sqlite3.connect(db)
        with con:
            con.execute("CREATE TABLE IF NOT EXISTS credited(order_id TEXT PRIMARY KEY, "
                        "msg_id TEXT, points INTEGER)")
            con.execute("CREATE TABLE IF NOT EXISTS points(account INTEGER PRIMARY KEY, "
                        "points INTEGER)")
        con.close()
        self.failures_injected = 0
        self.duplicates_skipped = 0
        self._seen_once: set[str] = set()
        self.consumer = mq.consumer(POINTS_GROUP, [TOPIC])
        self.thread = threading.Thread(target=self.consumer.run, args=(self.handle,),
                                       kwargs={"threads": 2, "idle_s": 0.3}, daemon=True)

    def handle(self, msg) -> None:
        order = json.loads(msg.body)
        oid = order["order_id"]
        if int(oid[2:]) % 7 == 3 and oid not in self._seen_once:
            self._seen_once.add(oid)
            self.failures_injected += 1
            raise RuntimeError("points database busy (injected)")
        con = sqlite3.connect(self.db, timeout=30)
        try:
            with con:  # idempotent: the order id is the dedupe key
                cur = con.execute("INSERT OR IGNORE INTO credited VALUES (?, ?, ?)",
                                  (oid, msg.msg_id, order["amount"] // 10))
                if cur.rowcount == 0:
                    self.duplicates_skipped += 1
                    return
                con.execute("INSERT INTO points VALUES (?, ?) ON CONFLICT(account) DO UPDATE "
                            "SET points = points + excluded.points",
                            (order["account"], order["amount"] // 10))
        finally:
            con.close()


# ------------------------------------------------------------------------- driver
def _income_check(mq, order_db: str, say, verbose: bool = False) -> tuple[bool, str]:
    """The order-income Spark job (``raymq.jobs.order_income``) over the committed orders,
    against the order database's own totals per minute and account."""
    from raymq.jobs import spark_session
    from raymq.jobs.order_income import income_totals, run_once
    say("order-income job: starting Spark on Ray (RayDP: a driver and one executor, "
        "~15 s) to sum the committed orders per minute")
    with spark_session(mq, quiet=not verbose) as spark:
        from raymq.jobs.spark_session import jvm_log_path
        say("order-income job: Spark is up; reading the committed orders" +
            ("" if verbose else f" (Spark's own log: {jvm_log_path()})"))
        stats = run_once(mq, spark, source=TOPIC, target="income", group="order-income")
    say(f"order-income job: {stats['orders_read']} orders read, {stats['messages']} income "
        f"messages written with their offsets, in {stats['seconds']} s")
    reader = mq.consumer("demo-income-check", ["income"], read_only=True)
    got, deadline = [], time.monotonic() + 60
    while len(got) < stats["messages"] and time.monotonic() < deadline:
        got += reader.poll(1000, 1.0)
    reader.close()
    spark_totals = {k: v["income"] for k, v in income_totals(got).items()}
    con = sqlite3.connect(order_db)
    db_totals = {(minute, str(account)): total for minute, account, total in con.execute(
        "SELECT placed_ms / 60000 * 60000, account, SUM(amount) FROM orders GROUP BY 1, 2")}
    con.close()
    return spark_totals == db_totals, (f"{len(spark_totals)} (minute, account) sums, "
                                       f"{sum(spark_totals.values())} in all; database: "
                                       f"{sum(db_totals.values())}")


def run(data_dir: str | None = None, *, orders: int = 60, out=sys.stdout,
        timeout_s: float = 240.0, sabotage: str | None = None, spark: bool = True,
        verbose: bool = False) -> int:
    """The demo; ``verbose``: Ray's, Spark's and RayMQ's own logs as they come (else only
    the demo's lines, and errors)."""
    started = time.monotonic()
    say = lambda text: print(f"[demo {time.monotonic() - started:5.1f}s] {text}",  # noqa: E731
                             file=out, flush=True)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    else:
        from raymq.jobs.spark_session import quiet_ray_data
        quiet_ray_data()
    from raymq import connect, rpc
    from raymq.deploy import undeploy
    work = data_dir or tempfile.mkdtemp(prefix="raymq-demo-")
    os.makedirs(work, exist_ok=True)
    order_db, points_db = os.path.join(work, "order-service.db"), os.path.join(work, "points-service.db")
    init_order_db(order_db)
    say(f"RayMQ demo: {orders} orders, data in {work}")
    say("starting an embedded local Ray cluster and RayMQ (2 shards, checker, registry)")
    rpc.init("local", num_cpus=2, include_dashboard=False,
             logging_level="INFO" if verbose else "ERROR")
    address = rpc.gcs_address()
    procs: list[subprocess.Popen] = []
    try:
        settings = dict(DEMO_CONFIG, data_dir=os.path.join(work, "broker"))
        with open(os.path.join(work, "cluster.json"), "w") as f:  # (for `raymq console`)
            json.dump(settings, f, indent=1)
        mq = connect(**settings)
        mq.create_topic(TOPIC, queues=4)
        points = PointsService(mq, points_db)
        points.thread.start()
        say("points service consuming 'orders' (group points-service)")

        if sabotage:
            say(f"SABOTAGE: {sabotage} -- the consistency report should catch it")
        events: dict[str, str] = {}  # order -> local state of its transaction, or "crash"
        ends_lost: set[str] = set()
        answered: list[tuple[str, str]] = []  # check-backs answered: (order, answer)

        def start_order_service(first: int) -> subprocess.Popen:
            p = subprocess.Popen([sys.executable, "-m", "raymq.tools.demo", "order-service", address,
                                  order_db, str(first), str(orders), *([sabotage] if sabotage
                                                                        else [])],
                                 stdout=subprocess.PIPE, text=True,
                                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 env={**os.environ, "RAY_AUTH_MODE": "disabled"})
            procs.append(p)
            return p

        def read_events(p: subprocess.Popen) -> str:
            for line in p.stdout:
                try:
                    ev = json.loads(line)
                except ValueError:  # a line cut short by the process being killed
                    continue
                if ev["event"] == "check":
                    answered.append((ev["order"], ev["answer"]))
                    continue
                if ev["event"] == "done":
                    # it stays up answering check-backs: keep reading those
                    threading.Thread(target=read_events, args=(p,), daemon=True).start()
                    return "done"
                events[ev["order"]] = ev["event"]
                if ev["event"] == "UNKNOW":
                    say(f"order {ev['order']}: its local transaction failed (a disk I/O error "
                        "injected): UNKNOW, the broker will check back")
                if ev.get("end_lost"):
                    ends_lost.add(ev["order"])
                if len(events) % 10 == 0:
                    say(f"order service: {len(events)}/{orders} orders placed")
                if ev["event"] == "crash":
                    return "crash"
            return "exit"

        say("order service #1 placing orders (SQLite transaction + transactional message)")
        p1 = start_order_service(0)
        how = read_events(p1)
        if how == "crash":
            crashed = next(o for o, e in events.items() if e == "crash")
            p1.wait()
            say(f"order service #1 was KILLED after committing {crashed} to its database, "
                "before end_transaction")
            first = int(crashed[2:]) + 1
            say("order service #2 starts: it places the remaining orders and answers the "
                "broker's check-backs (including the dead instance's)")
            p2 = start_order_service(first)
            read_events(p2)
        say("all orders placed; waiting for check-backs and for the points service")

        con = sqlite3.connect(order_db)
        deadline = time.monotonic() + timeout_s
        last = ""
        while True:
            paid = {r[0] for r in con.execute("SELECT order_id FROM orders")}
            pcon = sqlite3.connect(points_db)
            credited = {r[0] for r in pcon.execute("SELECT order_id FROM credited")}
            pcon.close()
            halves = [h for h in mq.admin.half_list() if h["group"] == GROUP]
            line = (f"paid {len(paid)}, credited {len(credited)}, halves pending {len(halves)}, "
                    f"consumer retries {points.failures_injected}")
            if line != last:
                say(line)
                last = line
            if not halves and credited >= paid:
                time.sleep(1.0)  # let late duplicates, if any, arrive before judging
                break
            if time.monotonic() > deadline:
                say("timed out waiting for the system to settle")
                break
            time.sleep(0.5)
        paid = {r[0] for r in con.execute("SELECT order_id FROM orders")}
        balances = sum(r[0] for r in con.execute("SELECT balance FROM accounts"))
        spent = sum(r[0] for r in con.execute("SELECT amount FROM orders"))
        con.close()
        pcon = sqlite3.connect(points_db)
        credited = {r[0] for r in pcon.execute("SELECT order_id FROM credited")}
        total_points = pcon.execute("SELECT COALESCE(SUM(points), 0) FROM points").fetchone()[0]
        pcon.close()
        halves = [h for h in mq.admin.half_list() if h["group"] == GROUP]
        expired = [h for h in mq.admin.half_list(expired=True) if h["group"] == GROUP]
        dlq = mq.admin.dlq_list(POINTS_GROUP)
        rolled_back = {o["order_id"] for o in plan(orders).values()} - paid
        points.consumer.stop()
        points.thread.join(10)
        points.consumer.close()

        income_ok, income_detail = _income_check(mq, order_db, say, verbose) if spark else (
            True, "skipped (--no-spark)")
        checks = [
            ("orders paid = orders credited with points", paid == credited,
             f"{len(paid)} paid, {len(credited)} credited"),
            ("no points for a rolled-back order", not (rolled_back & credited),
             f"{len(rolled_back)} rolled back, {len(rolled_back & credited)} credited"),
            ("money conserved in the order database",
             balances + spent == ACCOUNTS * START_BALANCE, f"balances {balances} + spent {spent}"),
            ("points match the paid amounts",
             total_points == sum(plan(orders)[int(o[2:])]["amount"] // 10 for o in paid),
             f"{total_points} points"),
            ("no half message left unresolved", not halves and not expired,
             f"{len(halves)} pending, {len(expired)} expired"),
            ("no dead letter", not dlq, f"{len(dlq)} dead letters"),
            ("income per minute from Spark = the order database's own totals", income_ok,
             income_detail),
        ]
        states, answers = list(events.values()), [a for _o, a in list(answered)]
        say("what happened: %d orders committed locally, %d rolled back (insufficient funds), "
            "%d unknown (local transaction error), %d producer killed after its DB commit; "
            "%d end_transaction lost; %d check-backs answered (%d commit, %d rollback); "
            "%d consumer failures retried; %d duplicate deliveries skipped"
            % (states.count("COMMIT_MESSAGE"), states.count("ROLLBACK_MESSAGE"),
               states.count("UNKNOW"), states.count("crash"), len(ends_lost), len(answers),
               answers.count("COMMIT_MESSAGE"), answers.count("ROLLBACK_MESSAGE"),
               points.failures_injected, points.duplicates_skipped))
        print("\nconsistency report", file=out)
        ok = True
        for label, passed, detail in checks:
            ok &= passed
            print(f"  {'OK  ' if passed else 'FAIL'} {label} ({detail})", file=out)
        print(f"\n{'CONSISTENT' if ok else 'INCONSISTENT'}", file=out, flush=True)
        print(f"\nTo look at what just happened (topics, the orders, check-backs, groups) in "
              f"the web console:\n  raymq --config {os.path.join(work, 'cluster.json')} "
              f"console --embedded", file=out, flush=True)
        mq.close()
        return 0 if ok else 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        try:
            undeploy()
        finally:
            rpc.shutdown()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["order-service"]:
        address, db, first, n = argv[1], argv[2], int(argv[3]), int(argv[4])
        order_service(address, db, first, n, sys.stdout, argv[5] if len(argv) > 5 else None)
        return 0
    ap = argparse.ArgumentParser(prog="python -m raymq.tools.demo")
    ap.add_argument("--data-dir")
    ap.add_argument("--orders", type=int, default=60)
    ap.add_argument("--sabotage", choices=SABOTAGE)
    ap.add_argument("--no-spark", action="store_true",
                    help="leave out the order-income Spark job and its report line")
    ap.add_argument("--verbose", action="store_true",
                    help="show Ray's, Spark's and RayMQ's own logs too")
    args = ap.parse_args(argv)
    return run(args.data_dir, orders=args.orders, sabotage=args.sabotage,
               spark=not args.no_spark, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
