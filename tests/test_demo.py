"""The main job end to end, as a user runs it (its own embedded cluster, in a child process)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_raymq_demo_reports_consistent(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "demo", "--orders", "40",
                           "--data-dir", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "was KILLED after committing" in out
    assert "CONSISTENT" in out and "FAIL" not in out


def test_storage_demo_reports_consistent(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "demo", "--storage",
                           "--data-dir", str(tmp_path / "d")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "0 batches lost -> CONSISTENT" in proc.stdout
