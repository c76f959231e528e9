"""Run ``verifiers`` environments unchanged (``environment.kind = "verifiers"``).

A ``verifiers`` environment (``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``,
``StatefulToolEnv``, …, built by its module's ``load_environment(**args)``) keeps its own rollout
loop; :class:`VerifiersEnvironment` runs that loop with a model client of sprawl's and maps the
outcome onto an episode. Supported: the classic API of ``verifiers`` 0.3.1 up to 0.4 (0.4 keeps
only ``verifiers.v1``); ``pip install 'sprawl[verifiers]'`` installs the pinned 0.3.1.

Guarantees:

- the environment's model client is an OpenAI-compatible async client
  (:class:`~environments.verifiers_client.PolicyClient`, ``client.chat.completions.create(...)``,
  wrapped in verifiers' own ``OpenAIChatCompletionsClient``); each call hands the runner only
  the messages the environment added since the model's last turn
  (:data:`~environments.verifiers_client.ModelCall`), so the runner extends the token sequence
  token-exactly and never re-tokenizes the history. When the environment sends a history that
  differs from what the model wrote or saw, the tokens stay what the model saw and
  :attr:`~environments.verifiers_client.PolicyClient.rewritten` records it (the episode's
  ``history_rewritten``);
- dataset → tasks: ``env.get_dataset()``, a ``datasets.Dataset``, with an ``id`` column added
  from ``example_id`` when it has none; rubric → rewards: the rubric's metrics are the reward
  components and the rubric's reward is their weighted sum (:meth:`VerifiersEnvironment.score`);
- failures are data: an exception from the environment's code propagates unchanged (the runner
  records it, ``stop_reason = "env_error"``); an error verifiers caught in the rollout
  (``state["error"]``) is raised as :class:`VerifiersRolloutError` naming its verifiers type;
  a reward function that raises is a :class:`~environments.errors.RewardError` naming it
  (verifiers itself would log it and score 0); a malformed tool-call block is recorded as a
  ``malformed_call`` tool call with its error and counted in ``state.bad_calls`` (the
  environment sees the message without it, as from an OpenAI server);
- a model-call failure of sprawl's (an endpoint error, the turn or context limit) reaches the
  runner as itself, not as the ``ModelError`` verifiers wraps it in;
- state → episode metadata: the rest of the rollout's state (:meth:`VerifiersEnvironment.metadata`).

The client is :mod:`environments.verifiers_client`, the rubric's weights and reward errors
:mod:`environments.verifiers_rubric`.

Not covered: group-level reward functions and rubrics that compute advantages (refused when the
environment loads), per-call sampling arguments (sampling is the run's ``[sampling]``), tool
lists that change within an episode, verifiers' server mode, and the trio backend (verifiers
runs on asyncio).
"""

from __future__ import annotations

import importlib
import inspect
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any, Literal

import structlog

from environments.base import Environment
from environments.errors import EnvError, EnvironmentLoadError, RewardError
from environments.types import EnvConfig, EpisodeState
from environments.verifiers_client import (
    MODEL_NAME,
    STATE_KEY,
    ModelCall,
    PolicyClient,
    verifiers_client,
)
from environments.verifiers_rubric import reward_errors, rubric_weights, watch_rewards

if TYPE_CHECKING:
    from datasets import Dataset

log = structlog.get_logger(__name__)
SUPPORTED = ((0, 3, 1), (0, 4))
"""The verifiers versions this adapter runs: from 0.3.1 (included) to 0.4 (excluded)."""
RECORDED_ELSEWHERE = frozenset(
    {
        "input", "task", "prompt", "completion", "responses", "trajectory", "final_env_response",
        "tool_defs", "metrics", "reward", "advantage", "error", "client", "model",
        "sampling_args", "usage_tracker",
    }
)  # fmt: skip
"""Keys of a verifiers state that are not ``Episode.metadata``: the episode records them as its
messages, segments, rewards and error, or they are the rollout's machinery (client, model)."""
StopKind = Literal["done", "max_turns", "context", "episode_timeout"]
# verifiers' stop conditions that are not the environment's own decision
_STOPS: dict[str, StopKind] = {
    "max_turns_reached": "max_turns",
    "prompt_too_long": "context",
    "timeout_reached": "episode_timeout",
}


class VerifiersRolloutError(EnvError):
    """An error verifiers caught in a rollout (``state["error"]``): its type and message."""


