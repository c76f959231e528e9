"""verifiers 0.4 environments (``environment.kind = "verifiers"``) through the real runner.

The environments are the packages under ``examples/verifiers/`` (``make install`` installs them
as users install theirs): ``vf_reverse`` (single turn, two weighted rewards), ``vf_tools`` (a
tool server over MCP, multi-turn), ``vf_hints`` (its own ``vf.Env`` that answers a wrong guess
with a hint) and ``vf_broken`` (a reward that raises). Each episode is
verifiers' own: its ``null`` harness program in the subprocess runtime, its interception
server, its train client and renderer; the engine is a scripted pool that records what it was
sent. Shows: the tokens recorded are exactly the engine's, each call carries the episode's
bounds and its segment the engine's stamps, the verifiers episode's ``PolicySpan`` is those
stamps, rewards are the task's, and failures are data.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, cast

import pytest
from transformers import AutoTokenizer

from environments.errors import EnvironmentLoadError
from environments.loader import load_environment
from environments.verifiers_adapter import VerifiersEnvironment
from orchestrator.config import EnvironmentConfig
from orchestrator.loop.pool import Pool
from orchestrator.loop.verifiers_episode import VerifiersRunner
from orchestrator.types import Episode, SamplingParams
from policies.wire.chat_tokens import ChatTokens
from policies.wire.lane import VersionBounds
from policies.wire.tool_parsers import tool_parser
from tests.support.fakes import ScriptedPool
from tests.support.models import model_copy

pytestmark = pytest.mark.anyio
LOCAL = {"agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}
"""The agent's program is verifiers' own chat loop, run on this machine."""
QWEN3 = {"name": "qwen3", "enable_thinking": False}
TEMPLATES = Path(__file__).resolve().parents[2] / "examples" / "chat_templates"


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sprawl's tiny model with a Qwen3-like template, its tokenizer configured as Qwen3's is
    (no ``unk_token``: the ``qwen3`` renderer looks its special tokens up by id)."""
    out = model_copy(
        "tiny", tmp_path_factory.mktemp("qwen3") / "m", chat_template=TEMPLATES / "qwen3_like.jinja"
    )
    config = out / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "unk_token": None}))
    return out


def _env(taskset: str, renderer: dict[str, Any] | None = None) -> VerifiersEnvironment:
    env = load_environment(taskset, dict(LOCAL), kind="verifiers", renderer=renderer)
    assert isinstance(env, VerifiersEnvironment)
    return env


async def _episode(
    env: VerifiersEnvironment, model_dir: Path, texts: list[str], max_turns: int = 4
) -> tuple[Episode, ScriptedPool]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pool = ScriptedPool(tokenizer, texts)
    runner = VerifiersRunner(
        env,
        ChatTokens(tokenizer, []),
        tool_parser("hermes"),
        cast(Pool, pool),
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=32),
        max_turns=max_turns,
        episode_timeout_s=240,
        max_context=2048,
        name="vf",
        run_name="test-run",
    )
    async with runner.serving():
        row = dict(env.tasks()[0])
        episode = await runner.run(row, "group-7", lambda: VersionBounds(min=2), admitted_at=3)
    return episode, pool


def _engine_tokens(episode: Episode, pool: ScriptedPool) -> None:
    """The episode's tokens are the engine's: each call's prompt is a prefix of the sequence,
    its sampled tokens follow it there, and the sequence ends with the last call's."""
    assert len(episode.segments) == len(pool.requests)
    for seg, req, sampled in zip(episode.segments, pool.requests, pool.sampled, strict=True):
        prompt = req.prompt_token_ids
        assert episode.token_ids[: len(prompt)] == prompt
        assert seg.prompt_len == len(prompt)
        assert episode.token_ids[len(prompt) : len(prompt) + len(sampled)] == sampled
        assert seg.token_ids == sampled
        assert seg.policy_version.start == seg.policy_version.end == 3  # the engine's stamp
        assert req.policy_version == seg.bounds == VersionBounds(min=2)
    last = pool.requests[-1].prompt_token_ids + pool.sampled[-1]
    assert episode.token_ids == last
    assert episode.prompt_len == len(pool.requests[0].prompt_token_ids)


