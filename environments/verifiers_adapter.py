"""Run ``verifiers`` environments unchanged (``environment.kind = "verifiers"``).

An environment written for verifiers 0.4 (``import verifiers.v1 as vf``: a ``vf.Taskset`` of
``vf.Task``\\ s, the ``vf.Env`` that plays it with its agents and harnesses) is loaded the way
verifiers' own tools load it: ``id`` is the taskset's id (an installed package's module, or
``owner/name`` for the module ``name``), ``args`` is the environment's ``[env]`` table
(``EnvConfig``: ``agent.harness``, ``agent.runtime``, ``taskset`` knobs, ``timeout``, ...).
Supported: verifiers 0.4 (0.4.0 up to 0.5); ``pip install 'sprawl[verifiers]'`` installs the
pinned 0.4.0. The classic API of 0.3 is gone from 0.4's package root and is not run.

:class:`VerifiersEnvironment` holds the loaded ``vf.Env`` and its tasks; the runner
(:mod:`orchestrator.loop.verifiers_episode`) plays an episode with ``Env.run_episode`` and
keeps what it produced on the episode's state (:data:`OUTCOME_KEY`, an
:class:`~environments.verifiers_trace.Outcome`). Guarantees:

- tasks: the taskset's tasks, read once at load; ``tasks()`` has an ``id`` per task (its
  ``data.id``, else its position) and its ``index`` into :meth:`VerifiersEnvironment.task`;
- rewards: each ``@vf.reward``'s score is a reward component, with the reward's own weight;
  a reward function that raised is a :class:`~environments.errors.RewardError` carrying
  verifiers' message (verifiers records it on the trace);
- a load failure (verifiers missing or of another release, an unknown taskset or harness, a bad
  ``args`` key, a taskset that never ends) is an :class:`EnvironmentLoadError` naming the key.

Not covered: infinite tasksets, multimodal prompts, and episodes with more than one trainable
agent (sprawl trains one token sequence per episode).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

import structlog

from environments.base import Environment
from environments.errors import EnvironmentLoadError, RewardError
from environments.types import EnvConfig, EpisodeState
from environments.verifiers_trace import Outcome

if TYPE_CHECKING:
    from datasets import Dataset

log = structlog.get_logger(__name__)
SUPPORTED = ((0, 4), (0, 5))
"""The verifiers releases this adapter runs: from 0.4 (included) to 0.5 (excluded)."""
OUTCOME_KEY = "verifiers_outcome"
"""The :attr:`EpisodeState.data` key of the episode's :class:`Outcome`."""


class VerifiersEnvironment(Environment):
    """A loaded verifiers 0.4 environment behind sprawl's :class:`Environment` interface: its
    tasks, and the rewards, messages and facts of the episodes the runner played."""

    name = "verifiers"

    def __init__(
        self, env: Any, env_id: str, tasks: list[Any], renderer: Any, *, key: str = "environment"
    ) -> None:
        super().__init__(EnvConfig())
        self.vf = env
        self.env_id = env_id
        self.key = key
        self.renderer = renderer
        """The ``renderers.RendererConfig`` the train client renders prompts with (None: auto)."""
        self._vf_tasks = tasks
        self._weights: dict[str, float] = {}

    def tasks(self) -> Dataset:
        if self._tasks is None:
            from datasets import Dataset

            ids = [
                str(t.data.id if t.data.id is not None else i) for i, t in enumerate(self._vf_tasks)
            ]
            if len(set(ids)) != len(ids):
                raise EnvironmentLoadError(f"{self.key}.id: {self.env_id!r} has duplicate task ids")
            self._tasks = Dataset.from_dict({"id": ids, "index": list(range(len(ids)))})
            log.info("env.tasks_loaded", env=self.env_id, source="verifiers", tasks=len(ids))
        return self._tasks

    def task(self, row: dict[str, Any]) -> Any:
        """The ``vf.Task`` of a row of :meth:`tasks`."""
        return self._vf_tasks[int(row["index"])]

    def tool_schemas(self) -> list[dict[str, Any]]:
        """None of sprawl's: the environment's agents render their own tools."""
        return []

    async def score(self, state: EpisodeState) -> dict[str, float]:
        """The trace's reward scores by name (a reward function's failure is raised)."""
        outcome: Outcome | None = state.data.get(OUTCOME_KEY)
        if outcome is None:
            return {}
        failed = outcome.reward_failed
        if failed is not None:
            raise RewardError(failed)
        self._weights.update(outcome.weights())
        return outcome.rewards()

    def total_reward(self, components: dict[str, float]) -> float:
        """The weighted sum of the components, verifiers' ``Trace.reward``."""
        return sum(v * self._weights.get(n, 1.0) for n, v in components.items())

    def reward_weights(self) -> dict[str, float]:
        return dict(self._weights)

    def metadata(self, state: EpisodeState) -> dict[str, Any]:
        outcome: Outcome | None = state.data.get(OUTCOME_KEY)
        return outcome.metadata() if outcome is not None else {}


