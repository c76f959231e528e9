"""verifiers environments (``environment.kind = "verifiers"``) through the real runner.

The environments are written in the verifiers style (``tests/support/vf_reverse.py``: a
``SingleTurnEnv`` with a two-function rubric; ``tests/support/vf_tools.py``: a ``ToolEnv``) and
run by their own rollout loop; the model is a scripted pool that records what it was sent.
Shows: each call's prompt is exactly the previous prompt + the sampled tokens + the
environment's tokens; rewards are the rubric's; failures in environment code, in a reward
function and in the model's tool-call syntax are recorded on the episode; sprawl's limits
apply.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from datasets import Dataset
from pydantic import ValidationError
from structlog.testing import capture_logs
from transformers import PreTrainedTokenizerBase

from environments.errors import EnvironmentLoadError
from environments.loader import load_environment
from environments.types import EpisodeState
from environments.verifiers_adapter import VerifiersEnvironment
from environments.verifiers_client import PolicyClient, Sampled
from orchestrator.config import Config, EnvironmentConfig
from orchestrator.loop.verifiers_episode import VerifiersRunner
from orchestrator.types import Episode
from policies.wire.toolcalls import Message, parse_assistant
from tests.support.fakes import ScriptedPool, run_scripted

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module", autouse=True)
def _verifiers_loaded() -> None:
    """verifiers and its environment classes import once, in set-up (seconds, not per test)."""
    _env("vf_reverse")
    _env("vf_tools")


def _env(module: str, **args: Any) -> VerifiersEnvironment:
    env = load_environment(f"tests.support.{module}", args, kind="verifiers")
    assert isinstance(env, VerifiersEnvironment)
    return env


async def _run(
    env: VerifiersEnvironment,
    tokenizer: PreTrainedTokenizerBase,
    texts: list[str],
    task: int = 0,
    max_turns: int = 8,
) -> tuple[Episode, ScriptedPool]:
    row = dict(env.tasks()[task])
    return await run_scripted(
        env, tokenizer, row, texts, max_turns=max_turns, runner_cls=VerifiersRunner
    )


def _call(name: str, **args: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def _continues(pool: ScriptedPool, k: int) -> list[int]:
    """The environment's tokens between call ``k`` and ``k + 1``, checking the prefix."""
    prompt, sampled = pool.requests[k].prompt_token_ids, pool.sampled[k]
    following = pool.requests[k + 1].prompt_token_ids
    assert following[: len(prompt) + len(sampled)] == prompt + sampled
    return following[len(prompt) + len(sampled) :]


def test_the_dataset_gives_the_tasks_with_ids() -> None:
    env = _env("vf_reverse", num_tasks=3)
    tasks = env.tasks()
    assert isinstance(tasks, Dataset)
    assert tasks["id"] == ["0", "1", "2"]
    assert tasks["answer"] == ["ruobrah", "nretnal", "niffup"]
    assert tasks[0]["prompt"][0] == {"role": "system", "content": "You reverse words."}


