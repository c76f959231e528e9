"""Environments through the real episode runner, with a scripted pool that records its requests.

Shows the multi-turn token bookkeeping with user turns (the prompt of each call is the previous
prompt + the sampled tokens + the environment's tokens) and that errors in user code end up on
the trajectory with their type and message.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from environments.base import EpisodeState, reward
from environments.guess import Guess, GuessConfig
from environments.retrieval import Retrieval, RetrievalConfig
from orchestrator.types import Episode
from policies.wire.chat_tokens import ChatTokens
from policies.wire.toolcalls import ParsedAssistant
from tests.support.fakes import run_scripted

pytestmark = pytest.mark.anyio


async def test_user_turns_extend_the_prompt_token_exactly(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    env = Guess(GuessConfig())
    episode, pool = await run_scripted(
        env, tokenizer, {"id": "g", "secret": 37}, ["50", "25", "37"]
    )
    assert episode.stop_reason == "done"
    assert episode.error is None
    assert episode.reward == pytest.approx(1 + 0.5 * (1 - 2 / 7))
    assert len(pool.requests) == len(episode.segments) == 3
    feedback = ["lower", "higher"]
    for k in range(2):
        prompt, sampled = pool.requests[k].prompt_token_ids, pool.sampled[k]
        following = pool.requests[k + 1].prompt_token_ids
        assert following[: len(prompt) + len(sampled)] == prompt + sampled
        env_tokens = following[len(prompt) + len(sampled) :]
        expected = f"\n<|im_start|>user\n{feedback[k]}<|im_end|>\n<|im_start|>assistant\n"
        assert tokenizer.decode(env_tokens) == expected
        assert episode.segments[k + 1].prompt_len == len(following)
    assert episode.token_ids == pool.requests[-1].prompt_token_ids + pool.sampled[-1]
    assert all(r.policy_version.min == 2 for r in pool.requests)
    # The whole sequence is what the chat template renders for the conversation (whose last
    # assistant turn the model closed with <|im_end|>, without the template's newline).
    rendered = tokenizer.apply_chat_template(
        episode.messages[:-1], add_generation_prompt=False, tokenize=False
    )
    assert str(tokenizer.decode(episode.token_ids)) + "\n" == rendered
    assert episode.messages[-1] == {"role": "user", "content": "correct"}


async def test_tool_results_and_tool_errors_through_the_runner(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    env = Retrieval(RetrievalConfig())
    task = next(t for t in env.tasks() if t["id"] == "q17")

    def call(name: str, **args: object) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"

    texts = [call("read", doc_id="d99"), call("read", doc_id="d25"), "21 members."]
    episode, pool = await run_scripted(env, tokenizer, task, texts)
    assert episode.stop_reason == "done"
    assert [(c.name, c.error) for c in episode.tool_calls] == [
        ("read", "ValueError: no document 'd99'; use an id returned by search"),
        ("read", None),
    ]
    assert episode.rewards == {"correct": 1.0, "read_source": 1.0}
    env_tokens = pool.requests[1].prompt_token_ids[
        len(pool.requests[0].prompt_token_ids) + len(pool.sampled[0]) :
    ]
    assert "<tool_response>\nerror: ValueError: no document 'd99'" in tokenizer.decode(env_tokens)


async def test_max_turns_is_recorded_and_penalised(tokenizer: PreTrainedTokenizerBase) -> None:
    env = Guess(Guess.Config.model_validate({"penalties": {"unfinished": 0.25}}))
    episode, _ = await run_scripted(
        env, tokenizer, {"id": "g", "secret": 37}, ["1", "2"], max_turns=2
    )
    assert episode.stop_reason == "max_turns"
    assert episode.rewards["penalty_unfinished"] == 1.0
    assert episode.reward == pytest.approx(-0.25)


async def test_errors_in_hooks_and_rewards_are_captured(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    class BadHook(Guess):
        async def on_answer(self, state: EpisodeState, reply: ParsedAssistant) -> Any:
            raise KeyError("secret_number")

    class BadReward(Guess):
        @reward(weight=0.5)
        def efficiency(self, state: EpisodeState) -> float:
            return len(state.data["guesses"]) / 0

    hook, _ = await run_scripted(BadHook(GuessConfig()), tokenizer, {"id": "g", "secret": 3}, ["3"])
    assert hook.stop_reason == "env_error"
    assert hook.error is not None
    assert (hook.error.where, hook.error.type) == ("environment", "KeyError")
    assert "secret_number" in hook.error.message
    assert len(hook.segments) == 1  # the partial trajectory is kept

    bad, _ = await run_scripted(
        BadReward(GuessConfig()), tokenizer, {"id": "g", "secret": 3}, ["3"]
    )
    assert bad.stop_reason == "env_error"
    assert bad.error is not None
    assert bad.error.type == "RewardError"
    assert "'efficiency' raised ZeroDivisionError: division by zero" in bad.error.message
    assert bad.rewards == {}
    assert bad.reward == 0.0


async def test_an_environments_metadata_is_kept_on_the_episode_as_json(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    class Noted(Guess):
        def metadata(self, state: EpisodeState) -> dict[str, Any]:
            return {"guesses": state.data["guesses"], "lock": threading.Lock(), "seen": {3}}

    class BadNotes(Guess):
        def metadata(self, state: EpisodeState) -> dict[str, Any]:
            return state.data["notes"]  # type: ignore[no-any-return]

    task = {"id": "g", "secret": 37}
    noted, _ = await run_scripted(Noted(GuessConfig()), tokenizer, task, ["50", "37"])
    assert noted.error is None
    assert noted.metadata == {"guesses": [50, 37], "lock": "<unserializable lock>", "seen": [3]}
    assert Episode.model_validate_json(noted.model_dump_json()).metadata == noted.metadata
    plain, _ = await run_scripted(Guess(GuessConfig()), tokenizer, task, ["37"])
    assert plain.metadata == {}

    bad, _ = await run_scripted(BadNotes(GuessConfig()), tokenizer, task, ["37"])
    assert bad.stop_reason == "env_error"  # a bug in the hook is the episode's error
    assert bad.error is not None
    assert (bad.error.where, bad.error.type) == ("environment", "KeyError")
    assert bad.error.message == "metadata: 'notes'"
    assert bad.rewards["solved"] == 1.0  # scored before the hook ran


async def test_the_engines_context_ends_an_episode_gracefully(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """The engines report a context smaller than the model's: the first call's max_tokens is
    clamped to the room left, and the episode stops with ``context`` once nothing fits."""
    env = Guess(Guess.Config.model_validate({"penalties": {"unfinished": 0.25}}))
    task = {"id": "g", "secret": 37}
    prompt = ChatTokens(tokenizer).initial(list(env.initial_messages(task)))
    episode, pool = await run_scripted(
        env, tokenizer, task, ["50", "25"], engine_context=len(prompt) + 8
    )
    assert episode.stop_reason == "context"
    assert episode.error is None
    assert len(pool.requests) == 1
    assert pool.requests[0].max_tokens == 8
    assert episode.rewards["penalty_unfinished"] == 1.0
