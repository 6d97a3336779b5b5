"""`raymq dlq list|resend` end to end on the session cluster: a message fails until it is
dead-lettered, the command line lists it and sends it back, and the group gets it again."""
from __future__ import annotations

import threading

import pytest

from raymq import Message
from raymq.message import retry_topic
from raymq.tools.cli import main
from tests.helpers import wait_for
from tests.client.test_cluster import read_to_end

pytestmark = pytest.mark.ray


def schedule_empty(mq) -> bool:
    return not any(n for s in mq.admin.status()["shards"]
                   for n in s["info"]["schedule_pending"].values())


def test_dlq_list_and_resend_from_the_command_line(mq, name, capsys):
    mq.create_topic(name, queues=1)
    group = f"g{name}"
    p = mq.producer("p")
    sent = p.send(Message(name, b"poison", key="bad"))
    p.close()
    c = mq.consumer(group, [name])

    def failing(m):
        raise RuntimeError("cannot handle")
    runner = threading.Thread(daemon=True, target=c.run, args=(failing,), kwargs={"idle_s": 0.2})
    runner.start()
    wait_for(lambda: mq.admin.dlq_list(group), what="a dead letter")
    c.stop()
    runner.join(30)
    c.close()

    assert main(["dlq", "list", group]) == 0
    out = capsys.readouterr()
    [line] = out.out.strip().splitlines()
    letter_id, origin, _topic, reconsumed, reason, body = line.split("\t")
    assert origin == f"origin {sent.msg_id}" and body == "poison"
    # its failures: the first delivery and max_reconsume redeliveries
    assert reconsumed == f"reconsumed {mq.config.max_reconsume + 1}"
    assert "RuntimeError: cannot handle" in reason
    assert out.err.strip() == f"1 dead letters of group {group}"

    assert main(["dlq", "resend", group]) == 0
    assert capsys.readouterr().out.strip() == f"resent 1 dead letters to the retry topic of {group}"
    assert main(["dlq", "resend", group]) == 0  # each dead letter once: progress is kept
    assert capsys.readouterr().out.strip() == f"resent 0 dead letters to the retry topic of {group}"
    assert main(["dlq", "resend", group, letter_id]) == 0  # named: resent on every call
    assert capsys.readouterr().out.strip() == f"resent 1 dead letters to the retry topic of {group}"
    assert main(["dlq", "resend", group, "zz"]) == 1
    assert "not a RayMQ message id" in capsys.readouterr().err
    assert main(["dlq", "list", group]) == 0  # a dead letter stays listed after a resend
    assert capsys.readouterr().out.strip() == line

    # the group gets it back twice (both resends), as the message it was, counted afresh
    wait_for(lambda: schedule_empty(mq), what="the resent copies through their delay level")
    again = mq.consumer(group, [name])
    got = read_to_end(again, mq, [name, retry_topic(group)])
    again.close()
    assert [(m.body, m.msg_id, m.topic, m.reconsume_count) for m in got] == \
        [(b"poison", sent.msg_id, name, 0)] * 2
