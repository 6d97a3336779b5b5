"""A seeded random search of replication schedules (``raymq.tools.nemesis.search``):
pauses, kills, restarts with or without the disk, controller restarts with or without
its files, delayed and duplicated fetch replies -- checked after every step."""
from __future__ import annotations

import pytest

from raymq.tools.nemesis import search


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 30])  # 30: a wiped leader led again
def test_random_schedules_lose_nothing_acknowledged(seed, tmp_path):
    result = search(seed, 400, str(tmp_path))
    assert result.acked > 0 and sum(result.faults.values()) > 0
