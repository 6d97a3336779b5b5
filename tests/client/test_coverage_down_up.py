"""`raymq down` keeps the data: after `down` and `up` again the topics, the messages and
the consumer groups' committed offsets are all still there.

The command line runs in subprocesses against a Ray of the test's own (``own_ray``):
``raymq down`` there cannot touch the session's RayMQ, which every other test shares.
"""
from __future__ import annotations

import pytest

from tests.conftest import ray_env

pytestmark = pytest.mark.slow

#: Runs several `raymq` commands in one process (attaching to Ray costs seconds per
#: process): one ``### <command>`` line before the output of each.
_COMMANDS = """
import sys
from raymq.tools.cli import main
for args in {commands!r}:
    print("###", " ".join(args), flush=True)
    rc = main(list(args))
    sys.stdout.flush()
    if rc:
        sys.exit(rc)
"""


def test_down_keeps_topics_messages_and_committed_offsets(own_ray, run_raymq, tmp_path):
    cluster = own_ray()
    env = ray_env(RAY_ADDRESS=cluster.address, RAY_TMPDIR=cluster.tmp, RAY_AUTH_MODE="disabled",
                  RAYMQ_DATA_DIR=str(tmp_path / "data"))

    def raymq(*commands) -> list[str]:
        """Run the commands in one process; the output of each."""
        res = run_raymq(python=_COMMANDS.format(commands=commands), env=env, timeout_s=240)
        assert res.rc == 0, f"rc {res.rc}\n{res.out}\n{res.err[-3000:]}"
        return [part.split("\n", 1)[1] for part in res.out.split("### ")[1:]]

    def bodies(out: str) -> list[str]:  # what `raymq consume` printed, message by message
        return [line.split("\t")[-1] for line in out.strip().splitlines()]

    sent = [f"m{i}" for i in range(10)]
    up, _create, send, consumed = raymq(
        ["up", "--num-shards", "2"], ["topic", "create", "kept", "--queues", "2"],
        ["send", "kept", *sent], ["consume", "kept", "--group", "g", "--max", "4"])
    assert "controller + 2 shards" in up and send.count("SEND_OK") == 10
    first = bodies(consumed)
    assert len(first) == 4  # consumed and committed by group g

    [down] = raymq(["down"])  # a process of its own, as an operator runs it
    assert "controller" in down and "shard-0" in down and "shard-1" in down  # really stopped

    up, topics, rest, again, _down = raymq(
        ["up"], ["topic", "list"], ["consume", "kept", "--group", "g", "--max", "6"],
        ["consume", "kept", "--group", "fresh", "--max", "10"], ["down"])
    assert "controller + 2 shards" in up and "kept\t2 queues" in topics
    # the group goes on after what it had committed: the other six, none of the four again
    assert sorted(first + bodies(rest)) == sorted(sent)
    # and every message is still there for a new group
    assert sorted(bodies(again)) == sorted(sent)
