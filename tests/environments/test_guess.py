"""The guessing game under scripted policies: feedback arrives as user turns."""

from __future__ import annotations

import pytest

from environments.guess import Guess, GuessConfig
from environments.scripted import play

pytestmark = pytest.mark.anyio

TASK = {"id": "g", "secret": 37}


async def test_binary_search_wins_with_feedback_as_user_turns() -> None:
    env = Guess(GuessConfig(max_guesses=7))
    played = await play(env, TASK, ["50", "I guess 25", "37"])
    feedback = [r.messages for r in played.replies]
    assert feedback == [
        [{"role": "user", "content": "lower"}],
        [{"role": "user", "content": "higher"}],
        [{"role": "user", "content": "correct"}],
    ]
    assert [r.done for r in played.replies] == [False, False, True]
    assert played.state.data["guesses"] == [50, 25, 37]
    assert played.rewards == {"solved": 1.0, "efficiency": pytest.approx(1 - 2 / 7)}
    assert played.reward == pytest.approx(1 + 0.5 * (1 - 2 / 7))
    roles = [m["role"] for m in played.state.messages]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant", "user"]


async def test_first_try_gets_full_efficiency() -> None:
    played = await play(Guess(GuessConfig()), TASK, ["37"])
    assert played.reward == pytest.approx(1.5)


async def test_no_number_and_tool_calls_are_nudged_not_counted() -> None:
    env = Guess(GuessConfig(max_number=50))
    call = '<tool_call>\n{"name": "peek", "arguments": {}}\n</tool_call>'
    played = await play(env, TASK, ["hmm", "", call, "37"])
    assert played.replies[0].messages[0]["content"] == "Reply with one integer from 1 to 50."
    assert played.replies[1].messages[0]["content"] == "Reply with one integer from 1 to 50."
    assert "unknown tool 'peek'" in played.replies[2].messages[0]["content"]
    assert played.state.data["guesses"] == [37]
    assert played.state.bad_calls == 1
    assert played.rewards["solved"] == 1.0


async def test_out_of_guesses_ends_unsolved() -> None:
    env = Guess(GuessConfig(max_guesses=2))
    played = await play(env, TASK, ["1", "2", "37"])
    assert played.replies[-1].done
    assert played.replies[-1].messages[0]["content"] == "Out of guesses; it was 37."
    assert len(played.replies) == 2
    assert played.rewards == {"solved": 0.0, "efficiency": 0.0}


async def test_running_out_of_turns_costs_the_unfinished_penalty() -> None:
    env = Guess.Config.model_validate({"penalties": {"unfinished": 0.1}})
    played = await play(Guess(env), TASK, ["50", "25"])
    assert played.state.stop_reason == "max_turns"
    assert played.reward == pytest.approx(-0.1)


def test_generated_secrets_are_in_range_and_seeded() -> None:
    a = Guess(GuessConfig(num_tasks=50, max_number=10, seed=3)).tasks()
    b = Guess(GuessConfig(num_tasks=50, max_number=10, seed=3)).tasks()
    assert a["secret"] == b["secret"]
    assert set(a["secret"]) <= set(range(1, 11))
    assert len(set(a["id"])) == 50
