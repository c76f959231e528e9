"""The episode runner: one multi-turn, tool-calling episode, token-in / token-out.

Guarantees:

- the prompt of each model call is exactly the previous prompt + the previous call's sampled
  tokens + the new environment tokens (:mod:`policies.wire.chat_tokens`); text is never
  re-tokenized;
- every model call is a :class:`Segment` with its version stamps, token span, endpoint, latency,
  attempts and sampling parameters;
- the run always gets an :class:`Episode` back: an exception in environment code, a model call
  that failed on every endpoint, the whole-episode timeout (``timeouts.episode_s``) and
  cancellation of the run all end the episode with a stop reason and the partial trajectory
  (a cancelled episode lands in :attr:`EpisodeRunner.interrupted`, since cancellation must
  propagate);
- only the environment's own calls (``initial_messages``, ``respond`` and the tools it runs,
  ``score``, ``metadata``, ``total_reward``; a verifiers rollout) make an ``env_error``
  (:func:`environment_code`); an exception in sprawl's own turn logic (chat rendering, tool-call
  parsing, the pool) is sprawl's: logged with its traceback (``episode_orchestrator_error``),
  counted (``sprawl_episodes_orchestrator_error``) and recorded as ``orchestrator_error``;
- the environment's :meth:`~environments.base.Environment.metadata` of a finished episode is kept
  on it as JSON values (an exception there is the episode's error, like a reward function's);
- a model turn longer than :data:`INLINE_PARSE_TOKENS` is decoded and its tool calls parsed in a
  worker thread (at most :data:`PARSE_THREADS` at a time per runner), so a long or hostile turn
  never holds the event loop and the other episodes with it; the parser reads at most
  :data:`~policies.wire.toolcalls.MAX_TURN_CHARS` characters of it, in linear time. Call ids are
  seeded by the episode and turn (``id_seed``), so the alphanumeric ids Mistral's templates
  require are reproducible.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, Literal

import anyio
import structlog
from pydantic_core import to_jsonable_python

from environments.base import Environment, EpisodeState
from environments.errors import RewardError
from orchestrator.errors import EndpointError
from orchestrator.loop.pool import Pool
from orchestrator.types import (
    Episode,
    ErrorRecord,
    SamplingParams,
    Segment,
    StopReason,
    ToolCallRecord,
)
from policies.wire.chat_tokens import ChatTokens
from policies.wire.lane import GenerateChoice, GenerateRequest, VersionBounds
from policies.wire.tool_parsers.types import ToolParser
from policies.wire.toolcalls import ParsedAssistant, to_openai_message

log = structlog.get_logger(__name__)

INLINE_PARSE_TOKENS = 1024
"""A turn of at most this many tokens is decoded and parsed on the event loop (well under a
millisecond); a longer one in a worker thread."""
PARSE_THREADS = 2
"""Worker threads one runner parses long turns in at a time (parsing holds the GIL: more would
not be faster)."""


class EnvironmentFailed(Exception):
    """The environment's own code raised (the exception it raised is ``__cause__``)."""


class OrchestratorFailed(Exception):
    """Sprawl's own code raised inside a callback the environment's code called (a verifiers
    rollout's model): kept sprawl's on its way out through the environment's code."""


@contextmanager
def environment_code(*passing: type[BaseException]) -> Iterator[None]:
    """Run the environment's code: what it raises becomes :class:`EnvironmentFailed`, except a
    failed model call, a failure already attributed and the ``passing`` types (sprawl's own
    signals that cross the environment's code)."""
    kept: tuple[type[BaseException], ...] = (
        EndpointError,
        EnvironmentFailed,
        OrchestratorFailed,
        *passing,
    )
    try:
        yield
    except kept:
        raise
    except Exception as exc:
        raise EnvironmentFailed(str(exc)) from exc


def _check_finite(rewards: Mapping[str, float], total: float) -> None:
    """Refuse a reward that is not a finite number (NaN or infinite: one such reward trained on
    turns every parameter NaN), naming the component."""
    for name, value in {**rewards, "total_reward": total}.items():
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise RewardError(f"{name!r} returned {value!r}: a reward must be a finite number")


def _record(
    where: Literal["environment", "orchestrator"], exc: BaseException, prefix: str = ""
) -> ErrorRecord:
    """The episode's error record of ``exc`` (what it wraps, for the markers above)."""
    marked = isinstance(exc, EnvironmentFailed | OrchestratorFailed)
    cause = exc.__cause__ if marked and exc.__cause__ is not None else exc
    return ErrorRecord(where=where, type=type(cause).__name__, message=f"{prefix}{cause}")


