"""A verifiers rubric as sprawl's rewards: reward components by name, and their errors.

:func:`rubric_weights` reads the weight of every reward function of a rubric (nested rubrics
included) and refuses what sprawl cannot score per episode: group-level reward functions,
rubrics that compute advantages, and two reward functions of one name with different weights.
:func:`watch_rewards` wraps each reward function so that an exception it raises is recorded
in :func:`reward_errors` (verifiers itself would log it and score 0) and still raised to
verifiers, unchanged.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from environments.errors import EnvironmentLoadError

_reward_errors: ContextVar[list[str] | None] = ContextVar("_reward_errors", default=None)


@contextmanager
def reward_errors() -> Iterator[list[str]]:
    """The errors the watched reward functions raise in this context while it is open, each as
    ``'name' raised Type: message``."""
    errors: list[str] = []
    token = _reward_errors.set(errors)
    try:
        yield errors
    finally:
        _reward_errors.reset(token)


def _rubrics(rubric: Any) -> list[Any]:
    return (
        [r for inner in rubric.rubrics for r in _rubrics(inner)]
        if hasattr(rubric, "rubrics")
        else [rubric]
    )


def rubric_weights(rubric: Any, where: str) -> dict[str, float]:
    """Name → weight of every reward function; ``where`` (``key.id: 'env'``) starts errors."""
    if rubric.has_group_rewards or rubric.has_advantages:
        raise EnvironmentLoadError(
            f"{where} has group-level reward functions or advantages; "
            "sprawl scores each episode on its own (GRPO groups are the scheduler's)"
        )
    weights: dict[str, float] = {}
    for r in _rubrics(rubric):
        for func, w in zip(r.funcs, r.weights, strict=True):
            name = getattr(func, "__name__", repr(func))
            if weights.get(name, w) != w:
                raise EnvironmentLoadError(
                    f"{where} has two reward functions named {name!r} with "
                    "different weights; sprawl records reward components by name"
                )
            weights[name] = float(w)
    return weights


def watch_rewards(rubric: Any) -> None:
    """Wrap each reward function so an exception is recorded (verifiers logs it, scores 0)."""
    for r in _rubrics(rubric):
        r.funcs = [_watched(f) for f in r.funcs]


def _watched(fn: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(fn, "__sprawl_watched__", False):
        return fn

    @functools.wraps(fn)
    async def watched(*args: Any, **kwargs: Any) -> Any:
        try:
            value = fn(*args, **kwargs)
            return await value if inspect.isawaitable(value) else value
        except Exception as exc:
            errors = _reward_errors.get()
            if errors is not None:
                name = getattr(fn, "__name__", repr(fn))
                errors.append(f"{name!r} raised {type(exc).__name__}: {exc}")
            raise

    watched.__sprawl_watched__ = True  # type: ignore[attr-defined]
    return watched
