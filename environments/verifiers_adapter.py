"""Run ``verifiers`` environments unchanged (``environment.kind = "verifiers"``).

A ``verifiers`` environment (``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``,
``StatefulToolEnv``, …, built by its module's ``load_environment(**args)``) keeps its own rollout
loop; :class:`VerifiersEnvironment` runs that loop with a model client of sprawl's and maps the
outcome onto an episode. Supported: the classic API of ``verifiers`` 0.3.1 up to 0.4 (0.4 keeps
only ``verifiers.v1``); ``pip install 'sprawl[verifiers]'`` installs the pinned 0.3.1.

Guarantees:

- the environment's model client is an OpenAI-compatible async client
  (:class:`PolicyClient`, ``client.chat.completions.create(...)``, wrapped in verifiers' own
  ``OpenAIChatCompletionsClient``); each call hands the runner only the messages the
  environment added since the model's last turn (:class:`ModelCall`), so the runner extends the
  token sequence token-exactly and never re-tokenizes the history. When the environment sends a
  history that differs from what the model wrote or saw, the tokens stay what the model saw and
  :attr:`PolicyClient.rewritten` records it (the episode's ``history_rewritten``);
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

Not covered: group-level reward functions and rubrics that compute advantages (refused when the
environment loads), per-call sampling arguments (sampling is the run's ``[sampling]``), tool
lists that change within an episode, verifiers' server mode, and the trio backend (verifiers
runs on asyncio).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any, Literal

import structlog

from environments.base import MALFORMED_CALL, Environment
from environments.errors import EnvError, EnvironmentLoadError, RewardError
from environments.types import EnvConfig, EpisodeState
from policies.wire.toolcalls import Message, ParsedAssistant, ToolCall, to_openai_message

if TYPE_CHECKING:
    from datasets import Dataset
    from openai.types.chat import ChatCompletion

log = structlog.get_logger(__name__)
SUPPORTED = ((0, 3, 1), (0, 4))
"""The verifiers versions this adapter runs: from 0.3.1 (included) to 0.4 (excluded)."""
MODEL_NAME = "sprawl-policy"
"""The ``model`` a verifiers environment's calls name (the run's policy answers them)."""
_STATE = "verifiers_state"  # EpisodeState.data key of the verifiers rollout state
RECORDED_ELSEWHERE = frozenset(
    {
        "input", "task", "prompt", "completion", "responses", "trajectory", "final_env_response",
        "tool_defs", "metrics", "reward", "advantage", "error", "client", "model",
        "sampling_args", "usage_tracker",
    }
)  # fmt: skip
"""Keys of a verifiers state that are not ``Episode.metadata``: the episode records them as its
messages, segments, rewards and error, or they are the rollout's machinery (client, model)."""
_reward_errors: ContextVar[list[str] | None] = ContextVar("_reward_errors", default=None)
StopKind = Literal["done", "max_turns", "context", "episode_timeout"]
# verifiers' stop conditions that are not the environment's own decision
_STOPS: dict[str, StopKind] = {
    "max_turns_reached": "max_turns",
    "prompt_too_long": "context",
    "timeout_reached": "episode_timeout",
}


class VerifiersRolloutError(EnvError):
    """An error verifiers caught in a rollout (``state["error"]``): its type and message."""


@dataclass(frozen=True)
class Sampled:
    """One model call as the policy made it, what the environment's client answers with."""

    parsed: ParsedAssistant
    prompt_token_ids: list[int]
    token_ids: list[int]
    tokens: list[str]
    """The sampled tokens' text, one per id (the ``logprobs.content[].token`` fields)."""
    logprobs: list[float]
    finish_reason: Literal["stop", "length", "abort"]


ModelCall = Callable[[list[Message], list[dict[str, Any]] | None], Awaitable[Sampled]]
"""The runner's side of a model call: the messages the environment added since the last call
(the whole prompt on the first) and the tools, to the sampled turn."""


@dataclass
class _Completions:
    client: PolicyClient

    async def create(
        self,
        *,
        messages: Sequence[Any],
        model: str = MODEL_NAME,
        tools: list[dict[str, Any]] | None = None,
        **sampling: Any,
    ) -> ChatCompletion:
        """``chat.completions.create``: the model's next turn after ``messages``; sampling is
        the run's ``[sampling]``, so ``sampling`` keys are logged and not used."""
        if sampling:
            log.warning("verifiers.sampling_ignored", keys=sorted(sampling), using="[sampling]")
        return await self.client.complete([dict(m) for m in messages], tools or None)


@dataclass
class _Chat:
    completions: _Completions


