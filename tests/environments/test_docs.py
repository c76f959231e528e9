"""The complete environment in docs/environments.md works as written, loaded by import path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from environments.loader import load_environment
from environments.scripted import play

pytestmark = pytest.mark.anyio


@pytest.fixture
def doc_env_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    text = Path("docs/environments.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.DOTALL)[0]
    (tmp_path / "doc_vowels.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "doc_vowels:Vowels"


def _count(text: str) -> str:
    call = {"name": "count", "arguments": {"text": text}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


async def test_documented_environment_plays_and_scores(doc_env_module: str) -> None:
    env = load_environment(doc_env_module, {"num_tasks": 5, "max_len": 6, "seed": 1})
    tasks = env.tasks()
    assert len(tasks) == 5
    assert all(len(t["word"]) <= 6 for t in tasks)
    task = tasks[0]
    (schema,) = env.tool_schemas()
    assert schema["function"]["parameters"]["properties"]["letters"] == {
        "type": "string",
        "default": "aeiou",
        "description": "the letters to count",
    }
    played = await play(env, task, [_count(task["word"]), "It has 99.", f"{task['answer']}"])
    assert played.replies[0].messages[0]["content"] == str(task["answer"])
    assert played.replies[1].messages == [
        {"role": "user", "content": "That is not right. Count again."}
    ]
    assert played.rewards == {"correct": 1.0, "first_try": 0.0}
    first = await play(env, {"id": "x", "word": "ferry", "answer": 1}, [_count("ferry"), "1"])
    assert first.rewards == {"correct": 1.0, "first_try": 1.0}
    wrong_twice = await play(env, task, ["99", "98", "97"])
    assert len(wrong_twice.replies) == 2
    assert wrong_twice.reward == 0.0
