"""Environment mixtures: which environment the scheduler's next new group comes from.

:func:`weighted_picks` is smooth weighted round-robin (nginx's): each pick adds every
environment's weight to its credit, picks the largest credit (ties: the earliest environment) and
takes the total weight off the winner's credit. It is deterministic, so a resumed run that knows
how many new groups were admitted replays it exactly (:func:`picks_so_far`), and after any
number ``n`` of picks each environment ``i`` holds between ``n·w_i/W − (k−1)`` and
``n·w_i/W + 1`` of them (``W`` the total weight, ``k`` the number of environments): the admitted
counts track the weights at every prefix, not only on average. Re-runs of dropped groups
(``staleness.length_bias.requeue``) take no pick: they keep their group's environment.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from datasets import Dataset

    from orchestrator.loop.episode import EpisodeRunner


@dataclass(frozen=True)
class Source:
    """One environment of a run: its name (``Episode.environment``), the runner of its
    episodes, its tasks and its share of admissions."""

    name: str
    runner: EpisodeRunner
    tasks: Dataset
    weight: float = 1.0


def weighted_picks(weights: Sequence[float]) -> Iterator[int]:
    """Indices into ``weights``, forever, by smooth weighted round-robin (module docstring)."""
    if not weights or any(w <= 0 for w in weights):
        raise ValueError(f"weights must be positive and non-empty, got {list(weights)}")
    total = sum(weights)
    credit = [0.0] * len(weights)
    while True:
        for i, w in enumerate(weights):
            credit[i] += w
        best = max(range(len(weights)), key=lambda i: (credit[i], -i))
        credit[best] -= total
        yield best


def picks_so_far(weights: Sequence[float], n: int) -> list[int]:
    """How many of the first ``n`` picks went to each environment."""
    counts = [0] * len(weights)
    for i in itertools.islice(weighted_picks(weights), n):
        counts[i] += 1
    return counts