async def test_a_single_turn_environment_is_token_exact_stamped_and_scored(
    tiny_model_dir: Path,
) -> None:
    env = _env("vf_reverse")
    assert env.tasks()["id"] == ["0", "1", "2", "3"]
    episode, pool = await _episode(env, tiny_model_dir, ["ruobrah"])
    assert episode.error is None, episode.error
    assert episode.stop_reason == "done"
    _engine_tokens(episode, pool)
    assert episode.rewards == {"exact": 1.0, "overlap": 1.0}
    assert episode.reward == pytest.approx(1.5)  # the rewards' own weights, 1 and 0.5
    assert episode.messages[-1] == {"role": "assistant", "content": "ruobrah"}
    facts = episode.metadata["verifiers"]
    assert facts["policy"] == {"start": 3, "end": 3}  # the PolicySpan is sprawl's stamps
    assert facts["ok"] is True
    assert facts["stop_condition"] == "agent_completed"


async def test_a_tool_using_environment_is_multi_turn_and_token_exact(qwen3_model: Path) -> None:
    env = _env("vf_tools", renderer=QWEN3)
    call = '<tool_call>\n{"name": "calc_add", "arguments": {"a": 12, "b": 30}}\n</tool_call>'
    episode, pool = await _episode(env, qwen3_model, [call, "42"])
    assert episode.error is None, episode.error
    _engine_tokens(episode, pool)
    assert len(episode.segments) == 2
    first = pool.requests[0].prompt_token_ids + pool.sampled[0]
    between = pool.requests[1].prompt_token_ids[len(first) :]  # the tool's answer, rendered
    assert "<tool_response>\n42\n</tool_response>" in AutoTokenizer.from_pretrained(
        qwen3_model
    ).decode(between)
    assert [(c.name, c.result) for c in episode.tool_calls] == [("calc_add", "42")]
    assert episode.rewards == {"correct": 1.0}
    assert episode.metadata["verifiers"]["metrics"] == {"tool_calls": 1.0}


async def test_an_environment_that_talks_back_is_bridged_across_user_turns(
    qwen3_model: Path,
) -> None:
    episode, pool = await _episode(
        _env("vf_hints", renderer=QWEN3), qwen3_model, ["bread", "amber"]
    )
    assert episode.error is None, episode.error
    _engine_tokens(episode, pool)
    first = pool.requests[0].prompt_token_ids + pool.sampled[0]
    between = pool.requests[1].prompt_token_ids[len(first) :]  # the user's hint, rendered
    text = AutoTokenizer.from_pretrained(qwen3_model).decode(between)
    assert "No. Hint: it starts with 'a'. Guess again." in text
    assert episode.rewards == {"guessed": 1.0}
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "user", "assistant"]


async def test_a_reward_that_raises_is_the_episodes_error(tiny_model_dir: Path) -> None:
    episode, pool = await _episode(_env("vf_broken"), tiny_model_dir, ["maybe"])
    assert episode.stop_reason == "env_error"
    assert episode.error is not None
    assert episode.error.where == "environment"
    assert episode.error.message.startswith("reward: ")
    assert "KeyError" in episode.error.message
    _engine_tokens(episode, pool)  # the model's turn is kept


@pytest.mark.parametrize(
    ("taskset", "args", "renderer", "message"),
    [
        ("no_such_taskset", {}, None, r"environment\.id: .*no_such_taskset"),
        ("vf_reverse", {"bogus": 1}, None, r"environment\.args\.bogus: Extra inputs"),
        ("vf_reverse", {"taskset": {"num_tasks": "x"}}, None, r"args\.taskset\.num_tasks"),
        ("vf_reverse", {"taskset": {"id": "vf_tools"}}, None, r"args\.taskset\.id"),
        ("vf_reverse", {}, {"name": "no-such"}, r"environment\.renderer"),
    ],
)
def test_load_errors_name_the_key(
    taskset: str, args: dict[str, Any], renderer: dict[str, Any] | None, message: str
) -> None:
    with pytest.raises(EnvironmentLoadError, match=message):
        load_environment(taskset, args, kind="verifiers", renderer=renderer)


def test_the_renderer_is_only_for_verifiers_environments() -> None:
    with pytest.raises(ValueError, match="renderer: only for kind = 'verifiers'"):
        EnvironmentConfig(renderer={"name": "qwen3"})
    config = EnvironmentConfig(kind="verifiers", id="vf_reverse", renderer={"name": "qwen3"})
    assert config.renderer == {"name": "qwen3"}


def test_the_documented_v1_environment_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 20 lines of docs/environments.md are a taskset sprawl loads as written."""
    text = Path("docs/environments.md").read_text()
    section = text[text.index("## verifiers environments") :]
    code = re.findall(r"```python\n(.*?)```", section, re.DOTALL)[0]
    assert len([line for line in code.splitlines() if line.strip()]) <= 20
    (tmp_path / "doc_reverse.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = _env("doc_reverse")
    assert env.tasks()["id"] == ["0", "1", "2"]
    assert env.task(dict(env.tasks()[1])).data.answer == "nretnal"