class VerifiersEnvironment(Environment):
    """A loaded verifiers environment behind sprawl's :class:`Environment` interface: its tasks,
    its tool schemas, its rollout (:meth:`rollout`) and its rubric (:meth:`score`)."""

    name = "verifiers"

    def __init__(self, env: Any, env_id: str, *, key: str = "environment") -> None:
        super().__init__(EnvConfig())
        import verifiers

        self.vf = env
        self.env_id = env_id
        self.key = key
        self.single_turn = isinstance(env, verifiers.SingleTurnEnv)
        self._weights = rubric_weights(env.rubric, f"{key}.id: {env_id!r}")
        watch_rewards(env.rubric)

    def tasks(self) -> Dataset:
        if self._tasks is None:
            try:
                tasks = self.vf.get_dataset()
            except ValueError as exc:
                raise EnvironmentLoadError(
                    f"{self.key}.id: {self.env_id!r} has no training dataset: {exc}"
                ) from None
            if "id" not in tasks.column_names:
                tasks = tasks.add_column("id", [str(i) for i in tasks["example_id"]])
            self._tasks = tasks
            log.info("env.tasks_loaded", env=self.env_id, source="verifiers", tasks=len(tasks))
        return self._tasks

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI ``tools`` entries of the environment's ``tool_defs``."""
        return [
            {"type": "function", "function": t.model_dump(exclude_none=True)}
            for t in self.vf.tool_defs or []
        ]

    async def rollout(self, state: EpisodeState, model: ModelCall) -> tuple[StopKind, bool]:
        """Run the environment's own rollout of ``state.task``; the stop reason and whether the
        environment rewrote the history (module docstring for the errors raised)."""
        client = PolicyClient(state, model)
        vf_client = verifiers_client(client)
        try:
            vf_state = await self.vf.rollout(dict(state.task), vf_client, MODEL_NAME, None)
        except Exception:
            if client.failure is not None:
                raise client.failure from None
            raise
        state.data[STATE_KEY] = vf_state
        # the final environment response (verifiers' final_env_response) joins the history
        final, _ = await vf_client.to_native_prompt(
            [*vf_state["prompt"], *(vf_state["completion"] or [])]
        )
        client.absorb(final)
        if client.failure is not None:  # verifiers recorded it as a ModelError and stopped
            raise client.failure
        error = vf_state.get("error")
        if error is not None:
            raise VerifiersRolloutError(_describe(error))
        stop = _STOPS.get(str(vf_state.get("stop_condition")), "done")
        if stop == "max_turns" and self.single_turn:  # one turn is how it ends
            stop = "done"
        return stop, client.rewritten

    async def score(self, state: EpisodeState) -> dict[str, float]:
        """The rubric's metrics of the finished rollout (its reward functions' values)."""
        vf_state = state.data.get(STATE_KEY)
        if vf_state is None:
            raise RewardError("the rollout ended before verifiers started it; nothing to score")
        if vf_state.get("completion") is None:  # cut short (timeouts.episode_s): render it
            await self.vf.render_completion(vf_state)
        try:
            with reward_errors() as errors:
                await self.vf.rubric.score_rollout(vf_state)
        finally:
            await self.vf.rubric.cleanup(vf_state)
        if errors:
            raise RewardError(errors[0])
        return {k: float(v) for k, v in vf_state["metrics"].items()}

    def total_reward(self, components: dict[str, float]) -> float:
        """The rubric's weighted sum of ``components``."""
        return sum(components[n] * w for n, w in self._weights.items() if n in components)

    def metadata(self, state: EpisodeState) -> dict[str, Any]:
        """The verifiers state of the rollout, less what the episode records otherwise
        (:data:`RECORDED_ELSEWHERE`): the task's ``answer``, ``info`` and ``example_id``,
        ``stop_condition``, ``timing``, ``usage`` and every key the environment set itself."""
        vf_state = state.data.get(STATE_KEY)
        if vf_state is None:
            return {}
        out = {k: v for k, v in dict(vf_state).items() if k not in RECORDED_ELSEWHERE}
        task = vf_state.get("input") or {}
        out.update({k: task[k] for k in ("answer", "info", "example_id") if k in task})
        return out

    def reward_weights(self) -> dict[str, float]:
        return dict(self._weights)


def _describe(error: BaseException) -> str:
    """``Type: message`` of a verifiers error, its cause's when verifiers wrapped one."""
    cause = error.__cause__
    inner = f": {type(cause).__name__}: {cause}" if cause is not None else ""
    return f"{type(error).__name__}{': ' + str(error) if str(error) else ''}{inner}"


def load_verifiers_environment(
    env_id: str, args: dict[str, Any], *, key: str = "environment"
) -> VerifiersEnvironment:
    """Import the verifiers environment ``env_id`` (a module, or ``owner/name`` whose module is
    ``name`` with ``-`` as ``_``) and build it with ``load_environment(**args)``; errors name
    the config table ``key``."""
    try:
        installed = version("verifiers")
    except PackageNotFoundError:
        raise EnvironmentLoadError(
            f"{key}.kind: 'verifiers' needs the verifiers package: pip install 'sprawl[verifiers]'"
        ) from None
    release = tuple(int(p) for p in installed.split(".")[:3] if p.isdigit())
    if not SUPPORTED[0] <= release < SUPPORTED[1]:
        raise EnvironmentLoadError(
            f"{key}.kind: verifiers {installed} is installed; sprawl runs 0.3.1 up to 0.4 "
            "(the classic API): pip install 'sprawl[verifiers]'"
        )
    module_name = env_id.replace("-", "_").split("/")[-1]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvironmentLoadError(f"{key}.id: cannot import {module_name!r}: {exc}") from exc
    load = getattr(module, "load_environment", None)
    if not callable(load):
        raise EnvironmentLoadError(f"{key}.id: {module_name!r} has no load_environment()")
    try:
        inspect.signature(load).bind(**args)
    except TypeError as exc:
        raise EnvironmentLoadError(f"{key}.args: load_environment() of {env_id!r}: {exc}") from None
    try:
        env = load(**args)
    except Exception as exc:  # user code at the boundary: one error type, naming the key
        raise EnvironmentLoadError(
            f"{key}.id: {env_id!r} could not start: {type(exc).__name__}: {exc}"
        ) from exc
    import verifiers

    if not isinstance(env, verifiers.Environment):
        raise EnvironmentLoadError(
            f"{key}.id: load_environment() of {env_id!r} returned {type(env).__name__}, "
            "not a verifiers Environment"
        )
    return VerifiersEnvironment(env, env_id, key=key)
