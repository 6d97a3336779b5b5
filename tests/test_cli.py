"""The command line against the session cluster (Ray already initialised here)."""
from __future__ import annotations

import pytest

from cluster.cli import main

pytestmark = pytest.mark.ray


def test_topic_send_consume_status_msg(mq, name, capsys):
    assert main(["topic", "create", name, "--queues", "2"]) == 0
    assert f"topic {name}: 2 queues" in capsys.readouterr().out
    assert main(["topic", "list"]) == 0
    assert name in capsys.readouterr().out
    assert main(["send", name, "hello", "world", "--key", "k1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("SEND_OK") for line in lines)
    msg_id = lines[0].split("\t")[1]
    assert main(["consume", name, "--group", f"g{name}", "--max", "2", "--timeout", "20"]) == 0
    out = capsys.readouterr().out
    assert "hello" in out and "world" in out
    assert main(["msg", "show", msg_id]) == 0
    assert '"body": "hello"' in capsys.readouterr().out
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "shards: 2" in out and name in out and f"g{name}" in out


def test_cli_errors_are_clear(mq, name, capsys):
    assert main(["send", f"{name}-nope", "x"]) == 1
    assert "TOPIC_NOT_EXIST" in capsys.readouterr().err
    assert main(["msg", "show", "zz"]) == 1
    assert "not a RayMQ message id" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["topic"])  # an action is required
