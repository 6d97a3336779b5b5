"""The main job end to end, as a user runs it (its own embedded cluster, in a child process)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tests.helpers import ROOT



@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One run of ``raymq demo`` with Spark (a minute and more), as a user types it: its
    report is checked by one test, its output's cleanliness by another."""
    tmp_path = tmp_path_factory.mktemp("demo")
    proc = subprocess.run([sys.executable, "-m", "raymq.tools.cli", "demo", "--orders", "40",
                           "--data-dir", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    return proc, tmp_path


@pytest.mark.slow
@pytest.mark.spark
def test_raymq_demo_reports_consistent(demo_run):
    proc, _tmp_path = demo_run
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "was KILLED after committing" in out
    assert _verdict(out) == "CONSISTENT" and "FAIL" not in out
    # the order-income Spark job agrees with the order database, minute by minute
    assert "OK   income per minute from Spark = the order database's own totals" in out
    # every failure the demo injects did happen, and check-backs settled what they must
    happened = _what_happened(out)
    assert happened["producer killed after its DB commit"] == 1
    assert happened["end_transaction lost"] >= 3
    assert happened["unknown (local transaction error)"] >= 3
    assert happened["rolled back (insufficient funds)"] >= 1
    assert happened["consumer failures retried"] >= 1
    assert happened["check-backs answered"] >= (happened["end_transaction lost"]
                                                 + happened["unknown (local transaction error)"] + 1)
    assert happened["rollback"] >= happened["unknown (local transaction error)"]


@pytest.mark.slow
def test_raymq_demo_catches_a_sabotaged_check_back(tmp_path):
    """The report is not vacuous: a check-back that answers COMMIT without looking at the
    database credits points for orders that were never paid, and the demo says so."""
    proc = subprocess.run([sys.executable, "-m", "raymq.tools.cli", "demo", "--orders", "24",
                           "--sabotage", "check-always-commits", "--no-spark",
                           "--data-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:] + proc.stderr[-3000:]
    assert _verdict(out) == "INCONSISTENT"
    assert "FAIL no points for a rolled-back order" in out
    assert "FAIL orders paid = orders credited with points" in out


#: what the demo's own lines start with (everything else on its output is chatter)
DEMO_LINES = ("[demo ", "consistency report", "  OK   ", "  FAIL ", "CONSISTENT",
              "INCONSISTENT", "To look at what just happened", "  raymq --config ")


@pytest.mark.slow
@pytest.mark.spark
def test_raymq_demo_prints_its_own_lines_only_and_the_console_command(demo_run):
    """No Spark, log4j or Ray start-up chatter, no WARN or ERROR line when nothing went
    wrong; progress lines carry the time elapsed; the last line is the console command
    over the demo's data."""
    proc, tmp_path = demo_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.strip()]
    assert [x for x in lines if not x.startswith(DEMO_LINES)] == []
    assert proc.stderr.strip() == ""
    noisy = [x for x in (proc.stdout + proc.stderr).splitlines()
             if " WARN " in x or "WARNING" in x or "ERROR" in x]
    assert noisy == []
    assert lines[-1] == f"  raymq --config {tmp_path / 'cluster.json'} console --embedded"
    assert any(x.startswith("[demo ") and "s] order-income job: Spark is up" in x for x in lines)


@pytest.mark.slow
def test_a_verbose_demo_shows_raymqs_own_warnings_too(tmp_path):
    """--verbose hides nothing: the order service's warning about the local transaction
    the demo makes fail is shown (a quiet demo narrates it instead)."""
    proc = subprocess.run([sys.executable, "-m", "raymq.tools.cli", "demo", "--orders", "12",
                           "--no-spark", "--verbose", "--data-dir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "execute_local_transaction of" in proc.stderr and "disk I/O error" in proc.stderr


def _verdict(out: str) -> str:
    [verdict] = [x for x in out.splitlines() if x in ("CONSISTENT", "INCONSISTENT")]
    return verdict


def test_raymq_demo_refuses_too_few_orders(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "raymq.tools.cli", "demo", "--orders", "3",
                           "--data-dir", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--orders must be at least" in proc.stderr


def _what_happened(out: str) -> dict[str, int]:
    """The demo's 'what happened' line as {label: count}."""
    import re
    [line] = [x for x in out.splitlines() if "what happened:" in x]
    counts = {re.sub(r"\s*\(\d.*\)", "", label).strip(): int(n) for n, label in re.findall(r"(\d+) ([^;,(]+(?:\([^)]*\))?)",
                                                               line.split("what happened:")[1])}
    counts.update({k: int(v) for v, k in re.findall(r"(\d+) (commit|rollback)\b", line)})
    return counts


def test_storage_demo_reports_consistent(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "raymq.tools.cli", "demo", "--storage",
                           "--data-dir", str(tmp_path / "d")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "0 batches lost -> CONSISTENT" in proc.stdout