async def test_single_turn_tokens_are_what_the_engine_saw_and_rewards_the_rubrics(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    env = _env("vf_reverse")
    episode, pool = await _run(env, tokenizer, ["ruobrah"])
    assert episode.error is None, episode.error
    assert episode.stop_reason == "done"
    # rubric: exact (weight 1) and overlap (weight 0.5); num_turns is verifiers' own metric
    assert episode.rewards == {"exact": 1.0, "overlap": 1.0, "num_turns": 1.0}
    assert episode.reward == pytest.approx(1.5)
    [req] = pool.requests
    prompt = env.tasks()[0]["prompt"]
    expected = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert req.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    assert episode.prompt_len == len(req.prompt_token_ids)
    assert episode.token_ids == req.prompt_token_ids + pool.sampled[0]
    [seg] = episode.segments
    assert seg.token_ids == pool.sampled[0]
    assert seg.logprobs == [-0.5] * len(pool.sampled[0])
    assert seg.policy_version.start == 3
    assert req.policy_version.min == 2  # the episode's bounds reach the pool
    assert episode.messages[-1] == {"role": "assistant", "content": "ruobrah"}


async def test_a_wrong_answer_scores_what_the_rubric_says(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    episode, _ = await _run(_env("vf_reverse"), tokenizer, ["ruobxxx"])
    assert episode.rewards["exact"] == 0.0
    assert episode.rewards["overlap"] == pytest.approx(4 / 7)
    assert episode.reward == pytest.approx(0.5 * 4 / 7)


async def test_tool_turns_extend_the_prompt_token_exactly(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    env = _env("vf_tools")
    episode, pool = await _run(env, tokenizer, [_call("add", a=2, b=3), "5"])
    assert episode.error is None, episode.error
    assert episode.stop_reason == "done"
    assert episode.rewards["correct"] == 1.0
    assert episode.reward == 1.0
    assert len(pool.requests) == len(episode.segments) == 2
    env_tokens = _continues(pool, 0)
    assert tokenizer.decode(env_tokens).startswith("\n<|im_start|>user\n<tool_response>\n5\n")
    assert episode.segments[1].prompt_len == len(pool.requests[1].prompt_token_ids)
    assert episode.token_ids == pool.requests[1].prompt_token_ids + pool.sampled[1]
    assert [(c.name, json.loads(c.arguments), c.result, c.error) for c in episode.tool_calls] == [
        ("add", {"a": 2, "b": 3}, "5", None)
    ]
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant"]
    assert episode.history_rewritten is False
    # the tools the template rendered are the environment's tool_defs
    assert "add" in tokenizer.decode(pool.requests[0].prompt_token_ids)


async def test_the_rollout_state_is_the_episodes_metadata(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    env = _env("vf_tools")
    episode, _ = await _run(env, tokenizer, [_call("add", a=2, b=3), "5"], task=1)
    meta = episode.metadata
    # the environment's own keys, the task's answer and id, verifiers' bookkeeping
    assert (meta["grader"], meta["tool_turns"]) == ("exact-match", 1)
    assert (meta["answer"], meta["example_id"]) == ("42", 1)
    assert meta["stop_condition"] == "no_tools_called"
    assert meta["usage"]["output_tokens"] > 0
    assert meta["timing"]["generation"]["duration"] >= 0
    # what the episode records otherwise is not repeated, and all of it is JSON
    assert not set(meta) & {"prompt", "completion", "trajectory", "metrics", "client"}
    assert Episode.model_validate_json(episode.model_dump_json()).metadata == meta


async def test_a_malformed_tool_call_is_recorded(tokenizer: PreTrainedTokenizerBase) -> None:
    episode, pool = await _run(_env("vf_tools"), tokenizer, ["<tool_call>\nnot json\n</tool_call>"])
    # the environment saw no tool call (as from an OpenAI server) and ended the episode
    assert episode.error is None
    assert episode.stop_reason == "done"
    assert len(pool.requests) == 1
    [call] = episode.tool_calls
    assert call.name == "malformed_call"
    assert call.error is not None
    assert "not valid JSON" in call.error
    assert "not json" in episode.messages[-1]["content"]  # the model's text, kept as written
    assert episode.rewards["correct"] == 0.0


async def test_an_exception_in_environment_code_is_the_episodes_error(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    episode, pool = await _run(_env("vf_tools", broken=True), tokenizer, [_call("add", a=2, b=3)])
    assert episode.stop_reason == "env_error"
    assert episode.error is not None
    assert (episode.error.where, episode.error.type) == ("environment", "RuntimeError")
    assert episode.error.message == "the grader's database is down"
    assert len(episode.segments) == 1  # the partial trajectory is kept
    assert episode.token_ids == pool.requests[0].prompt_token_ids + pool.sampled[0]
    assert episode.rewards == {}


async def test_a_reward_function_that_raises_is_recorded(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    episode, _ = await _run(_env("vf_reverse", broken_reward=True), tokenizer, ["ruobrah"])
    assert episode.stop_reason == "env_error"
    assert episode.error is not None
    assert episode.error.type == "RewardError"
    assert episode.error.message == "reward: 'exact' raised ZeroDivisionError: division by zero"


async def test_sprawls_turn_limit_ends_the_rollout_and_it_is_still_scored(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    env = _env("vf_tools", max_turns=10)
    calls = [_call("add", a=2, b=3)] * 3
    episode, pool = await _run(env, tokenizer, calls, max_turns=2)
    assert episode.stop_reason == "max_turns"
    assert episode.error is None
    assert len(pool.requests) == len(episode.segments) == 2
    assert episode.rewards["correct"] == 0.0
    assert len(episode.tool_calls) == 2


async def test_the_environments_turn_limit_is_max_turns(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    env = _env("vf_tools", max_turns=1)
    episode, pool = await _run(env, tokenizer, [_call("add", a=2, b=3)])
    assert episode.stop_reason == "max_turns"
    assert len(pool.requests) == 1


async def test_the_context_limit_ends_the_episode(tokenizer: PreTrainedTokenizerBase) -> None:
    env = _env("vf_tools")
    row = dict(env.tasks()[0])
    episode, pool = await run_scripted(
        env,
        tokenizer,
        row,
        [_call("add", a=2, b=3)] * 3,
        engine_context=170,
        runner_cls=VerifiersRunner,
    )
    assert episode.stop_reason == "context"
    assert episode.error is None
    assert all(len(r.prompt_token_ids) < 170 for r in pool.requests)


async def test_a_rewritten_history_is_recorded_and_the_tokens_stay_what_the_model_saw(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    env = _env("vf_tools", rewrite=True)
    episode, pool = await _run(env, tokenizer, [_call("add", a=2, b=3), "5"])
    assert episode.error is None, episode.error
    assert episode.history_rewritten is True
    env_tokens = _continues(pool, 0)  # still the model's own turn, then the tool result
    assert "<tool_response>\n5\n" in tokenizer.decode(env_tokens)


@pytest.mark.parametrize(
    ("env_id", "args", "match"),
    [
        ("no_such_env", {}, r"environment\.id: cannot import 'no_such_env'"),
        ("tests.support.fakes", {}, r"environment\.id: 'tests\.support\.fakes' has no load_env"),
        ("tests.support.vf_reverse", {"bogus": 1}, r"environment\.args: .*'bogus'"),
    ],
)
def test_load_errors_name_the_key(env_id: str, args: dict[str, Any], match: str) -> None:
    with pytest.raises(EnvironmentLoadError, match=match):
        load_environment(env_id, args, kind="verifiers")


def test_an_id_with_a_slash_names_its_module() -> None:
    env = load_environment("someone/tests.support.vf-reverse", {}, kind="verifiers")
    assert isinstance(env, VerifiersEnvironment)
    assert env.env_id == "someone/tests.support.vf-reverse"


def test_group_reward_functions_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import verifiers as vf

    def load_environment() -> vf.Environment:
        def best(completions: list[object]) -> list[float]:
            return [1.0] * len(completions)

        ds = Dataset.from_list([{"question": "q", "answer": "a"}])
        return vf.SingleTurnEnv(dataset=ds, rubric=vf.Rubric(funcs=[best]))

    import tests.support.vf_reverse as module

    monkeypatch.setattr(module, "load_environment", load_environment)
    with pytest.raises(EnvironmentLoadError, match="group-level reward functions"):
        _env("vf_reverse")


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"kind": "verifiers"}, "id: required when kind = 'verifiers'"),
        ({"kind": "verifiers", "id": "x", "cls": "a:B"}, "cls: not used when kind = 'verifiers'"),
        ({"id": "x"}, "id: only for kind = 'verifiers'"),
    ],
)
def test_the_config_checks_what_names_the_environment(section: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        EnvironmentConfig.model_validate(section)


def test_a_mixture_entry_may_be_a_verifiers_environment() -> None:
    cfg = Config.model_validate(
        {
            "environments": [
                {"name": "calc", "cls": "environments.calculator:Calculator"},
                {"name": "rev", "kind": "verifiers", "id": "vf-reverse", "args": {"num_tasks": 2}},
            ]
        }
    )
    assert [e.target() for e in cfg.environments] == [
        "environments.calculator:Calculator",
        "vf-reverse",
    ]
    with pytest.raises(ValidationError, match="cls: required"):
        Config.model_validate({"environments": [{"name": "calc"}]})


def test_an_environment_without_a_training_dataset_names_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import verifiers as vf

    import tests.support.vf_reverse as module

    def eval_only() -> vf.Environment:
        ds = Dataset.from_list([{"question": "q", "answer": "a"}])
        return vf.SingleTurnEnv(eval_dataset=ds, rubric=vf.Rubric(funcs=[lambda: 1.0]))

    monkeypatch.setattr(module, "load_environment", eval_only)
    env = load_environment("tests.support.vf_reverse", {}, kind="verifiers", key="environments[1]")
    with pytest.raises(
        EnvironmentLoadError, match=r"environments\[1\]\.id: .* no training dataset"
    ):
        env.tasks()


def test_an_unsupported_verifiers_release_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import environments.verifiers_adapter as adapter

    monkeypatch.setattr(adapter, "version", lambda _: "0.4.0")
    with pytest.raises(
        EnvironmentLoadError, match=r"environment\.kind: verifiers 0\.4\.0 is installed"
    ):
        _env("vf_reverse")


async def test_the_client_answers_chat_completions_create_with_tokens() -> None:
    seen: list[tuple[list[Message], object]] = []

    async def model(new: list[Message], tools: list[dict[str, Any]] | None) -> Sampled:
        seen.append((new, tools))
        parsed = parse_assistant(_call("add", a=1, b=2))
        return Sampled(parsed, [1, 2, 3], [7, 8], ["a", "b"], [-0.1, -0.2], "stop")

    state = EpisodeState(task={"id": "t"}, messages=[])
    client = PolicyClient(state, model)
    messages = [{"role": "user", "content": "1 + 2?"}]
    with capture_logs() as logs:
        reply = await client.chat.completions.create(model="m", messages=messages, temperature=0.2)
    assert seen == [(messages, None)]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 1, "b": 2})
    assert [t.logprob for t in choice.logprobs.content or []] == [-0.1, -0.2]
    assert reply.model_extra == {"prompt_token_ids": [1, 2, 3]}
    assert [e["keys"] for e in logs if e["event"] == "verifiers.sampling_ignored"] == [
        ["temperature"]
    ]
    assert state.messages[-1]["tool_calls"][0]["function"]["name"] == "add"
