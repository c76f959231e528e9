"""Retrieval over a small local corpus with ``search`` and ``read`` tools.

The corpus (``corpus``, JSON lines ``{id, title, text}``; the default is a shipped set of short
documents about the fictional Vellmar Isles, so a model cannot answer from memory) is searched by
idf-weighted term overlap. Tasks (``question``, ``answer``, ``doc_id``) come from the shipped
``questions.jsonl`` by default through the ``files`` task source. Rewards: ``correct`` (1.0) when
the final answer contains the gold answer (case and punctuation ignored), ``read_source`` (0.2)
when the model read the document that holds it.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import Field, FilePath

from environments.base import EnvConfig, Environment, EpisodeState, Message, reward, tool
from environments.types import FileTasks, TaskSource

DATA = Path(__file__).parent / "data"


def terms(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower().replace(",", ""))


class RetrievalConfig(EnvConfig):
    corpus: FilePath = DATA / "docs.jsonl"
    """The documents, JSON lines with ``id``, ``title`` and ``text``."""
    tasks: TaskSource = Field(default_factory=lambda: FileTasks(path=[DATA / "questions.jsonl"]))
    """Defaults to the shipped questions (``question``, ``answer``, ``doc_id``)."""
    top_k: int = Field(default=3, ge=1, le=20)
    """Results ``search`` returns."""


class Retrieval(Environment):
    Config = RetrievalConfig
    name = "retrieval"
    task_columns = ("question", "answer", "doc_id")
    config: RetrievalConfig

    def __init__(self, config: RetrievalConfig) -> None:
        super().__init__(config)
        lines = config.corpus.read_text().splitlines()
        self.docs = {d["id"]: d for d in map(json.loads, filter(str.strip, lines))}
        self.terms = {i: set(terms(f"{d['title']} {d['text']}")) for i, d in self.docs.items()}
        self.df = Counter(t for ts in self.terms.values() for t in ts)

    def initial_messages(self, task: dict[str, Any]) -> list[Message]:
        text = f"Use the search and read tools to answer briefly: {task['question']}"
        return [{"role": "user", "content": text}]

    @tool
    def search(self, query: str) -> str:
        """Search the documents; returns the best matches as `id: title` lines.

        Args:
            query: words to look for
        """
        q, n = set(terms(query)), len(self.docs)
        scores = {
            i: sum(math.log(1 + n / self.df[t]) for t in q & ts) for i, ts in self.terms.items()
        }
        best = sorted((i for i in scores if scores[i] > 0), key=lambda i: (-scores[i], i))
        hits = [f"{i}: {self.docs[i]['title']}" for i in best[: self.config.top_k]]
        return "\n".join(hits) or "no matches"

    @tool
    def read(self, doc_id: str) -> str:
        """Read a whole document.

        Args:
            doc_id: a document id returned by search
        """
        if doc_id not in self.docs:
            raise ValueError(f"no document {doc_id!r}; use an id returned by search")
        return str(self.docs[doc_id]["text"])

    @reward(weight=1.0)
    def correct(self, state: EpisodeState) -> float:
        gold = " ".join(terms(state.task["answer"]))
        said = " ".join(terms(state.final_answer or ""))
        return float(f" {gold} " in f" {said} ")

    @reward(weight=0.2)
    def read_source(self, state: EpisodeState) -> float:
        ok = [json.loads(c.arguments) for c, _, err in state.tool_results if err is None]
        return float(any(a.get("doc_id") == state.task["doc_id"] for a in ok))
