"""Every benchmark suite of ``raymq bench``, registered: the built-in ones (``bench``),
``soak``, ``replication`` (``failover``), ``console`` (``bench_console``),
``retention`` (``bench_retention``) and ``kafka`` (``bench_kafka``).  The suites
import the bench's framework (``raymq.tools.bench``); only this module imports them, so
nothing imports back.
"""
from __future__ import annotations

from raymq.tools.bench import LONG_SUITES, SUITES, run
# (in the order ``raymq bench`` runs them)
from raymq.tools import soak  # noqa: E402,F401,I001 -- registers the soak suite
from raymq.tools import failover  # noqa: E402,F401 -- registers the replication suite
from raymq.tools import bench_console  # noqa: E402,F401 -- registers the console suite
from raymq.tools import bench_retention  # noqa: E402,F401 -- registers the retention suite
from raymq.tools import bench_kafka  # noqa: E402,F401 -- registers the kafka suite

__all__ = ["LONG_SUITES", "SUITES", "run"]
