"""A seeded random search of replication schedules (``raymq.tools.nemesis.search``):
pauses, kills, restarts with or without the disk, controller restarts with or without
its files, delayed and duplicated fetch replies -- checked after every step."""
from __future__ import annotations

import pytest

from raymq.tools.nemesis import search


@pytest.mark.parametrize("seed", range(6))
def test_random_schedules_lose_nothing_acknowledged(seed, tmp_path):
    result = search(seed, 400, str(tmp_path))
    assert result.acked > 0 and sum(result.faults.values()) > 0
