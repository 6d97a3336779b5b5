"""How ``raymq bench soak`` measures a shard's memory growth (issue 37): the slope over the
run's second half, so a plateau reached early is no leak and a steady rise still is."""
from __future__ import annotations

from raymq.tools.soak import growth_per_m_msgs


def _series(mib_at, seconds=600, every=10, msgs_per_s=10_000):
    return [(t, mib_at(t), t * msgs_per_s) for t in range(0, seconds + 1, every)]


def test_a_plateau_reached_in_the_first_minutes_is_not_growth():
    # (the run that failed the suite: 70 -> 85 MiB in two minutes, then flat at 82-92)
    wobble = [0, 6, -3, 4, -2, 5, -3, 2, 0, -1]
    series = _series(lambda t: 70 + 15 * t / 120 if t < 120
                     else 87 + wobble[(t // 10) % len(wobble)])
    first_to_last = (series[-1][1] - series[6][1]) / (series[-1][2] - series[6][2]) * 1e6
    assert first_to_last > 1.0  # what the earlier measure read into it
    assert abs(growth_per_m_msgs(series, 600)) < 0.5


def test_a_steady_leak_still_shows_at_its_rate():
    series = _series(lambda t: 70 + 2.0 * t * 10_000 / 1e6)  # 2 MiB per million messages
    assert abs(growth_per_m_msgs(series, 600) - 2.0) < 1e-6


def test_a_leak_that_starts_late_shows_and_a_short_run_uses_its_last_samples():
    series = _series(lambda t: 80 if t < 400 else 80 + 3.0 * (t - 400) * 10_000 / 1e6)
    assert growth_per_m_msgs(series, 600) > 1.0
    short = [(0, 70.0, 0), (8, 71.0, 500_000), (10, 72.0, 1_000_000)]
    assert abs(growth_per_m_msgs(short, 10) - 2.0) < 1e-6  # (only t=10 is in the 2nd half)
    assert growth_per_m_msgs([(0, 70.0, 5), (10, 90.0, 5)], 10) == 0.0  # (no messages)
