"""Task sources: generated, local files in four formats, saved datasets; errors name the key."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset, DatasetDict

from environments.base import EnvConfig, Environment, Message
from environments.errors import EnvironmentLoadError, TaskSourceError
from environments.loader import load_environment

ROWS = [{"id": f"r{i}", "question": f"q{i}", "answer": i} for i in range(5)]


class Quiz(Environment):
    name = "quiz"
    task_columns = ("question", "answer")

    def generate_tasks(self) -> list[dict[str, Any]]:
        return [{"id": f"g{i}", "question": "?", "answer": i} for i in range(self.config.num_tasks)]

    def initial_messages(self, task: dict[str, Any]) -> list[Message]:
        return [{"role": "user", "content": str(task["question"])}]


def _load(tasks: object, **args: object) -> Environment:
    return load_environment("tests.environments.test_tasks:Quiz", {"tasks": tasks, **args})


def _write(tmp_path: Path, fmt: str, rows: list[dict[str, Any]] = ROWS) -> Path:
    path = tmp_path / f"tasks.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        header = list(rows[0])
        lines = [",".join(header), *(",".join(str(r[k]) for k in header) for r in rows)]
        path.write_text("\n".join(lines) + "\n")
    else:
        Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_generated_source_and_limit() -> None:
    env = _load({"source": "generated", "limit": 3}, num_tasks=10)
    assert env.tasks()["id"] == ["g0", "g1", "g2"]
    assert env.tasks() is env.tasks()  # loaded once


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_file_sources_in_every_format(tmp_path: Path, fmt: str) -> None:
    env = _load({"source": "files", "path": str(_write(tmp_path, fmt))})
    ds = env.tasks()
    assert ds["id"] == [r["id"] for r in ROWS]
    assert [int(a) for a in ds["answer"]] == [r["answer"] for r in ROWS]


def test_several_files_and_an_explicit_format(tmp_path: Path) -> None:
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    a.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    b.write_text("".join(json.dumps(r) + "\n" for r in ROWS[2:]))
    env = _load({"source": "files", "path": [str(a), str(b)], "format": "jsonl", "limit": 4})
    assert env.tasks()["id"] == ["r0", "r1", "r2", "r3"]


def test_saved_dataset_and_dataset_dict(tmp_path: Path) -> None:
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert len(_load({"source": "saved", "path": str(tmp_path / "one")}).tasks()) == 5
    DatasetDict(
        {"train": Dataset.from_list(ROWS[:3]), "test": Dataset.from_list(ROWS[3:])}
    ).save_to_disk(str(tmp_path / "dict"))
    env = _load({"source": "saved", "path": str(tmp_path / "dict"), "split": "test"})
    assert env.tasks()["id"] == ["r3", "r4"]
    with pytest.raises(
        TaskSourceError, match=r"environment\.args\.tasks\.split: .*\['test', 'train'\]"
    ):
        _load({"source": "saved", "path": str(tmp_path / "dict")}).tasks()
    with pytest.raises(TaskSourceError, match=r"environment\.args\.tasks\.split: .*single dataset"):
        _load({"source": "saved", "path": str(tmp_path / "one"), "split": "train"}).tasks()


KEY = r"environment\.args\.tasks"


@pytest.mark.parametrize(
    ("tasks", "pattern"),
    [
        ({"source": "files", "path": "/no/such.jsonl"}, rf"{KEY}\.files\.path: .*no such file"),
        ({"source": "saved", "path": "/no/such"}, rf"{KEY}\.saved\.path: .*no such directory"),
        ({"source": "web", "path": "x"}, rf"{KEY}: .*'generated', 'files', 'saved'"),
        ({"source": "files"}, rf"{KEY}\.files\.path: Field required"),
        ({"source": "generated", "limit": 0}, rf"{KEY}\.generated\.limit"),
    ],
)
def test_bad_task_config_names_the_key(tasks: dict[str, Any], pattern: str) -> None:
    with pytest.raises(EnvironmentLoadError, match=pattern):
        _load(tasks)


def test_unknown_suffix_asks_for_a_format(tmp_path: Path) -> None:
    path = tmp_path / "tasks.txt"
    path.write_text("{}")
    with pytest.raises(
        EnvironmentLoadError, match=r"environment\.args\.tasks\.files: .*set format"
    ):
        _load({"source": "files", "path": str(path)})


def test_missing_columns_unreadable_files_and_empty_sources(tmp_path: Path) -> None:
    no_answer = _write(tmp_path, "jsonl", [{"id": "x", "question": "q"}])
    with pytest.raises(
        TaskSourceError, match=r"tasks\.path: the tasks lack column\(s\) \['answer'\]"
    ):
        _load({"source": "files", "path": str(no_answer)}).tasks()
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(TaskSourceError, match=r"tasks\.path: cannot read .* as parquet"):
        _load({"source": "files", "path": str(broken)}).tasks()
    (tmp_path / "notsaved").mkdir()
    with pytest.raises(TaskSourceError, match=r"tasks\.path: .* is not a saved dataset"):
        _load({"source": "saved", "path": str(tmp_path / "notsaved")}).tasks()

    class NoTasks(Quiz):
        def generate_tasks(self) -> list[dict[str, Any]]:
            return [{"id": "only", "question": "?"}]

    with pytest.raises(TaskSourceError, match=r"tasks \(generated\): .* \['answer'\]"):
        NoTasks(EnvConfig()).tasks()


def test_an_environment_without_a_generator_says_which_key_to_set() -> None:
    class FilesOnly(Environment):
        pass

    with pytest.raises(NotImplementedError, match=r"set environment\.args\.tasks"):
        FilesOnly(EnvConfig()).tasks()


SHIPPED = sorted(Path("configs").glob("*.toml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_environment_config_validates(path: Path) -> None:
    data = tomllib.loads(path.read_text())
    for env in data.get("environments", [data.get("environment", {})]):  # a mixture, or one
        cls_path = env.get("cls", "environments.calculator:Calculator")
        module, _, name = cls_path.partition(":")
        cls = getattr(__import__(module, fromlist=[name]), name)
        config = cls.Config.model_validate(env.get("args", {}))
        assert isinstance(config, EnvConfig)