@dataclass
class PolicyClient:
    """An OpenAI-compatible async client whose calls go to the run's policy, for one episode.

    It keeps ``state.messages`` (what the model saw and wrote), records tool results and
    malformed calls on ``state``, and remembers the first failure of a model call
    (:attr:`failure`), which verifiers would otherwise turn into its own ``ModelError``.
    """

    state: EpisodeState
    model: ModelCall
    rewritten: bool = False
    """The environment sent a history that differs from what the model wrote or saw."""
    failure: Exception | None = None
    calls: int = 0
    chat: _Chat = field(init=False)

    def __post_init__(self) -> None:
        self.chat = _Chat(_Completions(self))

    async def close(self) -> None:
        """Nothing to release: the pool is the run's."""

    async def complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> ChatCompletion:
        from openai.types.chat import ChatCompletion

        new = self.absorb(messages)
        try:
            sampled = await self.model(new, tools)
        except Exception as exc:
            self.failure = self.failure or exc
            raise
        self.calls += 1
        parsed = sampled.parsed
        for err in parsed.errors:
            self.state.bad_calls += 1
            call = ToolCall(id="", name=MALFORMED_CALL, arguments=err.raw)
            self.state.tool_results.append((call, "", err.message))
        message = to_openai_message(parsed)
        if parsed.errors:  # an OpenAI server leaves a block it cannot parse in the content
            text = [parsed.content, *(e.raw for e in parsed.errors)]
            message["content"] = "\n".join(t for t in text if t)
        self.state.messages.append(message)
        finish = "tool_calls" if parsed.tool_calls else sampled.finish_reason
        n, m = len(sampled.prompt_token_ids), len(sampled.token_ids)
        return ChatCompletion.model_validate(
            {
                "id": f"sprawl-{self.calls}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": MODEL_NAME,
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop" if finish == "abort" else finish,
                        "message": message,
                        "logprobs": {
                            "content": [
                                {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                                for t, lp in zip(sampled.tokens, sampled.logprobs, strict=True)
                            ]
                        },
                        "token_ids": sampled.token_ids,
                    }
                ],
                "prompt_token_ids": sampled.prompt_token_ids,
                "usage": {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m},
            }
        )

    def absorb(self, messages: list[dict[str, Any]]) -> list[Message]:
        """The messages of ``messages`` past the episode's history, added to it (the first
        call's are the prompt); a history that differs sets :attr:`rewritten`."""
        known = self.state.messages
        msgs = [_clean(m) for m in messages]
        common = next(
            (i for i, (a, b) in enumerate(zip(known, msgs, strict=False)) if _key(a) != _key(b)),
            min(len(known), len(msgs)),
        )
        if not self.calls:
            new = msgs
        elif common == len(known):
            new = msgs[common:]
        else:  # rewritten: the tokens keep what the model saw; the messages after its turn follow
            self.rewritten = True
            last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=-1)
            new = msgs[max(last + 1, common) :]
        calls = {
            c["id"]: c["function"]
            for m in [*known, *new]
            for c in m.get("tool_calls") or []
            if isinstance(c, dict) and "id" in c and isinstance(c.get("function"), dict)
        }
        for m in new:
            fn = calls.get(m.get("tool_call_id", ""))
            if m.get("role") != "tool" or fn is None:
                continue
            m.setdefault("name", fn["name"])  # templates that look a tool message's function up
            call = ToolCall(id=m["tool_call_id"], name=fn["name"], arguments=fn["arguments"])
            self.state.tool_results.append((call, _text(m.get("content")), None))
        self.state.messages.extend(new)
        return new


def _clean(message: dict[str, Any]) -> Message:
    """An OpenAI message without the keys verifiers sets to None."""
    return {k: v for k, v in message.items() if v is not None}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return json.dumps(content, sort_keys=True, default=str)


def _key(message: Message) -> tuple[Any, ...]:
    """What makes two messages the same turn (content, calls and their parsed arguments)."""
    calls = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            args = fn.get("arguments")
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return (
        message.get("role"),
        _text(message.get("content") or ""),
        message.get("reasoning_content") or "",
        tuple(calls),
        message.get("tool_call_id"),
    )


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
        self._weights = _rubric_weights(env.rubric, f"{key}.id: {env_id!r}")
        _watch_rewards(env.rubric)

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
        vf_client = _verifiers_client(client)
        try:
            vf_state = await self.vf.rollout(dict(state.task), vf_client, MODEL_NAME, None)
        except Exception:
            if client.failure is not None:
                raise client.failure from None
            raise
        state.data[_STATE] = vf_state
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
        vf_state = state.data.get(_STATE)
        if vf_state is None:
            raise RewardError("the rollout ended before verifiers started it; nothing to score")
        if vf_state.get("completion") is None:  # cut short (timeouts.episode_s): render it
            await self.vf.render_completion(vf_state)
        errors: list[str] = []
        token = _reward_errors.set(errors)
        try:
            await self.vf.rubric.score_rollout(vf_state)
        finally:
            _reward_errors.reset(token)
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
        vf_state = state.data.get(_STATE)
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


def _rubrics(rubric: Any) -> list[Any]:
    return (
        [r for inner in rubric.rubrics for r in _rubrics(inner)]
        if hasattr(rubric, "rubrics")
        else [rubric]
    )


def _rubric_weights(rubric: Any, where: str) -> dict[str, float]:
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


def _watch_rewards(rubric: Any) -> None:
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


def _verifiers_client(client: PolicyClient) -> Any:
    """verifiers' ``OpenAIChatCompletionsClient`` around ``client``, calling
    ``client.chat.completions.create`` (verifiers posts raw HTTP otherwise)."""
    from verifiers.clients import OpenAIChatCompletionsClient

    class _Client(OpenAIChatCompletionsClient):  # type: ignore[misc]
        async def get_native_response(
            self,
            prompt: list[dict[str, Any]],
            model: str,
            sampling_args: dict[str, Any],
            tools: list[dict[str, Any]] | None = None,
            **kwargs: Any,
        ) -> ChatCompletion:
            client.state.data[_STATE] = kwargs.get("state")  # scored if the episode is cut short
            return await client.chat.completions.create(
                messages=prompt, model=model, tools=tools, **sampling_args
            )

    return _Client(client)


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
