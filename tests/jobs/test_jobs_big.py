"""``read_committed`` over a topic larger than the object store (issue 25, item 8): a queue's
range in blocks of bounded size, read and counted whole, where one block for the whole
queue (as before) could not be stored.  A child process with its own embedded Ray
(a 2 GiB object store) and 10 million messages of 256 bytes: ~2.6 GB of bodies."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tests.helpers import ROOT

pytestmark = [pytest.mark.slow]



def test_ten_million_messages_are_read_in_a_two_gib_object_store(tmp_path):
    n = 10_000_000
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "big_topic_child.py"),
                          str(tmp_path), str(n)], cwd=ROOT, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    print(seen)
    assert seen["rows"] == seen["end"] == n
    assert seen["dataset_bytes"] > 2 * 1024 ** 3  # more than the object store holds
    assert seen["blocks"] == 10  # blocks of at most MAX_BLOCK_ROWS (1,000,000) messages
