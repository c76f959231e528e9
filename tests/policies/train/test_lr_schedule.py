"""``trainer.lr_schedule`` and ``lr_warmup_steps``: the rate each step takes, from the version
alone; bad values refused."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from policies.train.config import TrainerConfig


def test_constant_keeps_lr_at_every_version() -> None:
    config = TrainerConfig(lr=3e-4, max_steps=4)
    assert [config.lr_at(v) for v in range(6)] == [3e-4] * 6


def test_linear_decays_from_lr_to_lr_final_over_max_steps() -> None:
    config = TrainerConfig(lr=4e-4, lr_schedule="linear", lr_final=0.0, max_steps=4)
    rates = [config.lr_at(v) for v in range(7)]
    assert rates == pytest.approx([4e-4, 3e-4, 2e-4, 1e-4, 0.0, 0.0, 0.0])


def test_cosine_is_halfway_at_the_middle_and_flat_at_both_ends() -> None:
    config = TrainerConfig(lr=5e-4, lr_schedule="cosine", lr_final=1e-4, max_steps=40)
    assert config.lr_at(0) == pytest.approx(5e-4)
    assert config.lr_at(20) == pytest.approx(3e-4)
    assert config.lr_at(40) == pytest.approx(1e-4)
    assert config.lr_at(1) == pytest.approx(1e-4 + 4e-4 * (1 + math.cos(math.pi / 40)) / 2)
    rates = [config.lr_at(v) for v in range(41)]
    assert rates == sorted(rates, reverse=True)


@given(
    schedule=st.sampled_from(["linear", "cosine"]),
    lr=st.floats(1e-7, 1.0),
    final_share=st.floats(0.0, 1.0),
    max_steps=st.integers(1, 500),
)
def test_a_decay_starts_at_lr_never_rises_and_ends_at_lr_final(
    schedule: str, lr: float, final_share: float, max_steps: int
) -> None:
    config = TrainerConfig(
        lr=lr,
        lr_schedule=schedule,  # type: ignore[arg-type]
        lr_final=lr * final_share,
        max_steps=max_steps,
    )
    rates = [config.lr_at(v) for v in range(max_steps + 3)]
    assert rates[0] == pytest.approx(lr)
    assert rates[max_steps:] == [pytest.approx(config.lr_final)] * 3
    assert all(b <= a * (1 + 1e-12) for a, b in itertools.pairwise(rates))
    assert all(config.lr_final * (1 - 1e-12) <= r <= lr * (1 + 1e-12) for r in rates)


def test_warmup_ramps_to_lr_then_the_decay_runs_over_the_steps_left() -> None:
    config = TrainerConfig(
        lr=4e-4, lr_schedule="linear", lr_warmup_steps=4, lr_final=0.0, max_steps=8
    )
    rates = [config.lr_at(v) for v in range(10)]
    ramp = [1e-4, 2e-4, 3e-4, 4e-4]
    assert rates == pytest.approx([*ramp, 4e-4, 3e-4, 2e-4, 1e-4, 0.0, 0.0])
    constant = TrainerConfig(lr=4e-4, lr_warmup_steps=4, max_steps=8)
    assert [constant.lr_at(v) for v in range(10)] == pytest.approx(ramp + [4e-4] * 6)


@given(
    schedule=st.sampled_from(["constant", "linear", "cosine"]),
    warmup=st.integers(1, 50),
    extra=st.integers(1, 200),
)
def test_a_warmup_rises_to_lr_and_never_exceeds_it(schedule: str, warmup: int, extra: int) -> None:
    config = TrainerConfig(
        lr=1e-3,
        lr_schedule=schedule,  # type: ignore[arg-type]
        lr_warmup_steps=warmup,
        max_steps=warmup + extra,
    )
    ramp = [config.lr_at(v) for v in range(warmup + 1)]
    assert all(a < b for a, b in itertools.pairwise(ramp[:-1]))
    assert ramp[0] > 0
    assert ramp[warmup - 1] == ramp[warmup] == pytest.approx(1e-3)
    assert all(0 <= config.lr_at(v) <= 1e-3 * (1 + 1e-12) for v in range(warmup + extra + 3))


def test_a_warmup_as_long_as_the_run_is_refused() -> None:
    with pytest.raises(ValidationError, match="lr_warmup_steps 8 is not below max_steps 8"):
        TrainerConfig(lr_warmup_steps=8, max_steps=8)


def test_lr_final_above_lr_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"lr_final 0\.001 is above lr 0\.0005"):
        TrainerConfig(lr=5e-4, lr_schedule="linear", lr_final=1e-3)


def test_lr_final_without_a_decaying_schedule_is_refused() -> None:
    with pytest.raises(ValidationError, match="lr_final applies to a decaying lr_schedule"):
        TrainerConfig(lr=5e-4, lr_final=1e-4)


def test_an_unknown_schedule_is_refused() -> None:
    with pytest.raises(ValidationError, match="lr_schedule"):
        TrainerConfig(lr_schedule="step")  # type: ignore[arg-type]
