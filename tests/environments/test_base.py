"""The Environment base: schemas from type hints, bad model output as data, rewards, penalties."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from structlog.testing import capture_logs

from environments.base import EnvConfig, Environment, EpisodeState, Message, reward, tool
from environments.errors import EnvDefinitionError, EnvironmentLoadError, RewardError
from environments.scripted import play
from environments.types import Penalties
from policies.wire.toolcalls import ToolCall

pytestmark = pytest.mark.anyio


class Point(BaseModel):
    x: int
    y: int = 0


class Box(BaseModel):
    """A box."""

    width: float = Field(gt=0)
    label: str


class Toy(Environment):
    name = "toy"

    def generate_tasks(self) -> list[dict[str, Any]]:
        return [{"id": "t0", "answer": "42"}]

    def initial_messages(self, task: dict[str, Any]) -> list[Message]:
        return [{"role": "user", "content": "go"}]

    @tool
    def add(self, a: int, b: int = 1) -> int:
        """Add two integers.

        More prose that is not part of the description.

        Args:
            a: the first addend,
                which may be negative
            b: the second addend
        """
        return a + b

    @tool
    def pick(self, mode: Literal["up", "down"], title: str, at: Point) -> dict[str, Any]:
        """Pick a mode at a point."""
        return {"mode": mode, "title": title, "x": at.x}

    @tool
    def measure(self, box: Box) -> Box:
        """Measure a box."""
        return box.model_copy(update={"width": box.width * 2})

    @tool
    async def crash(self, n: Annotated[int, Field(ge=0)]) -> str:
        """Always fails."""
        raise ZeroDivisionError(f"cannot split {n}")

    @tool
    async def sleepy(self) -> str:
        """Never answers (a hung tool)."""
        await anyio.sleep_forever()
        return "late"

    @tool
    def shout(self, text: str) -> str:
        """Repeat text a lot."""
        return text * 10_000

    @reward(weight=1.0)
    def exact(self, state: EpisodeState) -> float:
        return float(state.final_answer == state.task["answer"])

    @reward(weight=0.5)
    async def used_tools(self, state: EpisodeState) -> float:
        return float(any(err is None for _, _, err in state.tool_results))


def _call(name: str, **args: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def _schemas(env: Environment) -> dict[str, dict[str, Any]]:
    return {s["function"]["name"]: s["function"] for s in env.tool_schemas()}


def test_schema_from_hints_defaults_and_args_section() -> None:
    add = _schemas(Toy(EnvConfig()))["add"]
    assert add["description"] == "Add two integers."
    params = add["parameters"]
    assert params["required"] == ["a"]
    assert params["properties"]["a"] == {
        "type": "integer",
        "description": "the first addend, which may be negative",
    }
    assert params["properties"]["b"] == {
        "type": "integer",
        "default": 1,
        "description": "the second addend",
    }
    assert params["additionalProperties"] is False
    assert "title" not in params


def test_schema_of_literals_nested_and_single_models() -> None:
    schemas = _schemas(Toy(EnvConfig()))
    pick = schemas["pick"]["parameters"]
    assert pick["properties"]["mode"] == {"enum": ["up", "down"], "type": "string"}
    assert pick["properties"]["title"] == {"type": "string"}  # a parameter named title survives
    assert pick["$defs"]["Point"]["required"] == ["x"]
    measure = schemas["measure"]["parameters"]  # the model's fields are the arguments
    assert set(measure["properties"]) == {"width", "label"}
    assert measure["properties"]["width"]["exclusiveMinimum"] == 0
    assert schemas["crash"]["parameters"]["properties"]["n"]["minimum"] == 0


async def test_tools_get_validated_values() -> None:
    env = Toy(EnvConfig())
    assert await env.call_tool(ToolCall("c", "add", '{"a": 2}')) == ("3", None)
    result, err = await env.call_tool(
        ToolCall("c", "pick", '{"mode": "up", "title": "t", "at": {"x": 7}}')
    )
    assert err is None
    assert json.loads(result) == {"mode": "up", "title": "t", "x": 7}
    result, err = await env.call_tool(ToolCall("c", "measure", '{"width": 1.5, "label": "a"}'))
    assert err is None
    assert json.loads(result) == {"width": 3.0, "label": "a"}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("<tool_call>\n{not json}\n</tool_call>", "not valid JSON"),
        ("<tool_call>\n" + '{"name": "add"', "never closed"),
        (_call("rm", path="/"), "unknown tool 'rm'"),
        (_call("add", a="many"), "bad argument a"),
        (_call("add", a=1, c=2), "bad argument c"),
        (_call("pick", mode="sideways", title="t", at={"x": 1}), "bad argument mode"),
        (_call("measure", width=-1, label="a"), "bad argument width"),
    ],
)
async def test_bad_model_output_is_an_observation_and_counted(text: str, needle: str) -> None:
    env = Toy(EnvConfig(penalties=Penalties(bad_call=0.25)))
    played = await play(env, env.tasks()[0], [text, "42"])
    obs = played.replies[0].messages[0]
    assert obs["role"] == "tool"
    assert obs["content"].startswith("error: ")
    assert needle in obs["content"]
    assert not played.replies[0].done
    assert played.replies[1].done
    assert played.state.bad_calls == 1
    assert played.rewards == {"exact": 1.0, "used_tools": 0.0, "penalty_bad_calls": 1.0}
    assert played.reward == pytest.approx(1.0 - 0.25)


async def test_tool_exception_is_recorded_with_type_and_message() -> None:
    env = Toy(EnvConfig())
    with capture_logs() as logs:
        played = await play(env, env.tasks()[0], [_call("crash", n=3), "42"])
    assert played.replies[0].messages[0]["content"] == "error: ZeroDivisionError: cannot split 3"
    ((call, result, err),) = played.state.tool_results
    assert (call.name, result, err) == ("crash", "", "ZeroDivisionError: cannot split 3")
    assert played.state.bad_calls == 0  # the tool's bug is not the model's fault
    assert any(e["event"] == "env.tool_raised" and e["type"] == "ZeroDivisionError" for e in logs)


async def test_tool_timeout_and_output_cap_and_call_cap() -> None:
    env = Toy(EnvConfig(max_tool_output_chars=100, max_tool_calls_per_turn=2))
    env.tool_timeout_s = 0.05
    text = _call("sleepy") + _call("shout", text="ab") + _call("add", a=1)
    with anyio.fail_after(10):  # a tool timeout that did not hold would hang here
        played = await play(env, env.tasks()[0], [text])
    sleepy, shout, capped = (m["content"] for m in played.replies[0].messages)
    assert "timed out after 0.05s (timeouts.tool_s)" in sleepy
    assert shout.startswith("ab" * 50)
    assert shout.endswith("[... 19900 more characters cut]")
    assert "only 2 tool calls run per message" in capped
    assert played.state.bad_calls == 1
    assert played.state.stop_reason == "max_turns"


async def test_penalties_for_unfinished_and_empty_answers() -> None:
    cfg = EnvConfig(penalties=Penalties(unfinished=0.5, empty_answer=0.3))
    env = Toy(cfg)
    unfinished = await play(env, env.tasks()[0], [_call("add", a=1)])
    assert unfinished.rewards["penalty_unfinished"] == 1.0
    assert unfinished.reward == pytest.approx(0.5 - 0.5)  # used_tools 0.5, minus the penalty
    empty = await play(env, env.tasks()[0], [""])
    assert empty.state.stop_reason == "done"
    assert empty.state.final_answer == ""
    assert empty.rewards["penalty_empty_answer"] == 1.0
    assert empty.reward == pytest.approx(-0.3)


async def test_reward_weights_override_and_unknown_names() -> None:
    env = Toy(EnvConfig(reward_weights={"exact": 3.0}))
    assert env.reward_weights() == {"exact": 3.0, "used_tools": 0.5}
    played = await play(env, env.tasks()[0], ["42"])
    assert played.reward == 3.0
    with pytest.raises(
        EnvironmentLoadError, match=r"reward_weights: unknown reward\(s\) \['exat'\]"
    ):
        Toy(EnvConfig(reward_weights={"exat": 1.0}))


async def test_reward_exception_names_reward_type_and_message() -> None:
    class Broken(Toy):
        @reward(weight=1.0)
        def exact(self, state: EpisodeState) -> float:
            return 1 / 0

    env = Broken(EnvConfig())
    with pytest.raises(RewardError, match=r"'exact' raised ZeroDivisionError: division by zero"):
        await play(env, env.tasks()[0], ["42"])


def test_tool_definition_errors_are_caught_at_construction() -> None:
    class NoHint(Toy):
        @tool
        def bad(self, x) -> str:  # type: ignore[no-untyped-def]
            """No hint."""
            return str(x)

    class Star(Toy):
        @tool
        def bad(self, *xs: int) -> str:
            """Varargs."""
            return ""

    class Unresolved(Toy):
        @tool
        def bad(self, x: NotDefinedAnywhere) -> str:  # type: ignore[name-defined]  # noqa: F821
            """Hint names nothing."""
            return ""

    with pytest.raises(EnvDefinitionError, match="cannot resolve its type hints"):
        Unresolved(EnvConfig())
    with pytest.raises(EnvDefinitionError, match="'x' needs a type hint"):
        NoHint(EnvConfig())
    with pytest.raises(EnvDefinitionError, match="'xs' must be a named one"):
        Star(EnvConfig())


@settings(max_examples=100, deadline=None)
@given(
    name=st.sampled_from(["add", "pick", "measure", "crash", "nope"]),
    arguments=st.one_of(
        st.text(max_size=40),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(st.sampled_from(["a", "b", "x", "mode", "at"]), inner, max_size=3)
            ),
            max_leaves=8,
        ).map(json.dumps),
    ),
)
def test_no_argument_text_makes_a_tool_call_raise(name: str, arguments: str) -> None:
    env = Toy(EnvConfig())

    async def call() -> tuple[str, str | None]:
        return await env.call_tool(ToolCall("c", name, arguments))

    result, err = anyio.run(call)
    assert err is None or (result == "" and err)
