"""Kill a writer process mid-stream and prove what was acknowledged survives."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys

import pytest

from raymq.storage import MessageStore, StoreConfig
from raymq.storage.offsets import OffsetStore
from tests.crash_writer import batch_body
from tests.helpers import ROOT



def run_until_acks(args: list[str], acks_wanted: int) -> list[list[str]]:
    """Start the writer, read ``acks_wanted`` ACK lines, SIGKILL it mid-stream."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.crash_writer", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    acks = []
    try:
        for line in proc.stdout:
            acks.append(line.split()[1:])
            if len(acks) >= acks_wanted:
                break
        else:
            raise AssertionError(f"writer ended early: {proc.stderr.read()}")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    # lines written before the kill but not read yet were acknowledged too
    acks += [line.split()[1:] for line in proc.stdout.read().splitlines() if line.startswith("ACK")]
    return acks


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_during_sync_batches_loses_no_acknowledged_record(tmp_path, seed):
    rng = random.Random(seed)
    directory = str(tmp_path / "store")
    acked: dict[int, tuple[int, int]] = {}
    for round_ in range(2):  # kill, reopen and write again, kill again
        for b, start, n in run_until_acks(["store", directory, str(seed * 10 + round_)],
                                           rng.randint(20, 120)):
            acked[(round_, int(b))] = (int(start), int(n))
    with MessageStore(directory, StoreConfig(), background=False) as store:
        end = store.max_queue_offset("crash", 0)
        msgs = store.read_queue("crash", 0, 0, end + 1)
    assert [m.queue_offset for m in msgs] == list(range(end))
    for (round_, b), (start, n) in acked.items():
        got = [m.body for m in msgs[start:start + n]]
        assert got == [batch_body(b, i, n) for i in range(n)], f"acked batch {round_}/{b} lost"
    # nothing half-visible: every visible batch is whole, in order
    i = 0
    while i < len(msgs):
        head = msgs[i].body.split(b"|")[0].decode()
        b, k, n = (int(x) for x in head[1:].split("-"))
        assert k == 0, f"batch b{b} starts in the middle at queue offset {i}"
        assert [m.body for m in msgs[i:i + n]] == [batch_body(b, j, n) for j in range(n)], \
            f"batch b{b} only partly visible"
        i += n


@pytest.mark.slow
def test_sigkill_during_offset_writes_leaves_a_whole_table(tmp_path):
    path = str(tmp_path / "offsets.json")
    for wanted in (30, 75, 5):
        acks = run_until_acks(["offsets", path], wanted)
        last = int(acks[-1][0])
        table = OffsetStore(path).snapshot()
        assert table["g"] >= last
        assert table["h"] == -table["g"]
        assert all(table[f"pad{k}"] == table["g"] for k in range(50))
    OffsetStore(path)  # opening clears the temp file a killed write may have left
    assert [n for n in os.listdir(tmp_path) if ".tmp." in n] == []
