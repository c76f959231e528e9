"""The episode runner: token-exact multi-turn prompts, failover mid-episode, errors as data."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase
from trio.testing import MockClock

from environments.base import EpisodeState, reward
from environments.calculator import Calculator, CalculatorConfig
from orchestrator.loop.episode import EpisodeRunner
from orchestrator.loop.pool import Pool
from orchestrator.types import EndpointRef, Episode, SamplingParams
from policies.wire.chat_tokens import ChatTokens
from policies.wire.lane import VersionBounds
from policies.wire.tool_parsers import tool_parser
from tests.support.fakes import ScriptedTransport

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return "trio", {"clock": MockClock(autojump_threshold=0)}


def _runner(
    tokenizer: PreTrainedTokenizerBase,
    t: ScriptedTransport,
    env: Calculator | None = None,
    **kw: Any,
) -> tuple[EpisodeRunner, Pool]:
    pool = Pool(t, version_wait_s=60.0, poll_interval_s=1.0, max_inflight=2)
    for name in t.versions:
        pool.add(EndpointRef(id=name, url=f"http://{name}"))
    env = env or Calculator(CalculatorConfig(num_tasks=4, seed=3))
    runner = EpisodeRunner(
        env,
        ChatTokens(tokenizer, env.tool_schemas()),
        tool_parser("hermes"),
        pool,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=64),
        max_turns=kw.get("max_turns", 3),
        episode_timeout_s=kw.get("episode_timeout_s", 60.0),
        max_context=2048,
    )
    return runner, pool


async def _episode(runner: EpisodeRunner, pool: Pool) -> Episode:
    await pool.refresh_all()
    task = runner.env.tasks()[0]
    return await runner.run(task, "g0", lambda: VersionBounds(min=0), admitted_at=0, seed=1)


def _say(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


async def test_failover_mid_episode_keeps_the_prefix_bit_exact(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    env = Calculator(CalculatorConfig(num_tasks=4, seed=3))
    task = env.tasks()[0]
    a, op, b = task["question"].removeprefix("What is ").removesuffix("?").split()
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}{op}{b}"}})
    answer = int(task["answer"])
    t = ScriptedTransport(
        {"a": 0, "b": 0},
        replies=[
            _say(tokenizer, f"<tool_call>\n{call}\n</tool_call>"),
            _say(tokenizer, f"The answer is {answer}."),
        ],
        fail_after={"a": 1},  # a serves the first turn, then dies
    )
    runner, pool = _runner(tokenizer, t, env)
    episode = await _episode(runner, pool)

    assert episode.stop_reason == "done"
    assert episode.reward == pytest.approx(1.1)
    first, second = episode.segments
    assert (first.endpoint, second.endpoint, second.attempts) == ("a", "b", 2)
    (_, r1), (_, r2_failed), (_, r2) = t.calls
    assert r2_failed.prompt_token_ids == r2.prompt_token_ids  # resent bit-exactly
    # the second prompt is the first prompt + sampled + the tool result's tokens, nothing else
    chat = ChatTokens(tokenizer, env.tool_schemas())
    tool_msg = [m for m in episode.messages if m["role"] == "tool"]
    expected = r1.prompt_token_ids + first.token_ids + chat.continuation(first.token_ids, tool_msg)
    assert r2.prompt_token_ids == expected
    assert episode.token_ids == r2.prompt_token_ids + second.token_ids
    assert [s.prompt_len for s in episode.segments] == [
        len(r1.prompt_token_ids),
        len(r2.prompt_token_ids),
    ]


async def test_every_endpoint_failing_is_recorded_not_raised(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    t = ScriptedTransport({"a": 0, "b": 0}, fail_after={"a": 0, "b": 0})
    runner, pool = _runner(tokenizer, t)
    episode = await _episode(runner, pool)
    assert episode.stop_reason == "model_error"
    assert episode.error is not None
    assert "connection reset" in episode.error.message


async def test_episode_timeout_keeps_the_partial_trajectory(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    call = json.dumps({"name": "calculator", "arguments": {"expression": "1+1"}})
    reply = _say(tokenizer, f"<tool_call>\n{call}\n</tool_call>")
    t = ScriptedTransport({"a": 0}, latency={"a": 4.0}, replies=[reply] * 5)
    runner, pool = _runner(tokenizer, t, episode_timeout_s=10.0)
    episode = await _episode(runner, pool)
    assert episode.stop_reason == "episode_timeout"
    # At most two 4 s calls fit in 10 s (fewer if the mock clock jumps while a tool thread runs);
    # what finished is kept.
    assert 1 <= len(episode.segments) <= 2
    last = episode.segments[-1]
    assert episode.token_ids[last.prompt_len : last.prompt_len + len(last.token_ids)] == (
        last.token_ids
    )
    assert episode.error is None


class Exploding(Calculator):
    def initial_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        raise RuntimeError("user bug")


async def test_user_code_exception_is_recorded(tokenizer: PreTrainedTokenizerBase) -> None:
    t = ScriptedTransport({"a": 0})
    runner, pool = _runner(tokenizer, t, Exploding(CalculatorConfig(num_tasks=2)))
    episode = await _episode(runner, pool)
    assert episode.stop_reason == "env_error"
    assert episode.error is not None
    assert (episode.error.type, episode.error.message) == ("RuntimeError", "user bug")


class _BrokenParser:
    """A tool parser with a bug: sprawl's own turn logic, not the environment's."""

    markers: tuple[str, ...] = ()

    def parse(self, text: str, **_: Any) -> Any:
        raise KeyError("parser bug")


async def test_an_exception_in_sprawl_s_own_turn_logic_is_an_orchestrator_error(
    tokenizer: PreTrainedTokenizerBase, caplog: pytest.LogCaptureFixture
) -> None:
    """(fails when the whole turn loop is caught as the environment's error)"""
    t = ScriptedTransport({"a": 0}, replies=[_say(tokenizer, "hello")])
    runner, pool = _runner(tokenizer, t)
    runner.parser = _BrokenParser()  # type: ignore[assignment]
    episode = await _episode(runner, pool)
    assert episode.stop_reason == "orchestrator_error"
    assert episode.error is not None
    assert (episode.error.where, episode.error.type) == ("orchestrator", "KeyError")
    assert len(episode.segments) == 1  # the call it made is kept


class BadTotal(Calculator):
    def total_reward(self, rewards: dict[str, float]) -> float:
        raise ValueError("weights bug")


class ExplodingTool(Calculator):
    async def respond(self, state: Any, parsed: Any) -> Any:
        raise OSError("tool host gone")


@pytest.mark.parametrize(
    ("env", "want"),
    [
        (BadTotal, ("ValueError", "reward: weights bug")),
        (ExplodingTool, ("OSError", "tool host gone")),
    ],
)
async def test_the_environment_s_own_calls_are_env_errors(
    tokenizer: PreTrainedTokenizerBase, env: type[Calculator], want: tuple[str, str]
) -> None:
    """``total_reward`` raised out of the runner before it was inside the environment's calls."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": "1+1"}})
    replies = [_say(tokenizer, f"<tool_call>\n{call}\n</tool_call>"), _say(tokenizer, "2")]
    t = ScriptedTransport({"a": 0}, replies=replies)
    runner, pool = _runner(tokenizer, t, env(CalculatorConfig(num_tasks=2)))
    episode = await _episode(runner, pool)
    assert episode.stop_reason == "env_error"
    assert episode.error is not None
    assert (episode.error.where, episode.error.type, episode.error.message) == (
        "environment",
        *want,
    )
    assert episode.reward == 0.0


class NanReward(Calculator):
    @reward(weight=1.0)
    def correct(self, state: EpisodeState) -> float:
        return math.nan


class InfTotal(Calculator):
    def total_reward(self, rewards: dict[str, float]) -> float:
        return math.inf


@pytest.mark.parametrize(
    ("env", "named"), [(NanReward, "'correct' returned nan"), (InfTotal, "'total_reward'")]
)
async def test_a_non_finite_reward_is_an_environment_error_never_trained_on(
    tokenizer: PreTrainedTokenizerBase, env: type[Calculator], named: str
) -> None:
    """(a NaN reward reached the trajectory log, whose writer refuses it: the run exited 1)"""
    t = ScriptedTransport({"a": 0}, replies=[_say(tokenizer, "2")])
    runner, pool = _runner(tokenizer, t, env(CalculatorConfig(num_tasks=2)))
    episode = await _episode(runner, pool)
    assert episode.stop_reason == "env_error"
    assert episode.error is not None
    assert episode.error.type == "RewardError"
    assert named in episode.error.message
    assert (episode.reward, episode.rewards) == (0.0, {})
    json.dumps(episode.model_dump(mode="json"), allow_nan=False)  # what the log writer does


async def test_max_turns_ends_the_episode(tokenizer: PreTrainedTokenizerBase) -> None:
    call = json.dumps({"name": "calculator", "arguments": {"expression": "2*3"}})
    reply = _say(tokenizer, f"<tool_call>\n{call}\n</tool_call>")
    t = ScriptedTransport({"a": 0}, replies=[reply] * 5)
    runner, pool = _runner(tokenizer, t, max_turns=2)
    episode = await _episode(runner, pool)
    assert episode.stop_reason == "max_turns"
    assert len(episode.segments) == 2
    assert len(episode.tool_calls) == 2
