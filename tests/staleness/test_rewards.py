"""The rewards a group brings to the trainer: DAPO's soft overlong penalty (against verl's
formula) and dynamic sampling's equal-rewards test (against the group advantages)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from staleness import loss
from staleness.loss import group_advantages
from staleness.rewards import EQUAL_ULPS, rewards_equal, soft_overlong_penalty


def verl_overlong_reward(
    valid_response_length: int, max_resp_len: int, buffer_len: int, penalty_factor: float
) -> float:
    """verl 0.5 ``DAPORewardManager.__call__``'s overlong reward, as it writes it."""
    expected_len = max_resp_len - buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / buffer_len * penalty_factor, 0)


def test_soft_penalty_by_hand() -> None:
    """L_max = 20, buffer 4: nothing up to 16 tokens, then −factor/4 per token down to −factor."""
    assert [soft_overlong_penalty(n, 20, 4, 1.0) for n in (0, 15, 16)] == [0.0, 0.0, 0.0]
    assert [soft_overlong_penalty(n, 20, 4, 1.0) for n in (17, 18, 20)] == [-0.25, -0.5, -1.0]
    assert soft_overlong_penalty(18, 20, 4, 0.5) == -0.25
    assert soft_overlong_penalty(25, 20, 4, 1.0) == -1.0  # the paper's −1 beyond L_max


@given(
    max_len=st.integers(1, 4096),
    buffer=st.integers(1, 4096),
    factor=st.floats(0.01, 10.0),
    frac=st.floats(0.0, 1.0),
)
def test_soft_penalty_is_verls_within_the_max_length(
    max_len: int, buffer: int, factor: float, frac: float
) -> None:
    """Wherever a response can be (``L ≤ L_max``), the penalty is verl's, bit for bit; it never
    goes below ``−factor``."""
    length = round(frac * max_len)
    got = soft_overlong_penalty(length, max_len, buffer, factor)
    if buffer <= max_len:
        assert got == verl_overlong_reward(length, max_len, buffer, factor)
    assert -factor <= got <= 0.0


def test_soft_penalty_refuses_a_zero_buffer_or_factor() -> None:
    with pytest.raises(ValueError, match="buffer 0"):
        soft_overlong_penalty(3, 8, 0, 1.0)
    with pytest.raises(ValueError, match="factor 0"):
        soft_overlong_penalty(3, 8, 2, 0.0)


def test_the_advantage_tolerance_is_one_constant() -> None:
    assert loss._EQUAL_RTOL == EQUAL_ULPS


def test_equal_rewards_by_hand() -> None:
    assert rewards_equal([1.0, 1.0, 1.0, 1.0])
    assert rewards_equal([2.2] * 12)  # the float32 mean is an ulp off: still equal
    assert not rewards_equal([1.0, 1.0, 1.0, 0.0])
    assert rewards_equal([0.5])  # a group of one has no advantage
    assert not rewards_equal([1.0, 1.01])
    assert rewards_equal([1.0, 1.01], tolerance=0.01)  # std 0.005
    assert not rewards_equal([1.0, 1.03], tolerance=0.01)


_REWARD = st.one_of(
    st.sampled_from([0.0, 1.0, -1.0, 2.2, 0.1, 1e-3]),
    st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False, width=32),
)


@given(
    base=_REWARD,
    group=st.lists(st.one_of(st.just(None), _REWARD), min_size=2, max_size=16),
    ulps=st.lists(st.integers(-12, 12), min_size=16, max_size=16),
)
def test_dynamic_sampling_drops_exactly_the_groups_with_zero_advantages(
    base: float, group: list[float | None], ulps: list[int]
) -> None:
    """``rewards_equal`` (default tolerance) ⟺ ``group_advantages`` gives the group all zeros.
    Groups are drawn near-equal on purpose: a shared base, some members nudged by a few ulps."""
    rewards = []
    for r, k in zip(group, ulps, strict=False):
        x = base if r is None else r
        for _ in range(abs(k)):
            x = float(torch.nextafter(torch.tensor(x), torch.tensor(math.copysign(1e9, k))))
        rewards.append(x)
    adv = group_advantages(torch.tensor(rewards), len(rewards))
    assert rewards_equal(rewards) == bool((adv == 0).all()), rewards