def _check_release(key: str) -> None:
    try:
        installed = version("verifiers")
    except PackageNotFoundError:
        raise EnvironmentLoadError(
            f"{key}.kind: 'verifiers' needs the verifiers package: pip install 'sprawl[verifiers]'"
        ) from None
    release = tuple(int(p) for p in installed.split(".")[:2] if p.isdigit())
    if not SUPPORTED[0] <= release < SUPPORTED[1]:
        raise EnvironmentLoadError(
            f"{key}.kind: verifiers {installed} is installed; sprawl runs 0.4 (verifiers.v1): "
            "pip install 'sprawl[verifiers]'"
        )


def _renderer(renderer: dict[str, Any] | None, key: str) -> Any:
    if renderer is None:
        return None
    from pydantic import TypeAdapter, ValidationError
    from renderers import RendererConfig

    try:
        return TypeAdapter(RendererConfig).validate_python(renderer)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise EnvironmentLoadError(f"{key}.renderer.{where}: {err['msg']}") from None


def load_verifiers_environment(
    taskset_id: str,
    args: dict[str, Any],
    *,
    renderer: dict[str, Any] | None = None,
    key: str = "environment",
) -> VerifiersEnvironment:
    """Load the verifiers 0.4 environment of the taskset ``taskset_id`` with ``args`` as its
    ``[env]`` table (module docstring); ``renderer`` is the train client's renderer config.
    Errors name the config table ``key``."""
    _check_release(key)
    from pydantic import ValidationError
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    data = dict(args)
    taskset = dict(data.get("taskset") or {})
    if taskset.setdefault("id", taskset_id) != taskset_id:
        raise EnvironmentLoadError(f"{key}.args.taskset.id: the taskset is {key}.id")
    data["taskset"] = taskset
    try:
        config = resolve_env_config(data)
    except ModuleNotFoundError as exc:
        raise EnvironmentLoadError(f"{key}.id: {exc}") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise EnvironmentLoadError(f"{key}.args.{where}: {err['msg']}") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise EnvironmentLoadError(f"{key}.id: {taskset_id!r}: {exc}") from None
    try:
        env = load_environment(config)
        if not env.taskset.bounded:
            raise ValueError("its taskset never ends; sprawl reads every task at start")
        tasks = list(env.taskset)
    except Exception as exc:  # user code at the boundary: one error type, naming the key
        raise EnvironmentLoadError(
            f"{key}.id: {taskset_id!r} could not start: {type(exc).__name__}: {exc}"
        ) from exc
    if not tasks:
        raise EnvironmentLoadError(f"{key}.id: {taskset_id!r} has no tasks")
    return VerifiersEnvironment(env, taskset_id, tasks, _renderer(renderer, key), key=key)
