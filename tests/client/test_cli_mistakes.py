"""Every mistake is one clear line (issue 12 D): the command line against the session cluster."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from raymq import Message
from raymq.message import make_msg_id, parse_msg_id
from raymq.tools.cli import main
from tests.helpers import ROOT

pytestmark = pytest.mark.ray


def one_line_error(capsys, text: str) -> str:
    err = capsys.readouterr().err.strip()
    assert text in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_wrong_message_ids_are_no_such_message(mq, name, capsys):
    mq.create_topic(name, queues=1)
    [r] = mq.producer("p").send_batch([Message(name, b"hello")])
    shard, phys = parse_msg_id(r.msg_id)
    for wrong in (make_msg_id(shard, phys + 3), make_msg_id(shard, phys + 10**9),
                  make_msg_id(mq.num_shards + 5, phys)):
        assert main(["msg", "show", wrong]) == 1
        err = one_line_error(capsys, "no such message")
        assert "shard-" not in err or "names shard" in err
        assert "/" not in err.split("no such message")[1]  # no server path
    out_of_range = make_msg_id(mq.num_shards + 5, 100)
    for argv in (["half", "commit", out_of_range], ["half", "rollback", out_of_range],
                 ["dlq", "resend", f"g{name}", out_of_range]):
        assert main(argv) == 1
        one_line_error(capsys, "no such message")


def test_consume_no_commit_commits_nothing(mq, name, capsys):
    mq.create_topic(name, queues=1)
    mq.producer("p").send_batch([Message(name, b"a"), Message(name, b"b")])
    for _ in range(2):  # a peek, twice: both see everything
        assert main(["consume", name, "--group", f"g{name}", "--max", "2", "--timeout", "20",
                     "--no-commit"]) == 0
        out = capsys.readouterr()
        assert out.out.count("\t") >= 2 and "\ta" in out.out and "\tb" in out.out
        assert "consumed 2 messages (nothing committed)" in out.err
    assert main(["consume", name, "--group", f"g{name}", "--max", "2", "--timeout", "20"]) == 0
    assert "consumed 2 messages" in capsys.readouterr().err  # and now it commits
    assert main(["consume", name, "--group", f"g{name}", "--max", "2", "--timeout", "3"]) == 0
    assert "consumed 0 messages" in capsys.readouterr().err


def test_small_mistakes_are_one_line(mq, name, capsys, monkeypatch, tmp_path):
    import io
    mq.create_topic(name, queues=1)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["send", name, "-"]) == 1
    one_line_error(capsys, "nothing to send")
    with pytest.raises(SystemExit):
        main(["send", name, "x", "--repeat", "0"])
    assert "must be at least 1" in capsys.readouterr().err
    assert list(mq.producer("p").send_batch([])) == []
    assert main(["--config", str(tmp_path / "missing.json"), "status"]) == 1
    one_line_error(capsys, "missing.json")
    assert main(["dlq", "list", f"g{name}"]) == 0
    assert f"0 dead letters of group g{name}" in capsys.readouterr().err


def test_help_shows_defaults():
    out = subprocess.run([sys.executable, "-m", "raymq.tools.cli", "consume", "--help"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "COLUMNS": "200"}).stdout
    assert "(default: 100)" in out and "(default: 5.0)" in out


def test_every_command_says_what_it_does_in_its_help():
    from raymq.tools.cli import build_parser, command_tree
    commands = [(path, parser) for path, parser, _line in command_tree(build_parser())]
    assert len(commands) > 30
    silent = [path for path, parser in commands if not (parser.description or "").strip()]
    assert silent == []
    help_of = dict(commands)["raymq tx abort"].format_help()
    assert "TransactionAbortedError" in help_of and "PREPARE_ABORT" in help_of


def test_a_transactional_send_result_has_no_queue_offset_before_it_commits(mq, name):
    from raymq import LocalTransactionState as S
    from raymq import TransactionListener

    class Commit(TransactionListener):
        def execute_local_transaction(self, msg, arg):
            return S.COMMIT_MESSAGE

        def check_local_transaction(self, msg):
            return S.COMMIT_MESSAGE
    mq.create_topic(name, queues=1)
    tp = mq.transaction_producer(f"p{name}", Commit())
    try:
        res = tp.send_in_transaction(Message(name, b"x"), None)
        # the half queue's offset is no offset of the real topic
        assert [(r.topic, r.queue_offset) for r in res.results] == [(name, -1)]
    finally:
        tp.close()


def test_replication_mistakes_are_one_line(mq, capsys):
    from raymq import deploy, rpc
    from raymq.actors.config import ClusterConfig
    from raymq.storage.errors import ConfigError
    assert main(["shard", "elect", "0"]) == 1  # this cluster's shards are not replicated
    one_line_error(capsys, "not replicated")
    # `raymq up --replication-factor 3` on a cluster of one node: refused, nothing made --
    # checked before anything is created (a first deploy's is tests/client/test_deploy_cli.py's)
    with pytest.raises(ConfigError, match=r"replication_factor 3 needs 3 alive Ray nodes, "
                                          r"the cluster has 1: add nodes or lower it"):
        deploy.check_deployable(ClusterConfig(replication_factor=3))
    # asked of the running (unreplicated) RayMQ: names what differs, `raymq down` first
    assert main(["up", "--replication-factor", "3"]) == 1
    err = one_line_error(capsys, "CONFIG_MISMATCH")
    assert "replication_factor: running 1, asked 3" in err and "`raymq down` first" in err
    with pytest.raises(ValueError):
        rpc.get_actor("shard-0-r1")  # (nothing was made)
    [one] = mq.admin.replicas()[0]["replicas"]  # unreplicated: a group of one, leading
    assert one["name"] == "shard-0-r0" and one["role"] == "leader"