def _jsonable(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """An environment's metadata as JSON values (:meth:`Environment.metadata`)."""
    if not isinstance(metadata, Mapping):
        raise TypeError(f"returned {type(metadata).__name__}, not a dict")

    def fallback(value: object) -> object:
        if isinstance(value, Mapping):
            return dict(value)
        return f"<unserializable {type(value).__name__}>"

    out = to_jsonable_python(dict(metadata), fallback=fallback, bytes_mode="base64")
    assert isinstance(out, dict)
    return out


class EpisodeRunner:
    """Runs one environment episode at a time per call of :meth:`run`, token-exact (module
    docstring): the environment gives messages, the pool gives model calls under the episode's
    bounds, and the result is always an :class:`~orchestrator.types.Episode`, failed or not."""

    def __init__(
        self,
        env: Environment,
        chat: ChatTokens,
        parser: ToolParser,
        pool: Pool,
        *,
        sampling: SamplingParams,
        max_turns: int,
        episode_timeout_s: float,
        max_context: int,
        name: str | None = None,
    ) -> None:
        """``name``: the environment's name in the run (``Episode.environment``; an
        ``[[environments]]`` entry's ``name``), by default the environment class's ``name``."""
        self.env = env
        self.name = name or env.name
        self.chat = chat  # built with env.tool_schemas()
        self.parser = parser
        self.pool = pool
        self.sampling = sampling
        self.max_turns = max_turns
        self.episode_timeout_s = episode_timeout_s
        self.max_context = max_context
        self.interrupted: list[Episode] = []  # in flight when the run was cancelled
        self._parse_threads: anyio.CapacityLimiter | None = None  # made in the event loop

    async def run(
        self,
        task: dict[str, Any],
        group_id: str,
        bounds: Callable[[], VersionBounds],
        admitted_at: int,
        seed: int | None = None,
        episode_id: str | None = None,
    ) -> Episode:
        """Run one episode of ``task``; ``bounds()`` gives the version bounds of each call."""
        started = time.time()
        ep_id = episode_id or f"ep-{uuid.uuid4().hex[:12]}"
        rec: dict[str, Any] = dict(
            id=ep_id,
            group_id=group_id,
            task_id=str(task["id"]),
            environment=self.name,
            admitted_at_version=admitted_at,
            started_at=started,
            token_ids=[],
            prompt_len=0,
            segments=[],
        )
        state = EpisodeState(task=task, messages=[])
        with structlog.contextvars.bound_contextvars(episode=ep_id, task=rec["task_id"]):
            stop, error = await self._play(task, state, rec, bounds, seed)
            return await self._finish(state, rec, stop, error)

    async def _play(
        self,
        task: dict[str, Any],
        state: EpisodeState,
        rec: dict[str, Any],
        bounds: Callable[[], VersionBounds],
        seed: int | None,
    ) -> tuple[StopReason, ErrorRecord | None]:
        """The turns, under the whole-episode timeout: why they stopped, and the error that
        stopped them (module docstring: whose error it is). A cancelled episode is kept in
        :attr:`interrupted` and the cancellation goes on."""
        stop: StopReason = "max_turns"
        try:
            with anyio.move_on_after(self.episode_timeout_s) as scope:
                stop = await self._turns(task, state, rec, bounds, seed)
            if scope.cancelled_caught:
                stop = "episode_timeout"
        except EndpointError as exc:
            return "model_error", ErrorRecord(
                where="model", type=type(exc).__name__, message=str(exc)
            )
        except anyio.get_cancelled_exc_class():
            self.interrupted.append(
                Episode(
                    **rec,
                    messages=state.messages,
                    stop_reason="interrupted",
                    finished_at=time.time(),
                )
            )
            log.debug("episode_interrupted")  # the run logs one line for all
            raise
        except EnvironmentFailed as exc:  # user environment code: data, never a crash
            return "env_error", _record("environment", exc)
        except Exception as exc:  # sprawl's own turn logic: a bug of ours, not the user's
            log.exception("episode_orchestrator_error")
            return "orchestrator_error", _record("orchestrator", exc)
        return stop, None

    async def _finish(
        self, state: EpisodeState, rec: dict[str, Any], stop: StopReason, error: ErrorRecord | None
    ) -> Episode:
        """The episode as it ended: scored when nothing failed, with its metadata and tool calls;
        an exception in a reward function or in ``metadata`` is the episode's error."""
        rewards: dict[str, float] = {}
        reward = 0.0
        if error is None:
            state.stop_reason = stop
            try:  # a reward function's bug is the episode's error
                rewards, reward = await self._score(state)
            except EnvironmentFailed as exc:
                stop, error = "env_error", _record("environment", exc, "reward: ")
        metadata: dict[str, Any] = {}
        try:  # user code, like a reward function
            with environment_code():
                metadata = _jsonable(self.env.metadata(state))
        except EnvironmentFailed as exc:
            if error is None:
                stop, error = "env_error", _record("environment", exc, "metadata: ")
        episode = Episode(
            **rec,
            messages=state.messages,
            rewards=rewards,
            metadata=metadata,
            reward=reward,
            tool_calls=[
                ToolCallRecord(name=c.name, arguments=c.arguments, result=r, error=e)
                for c, r, e in state.tool_results
            ],
            stop_reason=stop,
            error=error,
            history_rewritten=self._history_rewritten(state),
            finished_at=time.time(),
        )
        log.debug("episode_done", stop=stop, reward=episode.reward, turns=len(episode.segments))
        return episode

    async def _score(self, state: EpisodeState) -> tuple[dict[str, float], float]:
        """The episode's reward components and total, every one a finite number."""
        with environment_code():
            rewards = await self.env.score(state)
            reward = self.env.total_reward(rewards) if rewards else 0.0
            _check_finite(rewards, reward)
        return rewards, reward

    async def _turns(
        self,
        task: dict[str, Any],
        state: EpisodeState,
        rec: dict[str, Any],
        bounds: Callable[[], VersionBounds],
        seed: int | None,
    ) -> StopReason:
        with environment_code():
            state.messages = list(self.env.initial_messages(task))
        ids = self.chat.initial(state.messages)
        rec["token_ids"], rec["prompt_len"] = ids, len(ids)
        for turn in range(self.max_turns):
            state.turn = turn
            choice = await self._call(ids, rec, bounds, seed)
            if choice is None:
                return "context"
            parsed = await self._parse(choice.token_ids, state, f"{rec['id']}:{turn}")
            state.messages.append(to_openai_message(parsed))
            with environment_code():
                reply = await self.env.respond(state, parsed)
            state.messages.extend(reply.messages)
            if reply.done:
                return "done"
            ids.extend(self.chat.continuation(choice.token_ids, reply.messages))
        return "max_turns"

    async def _call(
        self,
        ids: list[int],
        rec: dict[str, Any],
        bounds: Callable[[], VersionBounds],
        seed: int | None,
        *,
        max_tokens: int | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> GenerateChoice | None:
        """One model call on the sequence ``ids`` under ``bounds()``: recorded as the next
        segment of ``rec``, its sampled tokens appended to ``ids``; None when the sequence has
        reached the context limit (no call is made). ``max_tokens`` (at most the run's) and
        ``stop_token_ids``: a caller's own (a verifiers renderer's)."""
        engines = self.pool.max_context()
        limit = self.max_context if engines is None else min(self.max_context, engines)
        room = limit - len(ids)
        if room <= 1:
            return None
        segments: list[Segment] = rec["segments"]
        turn = len(segments)
        # MoE routing of the positions earlier calls forwarded is in their segments already
        routed = segments[-1].prompt_len + len(segments[-1].token_ids) - 1 if segments else 0
        wanted = self.sampling.max_tokens if max_tokens is None else max_tokens
        req = GenerateRequest(
            prompt_token_ids=list(ids),
            max_tokens=min(self.sampling.max_tokens, wanted, room),
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,
            seed=None if seed is None else seed + turn,
            stop_token_ids=list(stop_token_ids),
            policy_version=bounds(),
            routed_experts_prompt_start=routed,
        )
        affinity = segments[-1].endpoint if segments else None
        t0 = time.perf_counter()
        resp, endpoint, attempts = await self.pool.generate(
            req, affinity, priority=rec["started_at"]
        )
        choice = resp.choices[0]
        segments.append(
            Segment(
                turn=turn,
                prompt_len=len(ids),
                token_ids=choice.token_ids,
                logprobs=choice.logprobs,
                finish_reason=choice.finish_reason,
                policy_version=resp.policy_version,
                bounds=req.policy_version,
                endpoint=endpoint.id,
                latency_s=time.perf_counter() - t0,
                attempts=attempts,
                sampling=self.sampling.model_copy(
                    update={"seed": req.seed, "max_tokens": min(self.sampling.max_tokens, wanted)}
                ),
                routed_experts=choice.routed_experts,
                routed_experts_start=routed,
            )
        )
        ids.extend(choice.token_ids)
        return choice

    async def _parse(
        self, sampled: list[int], state: EpisodeState, id_seed: str
    ) -> ParsedAssistant:
        """The sampled turn as the tool parser reads it, off the event loop when it is long
        (module docstring); ids count on from the calls already in ``state.messages``."""
        first_id = sum(len(m.get("tool_calls") or []) for m in state.messages)
        read = partial(self._read, sampled, first_id, id_seed)
        if len(sampled) <= INLINE_PARSE_TOKENS:
            return read()
        if self._parse_threads is None:
            self._parse_threads = anyio.CapacityLimiter(PARSE_THREADS)
        return await anyio.to_thread.run_sync(read, limiter=self._parse_threads)

    def _read(self, sampled: list[int], first_id: int, id_seed: str) -> ParsedAssistant:
        text = self.chat.assistant_text(sampled, self.parser.markers)
        return self.parser.parse(text, first_id=first_id, tools=self.chat.tools, id_seed=id_seed)

    def _history_rewritten(self, state: EpisodeState) -> bool:
        """Whether the template would re-render the episode's earlier turns differently from
        the tokens the model saw (:meth:`ChatTokens.history_rewritten`)."""
        return self.chat.history_rewritten(state.messages)
