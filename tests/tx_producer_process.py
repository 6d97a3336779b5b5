"""A transaction producer in its own process, killed after its database commit.

python -m tests.tx_producer_process RAY_ADDRESS DB TOPIC GROUP
Commits the order to SQLite inside execute_local_transaction, prints the
transaction id, and dies (os._exit) before end_transaction can be sent.
"""
from __future__ import annotations

import os
import sqlite3
import sys

os.environ["RAY_AUTH_MODE"] = "disabled"

import ray  # noqa: E402


def main() -> None:
    address, db, topic, group = sys.argv[1:5]
    ray.init(address=address, namespace="raymq", log_to_driver=False)
    from raymq import LocalTransactionState, Message, TransactionListener, connect

    class DiesAfterCommit(TransactionListener):
        def execute_local_transaction(self, msg, arg):
            con = sqlite3.connect(db)
            with con:
                con.execute("INSERT INTO orders(tx, item) VALUES (?, ?)", (msg.transaction_id, arg))
            con.close()
            print(f"COMMITTED {msg.transaction_id}", flush=True)
            os._exit(9)  # killed after the DB commit, before end_transaction

        def check_local_transaction(self, msg):
            return LocalTransactionState.UNKNOW

    mq = connect()
    tp = mq.transaction_producer(group, DiesAfterCommit())
    tp.send_in_transaction(Message(topic, b"order-from-the-dead"), "book")


if __name__ == "__main__":
    main()
