"""The rose / fell / within-noise judgement the run summary and the lag experiment print."""

from __future__ import annotations

import math

import pytest

from orchestrator.observe.trend import compare, halves, mean_se, quarters


def test_mean_and_standard_error() -> None:
    mean, se = mean_se([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert se == pytest.approx(math.sqrt((2.25 + 0.25 + 0.25 + 2.25) / 3 / 4))
    assert mean_se([0.7]) == (0.7, 0.0)


def test_a_rise_beyond_two_sigma_is_a_rise_and_noise_is_not() -> None:
    rising = compare([0.40, 0.42, 0.38, 0.41], [0.60, 0.62, 0.58, 0.61])
    assert rising.judged == "rose"
    assert rising.delta == pytest.approx(0.20)
    assert "rose, Δ=+0.200" in rising.render()
    assert compare([0.6, 0.62], [0.4, 0.41]).judged == "fell"
    noisy = compare([0.2, 0.8, 0.3, 0.7], [0.3, 0.9, 0.2, 0.8])  # Δ 0.05, SE ≈ 0.15 each
    assert noisy.judged == "within noise"
    assert abs(noisy.delta) <= noisy.noise


def test_windows_too_short_to_have_noise_are_not_judged() -> None:
    c = quarters([0.1, 0.2, 0.3, 0.9])  # one step per quarter: no standard error
    assert c.too_short
    assert c.judged is None
    assert "too few steps to judge" in c.render()


def test_quarters_and_halves_take_the_right_steps() -> None:
    values = [float(i) for i in range(10)]
    q = quarters(values)  # 2 steps per quarter; steps 3..8 (1-based) left out
    assert (q.before, q.after) == (0.5, 8.5)
    h = halves(values)
    assert (h.before, h.after) == (2.0, 7.0)
