"""Retrieval over the shipped corpus with search and read, under scripted policies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from environments.errors import EnvironmentLoadError
from environments.loader import load_environment
from environments.retrieval import DATA, Retrieval, RetrievalConfig
from environments.scripted import play

pytestmark = pytest.mark.anyio


def _call(name: str, **args: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.fixture(scope="module")
def env() -> Retrieval:
    return Retrieval(RetrievalConfig())


def _task(env: Retrieval, task_id: str) -> dict[str, object]:
    return next(t for t in env.tasks() if t["id"] == task_id)


async def test_search_read_answer_gets_full_reward(env: Retrieval) -> None:
    task = _task(env, "q13")  # who designed the tidal mill at Harrow Sound
    played = await play(
        env,
        task,
        [_call("search", query="tidal mill Harrow Sound designer"),
         _call("read", doc_id="d19"),
         "It was designed by Tobin Vass."],
    )  # fmt: skip
    hits = played.replies[0].messages[0]["content"].splitlines()
    assert "d19: Harrow Sound tidal mill" in hits
    assert len(hits) == 3
    assert "Tobin Vass" in played.replies[1].messages[0]["content"]
    assert played.rewards == {"correct": 1.0, "read_source": 1.0}
    assert played.reward == pytest.approx(1.2)


async def test_answer_from_memory_and_wrong_doc(env: Retrieval) -> None:
    task = _task(env, "q17")  # the Isles Council has 21 members
    played = await play(env, task, [_call("read", doc_id="d01"), "It has 121 members."])
    assert played.rewards == {"correct": 0.0, "read_source": 0.0}
    played = await play(env, task, ["21"])
    assert played.rewards == {"correct": 1.0, "read_source": 0.0}


async def test_bad_ids_and_queries_are_observations(env: Retrieval) -> None:
    task = _task(env, "q01")
    played = await play(
        env, task, [_call("read", doc_id="d99") + _call("search", query="zzz") + _call("search")]
    )
    read, search, missing = (m["content"] for m in played.replies[0].messages)
    assert read == "error: ValueError: no document 'd99'; use an id returned by search"
    assert search == "no matches"
    assert missing.startswith("error: bad argument query: Field required")
    assert played.state.bad_calls == 1


def test_every_question_is_answered_by_its_document(env: Retrieval) -> None:
    tasks = env.tasks()
    assert len(tasks) >= 20
    assert len(env.docs) >= 30
    for task in tasks:
        doc = env.docs[task["doc_id"]]
        assert task["answer"].lower() in doc["text"].lower(), task["id"]
        # the question's own words find its document among the top results
        top = env.search(task["question"]).splitlines()
        assert any(line.startswith(f"{task['doc_id']}:") for line in top), task["id"]


def test_corpus_and_tasks_are_configurable() -> None:
    assert (DATA / "docs.jsonl").is_file()
    env = Retrieval(RetrievalConfig.model_validate({"tasks": {"source": "generated"}}))
    with pytest.raises(NotImplementedError, match=r"environment\.args\.tasks"):
        env.tasks()


def test_missing_corpus_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(EnvironmentLoadError, match=r"environment\.args\.corpus: Path does not"):
        load_environment("environments.retrieval:Retrieval", {"corpus": str(tmp_path / "x")})
