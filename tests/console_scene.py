"""A cluster scene for the console's tests: a topic with messages, some consumed by a
group; a half message nobody resolves; an open Kafka-style transaction; a timer due in
an hour; a dead letter.  And the console served over it (``ConsoleServer`` on a free
port, its charts sampled every 0.2 s)."""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from raymq import LocalTransactionState, Message, TransactionListener
from raymq.tools.console import TOKEN_HEADER, Console, ConsoleServer
from raymq.tools.console_pages import Pages
from tests.helpers import wait_for

TOKEN = "test-token-0123"


class Undecided(TransactionListener):
    """A local transaction whose outcome nobody knows: the half stays for the operator."""

    def execute_local_transaction(self, msg, arg):
        return LocalTransactionState.UNKNOW

    def check_local_transaction(self, msg):
        return LocalTransactionState.UNKNOW


@dataclass
class Scene:
    topic: str
    group: str
    sent: list = field(default_factory=list)
    half_id: str = ""
    tid: str = ""
    timer_id: str = ""
    dead_letter: object = None
    closers: list = field(default_factory=list)

    def close(self):
        for c in reversed(self.closers):
            c()


def build(mq, name: str) -> Scene:
    s = Scene(topic=name, group=f"g{name}")
    mq.create_topic(name, queues=2)
    p = mq.producer(f"p{name}")
    s.closers.append(p.close)
    s.sent = list(p.send_batch([Message(name, f"order {i}".encode(), key=f"k{i % 3}")
                                for i in range(20)]))
    s.timer_id = p.send(Message(name, b"in an hour", deliver_after_ms=3_600_000)).msg_id
    c = mq.consumer(s.group, [name])
    got = []
    wait_for(lambda: got.extend(c.poll(20, 0.5)) or len(got) >= 20, what="20 messages")
    c.commit()
    c.close()
    tp = mq.transaction_producer(f"tp{name}", Undecided())
    s.closers.append(tp.close)
    tp.send_in_transaction(Message(name, b"undecided"))
    [half] = wait_for(lambda: [h for h in mq.admin.half_list() + mq.admin.half_list(
        expired=True) if h["topic"] == name], what="the undecided half")
    s.half_id = half["id"]
    kp = mq.transactional_producer(f"tid-{name}", timeout_ms=600_000)
    s.closers.append(kp.close)
    kp.begin()
    kp.send(Message(name, b"open transaction"))
    s.tid = f"tid-{name}"
    s.dead_letter = _dead_letter(mq, name, p)
    return s


def _dead_letter(mq, name: str, p):
    """A message whose consumer always fails: after max_reconsume retries, a dead letter."""
    poison_topic, group = f"{name}-poison", f"dl{name}"
    mq.create_topic(poison_topic, queues=1)
    p.send(Message(poison_topic, b"poison"))
    c = mq.consumer(group, [poison_topic])

    def failing(_m):
        raise RuntimeError("cannot handle this one")
    runner = threading.Thread(daemon=True, target=c.run, args=(failing,), kwargs={"idle_s": 0.2})
    runner.start()
    [letter] = wait_for(lambda: mq.admin.dlq_list(group), what="a dead letter")
    c.stop()
    runner.join()
    c.close()
    return letter


def serve(mq, *, read_only: bool = False) -> ConsoleServer:
    return ConsoleServer(Console(mq, token=TOKEN, read_only=read_only,
                                 pages=Pages(mq, sample_s=0.2)), port=0).start()


def get(server: ConsoleServer, path: str) -> tuple[int, dict]:
    return json_answer(urllib.request.Request(server.url + "api/" + path))


def post(server: ConsoleServer, path: str, token: str | None = TOKEN,
         body: dict | None = None) -> tuple[int, dict]:
    headers = {TOKEN_HEADER: token} if token else {}
    data = None if body is None else json.dumps(body).encode()
    return json_answer(urllib.request.Request(server.url + "api/" + path, data=data,
                                        headers=headers, method="POST"))


def json_answer(req) -> tuple[int, dict]:
    """(HTTP status, JSON body) of a request, an error status included."""
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)
