"""The rewards a group brings to the trainer: DAPO's soft overlong penalty, and whether a group's
rewards are all equal (dynamic sampling drops those groups).

Both are pure and torch-free: the orchestrator's batcher applies them before a batch is formed
(:mod:`orchestrator.loop.batcher`), and the offline what-if replay and re-simulation apply them
to logged episodes the same way.

- :func:`soft_overlong_penalty` — DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: an
  open-source LLM reinforcement learning system at scale", eq. 13; verl's
  ``reward_model.overlong_buffer`` in ``reward_manager/dapo.py``): with ``L_max`` the most tokens a
  response may have and ``B`` the buffer, a response of ``L`` tokens gets
  ``clip(−(L − (L_max − B)) / B · factor, −factor, 0)``: 0 up to ``L_max − B`` tokens, then
  linearly down to ``−factor`` at ``L_max``. verl adds ``min(−(L − (L_max − B)) / B · factor,
  0)`` (the same wherever ``L ≤ L_max``, which a single call cannot exceed); the paper's ``−1``
  beyond ``L_max`` is the lower clip.
- :func:`rewards_equal` — whether a group's rewards carry no GRPO advantage: by default exactly
  when :func:`staleness.loss.group_advantages` gives the group advantages of 0 (the rewards as
  the trainer's float32 tensor holds them; their population std, in float64, at most
  :data:`EQUAL_ULPS` units in the last place of the largest |reward|). A group of one has equal
  rewards (its advantage is 0); verl keeps such groups, but a group of one is no GRPO group
  (``scheduler.dynamic_sampling`` needs ``scheduler.group_size ≥ 2``).

Not covered: rewards that are not finite (the episode runner refuses them before they get here).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["EQUAL_ULPS", "rewards_equal", "soft_overlong_penalty"]

EQUAL_ULPS = 8.0
"""Rewards of one group whose std is at most this many ulps of their largest magnitude count as
equal (shared with :func:`staleness.loss.group_advantages`)."""


def soft_overlong_penalty(length: int, max_length: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong penalty (≤ 0) of a response of ``length`` tokens when ``max_length``
    is the most it may have (module docstring)."""
    if buffer < 1 or max_length < 1 or length < 0 or factor <= 0:
        msg = (
            f"soft_overlong_penalty: length {length} (>= 0), max_length {max_length} (>= 1), "
            f"buffer {buffer} (>= 1) and factor {factor} (> 0) out of range"
        )
        raise ValueError(msg)
    exceed = length - (max_length - buffer)
    if exceed <= 0:
        return 0.0
    return max(-exceed / buffer * factor, -factor)


def rewards_equal(rewards: Sequence[float], tolerance: float | None = None) -> bool:
    """Whether ``rewards`` (one group's) count as equal: their population std is at most
    ``tolerance``, or, when it is None, at most :data:`EQUAL_ULPS` float32 ulps of the largest
    |reward| (the test :func:`staleness.loss.group_advantages` zeroes a group's advantages by)."""
    if not rewards:
        return True
    r = np.asarray(rewards, dtype=np.float32).astype(np.float64)
    std = float(r.std())
    if tolerance is None:
        tolerance = EQUAL_ULPS * float(np.finfo(np.float32).eps) * float(np.abs(r).max())
    return std <= tolerance
