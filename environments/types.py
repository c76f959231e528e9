"""Vocabulary of the environments package: configs, task sources, episode state and replies.

No I/O and nothing heavier than pydantic: every other module of the package depends on this one.

- :class:`EnvConfig` is the base of every environment's config model (``[environment.args]``);
  subclasses add their own fields. It always carries ``tasks`` (where the tasks come from, a
  union discriminated on ``source``) and ``penalties`` (what bad model output costs).
- :class:`EpisodeState` is what an environment knows about the episode in progress; the episode
  runner sets ``stop_reason`` before the rewards are computed.
- :class:`Reply` is an environment's answer to one model message: tool results and/or user
  turns, and whether the episode ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from policies.wire.toolcalls import Message, ToolCall

FileFormat = Literal["json", "jsonl", "csv", "parquet"]
"""Local task-file formats (``json`` and ``jsonl`` both use the datasets ``json`` builder)."""

_SUFFIX_FORMAT: dict[str, FileFormat] = {
    ".json": "json",
    ".jsonl": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class GeneratedTasks(_Strict):
    """Tasks made by the environment's ``generate_tasks()`` (``num_tasks``, ``seed``)."""

    source: Literal["generated"] = "generated"
    limit: int | None = Field(default=None, ge=1)
    """Keep only the first ``limit`` tasks."""


class FileTasks(_Strict):
    """Tasks read from local files with ``datasets.load_dataset(<format>, data_files=...)``."""

    source: Literal["files"] = "files"
    path: list[Path] = Field(min_length=1)
    """One file or a list of files (relative paths are relative to the working directory)."""
    format: FileFormat | None = None
    """File format; inferred from the first file's suffix when unset."""
    limit: int | None = Field(default=None, ge=1)
    """Keep only the first ``limit`` tasks."""

    @model_validator(mode="before")
    @classmethod
    def _one_path_is_a_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("path"), str | Path):
            return {**data, "path": [data["path"]]}
        return data

    @field_validator("path")
    @classmethod
    def _files_exist(cls, paths: list[Path]) -> list[Path]:
        for p in paths:
            if not p.is_file():
                raise ValueError(f"no such file {str(p)!r} (cwd {Path.cwd()})")
        return paths

    @model_validator(mode="after")
    def _format_is_known(self) -> FileTasks:
        if self.format is None:
            suffix = self.path[0].suffix.lower()
            if suffix not in _SUFFIX_FORMAT:
                raise ValueError(
                    f"format: cannot infer the format of {str(self.path[0])!r}; "
                    f"set format to one of {sorted(set(_SUFFIX_FORMAT.values()))}"
                )
            object.__setattr__(self, "format", _SUFFIX_FORMAT[suffix])
        return self


class SavedTasks(_Strict):
    """Tasks from a dataset directory written by ``Dataset.save_to_disk`` (``load_from_disk``)."""

    source: Literal["saved"] = "saved"
    path: Path
    """The saved dataset's directory."""
    split: str | None = None
    """Split to use when the directory holds a ``DatasetDict`` (required then)."""
    limit: int | None = Field(default=None, ge=1)
    """Keep only the first ``limit`` tasks."""

    @field_validator("path")
    @classmethod
    def _dir_exists(cls, path: Path) -> Path:
        if not path.is_dir():
            raise ValueError(f"no such directory {str(path)!r} (cwd {Path.cwd()})")
        return path


TaskSource = Annotated[GeneratedTasks | FileTasks | SavedTasks, Field(discriminator="source")]
"""Where an environment's tasks come from (``tasks = {source = ...}``)."""


class Penalties(_Strict):
    """What bad model output costs, subtracted from the episode reward (0 disables one)."""

    bad_call: float = Field(default=0.0, ge=0)
    """Per malformed tool-call block, unknown tool, bad arguments or call over the cap."""
    unfinished: float = Field(default=0.0, ge=0)
    """When the episode did not end by the environment's decision (max_turns, context, timeout)."""
    empty_answer: float = Field(default=0.0, ge=0)
    """When the model's final answer is empty."""


class EnvConfig(BaseModel):
    """Base of every environment's config model (``[environment.args]``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    num_tasks: int = Field(default=64, ge=1)
    """Tasks generated for a generated dataset."""
    seed: int = 0
    """Seed of the task generator."""
    tasks: TaskSource = Field(default_factory=GeneratedTasks)
    """Task source: ``{source = "generated"}``, ``{source = "files", path = ...}`` or
    ``{source = "saved", path = ...}``."""
    penalties: Penalties = Field(default_factory=Penalties)
    """Reward subtracted for bad model output."""
    reward_weights: dict[str, float] = Field(default_factory=dict)
    """Override the weight of reward components by name (``{correct = 2.0}``)."""
    max_tool_calls_per_turn: int = Field(default=8, ge=1)
    """Tool calls run per model message; further calls get an error observation."""
    max_tool_output_chars: int = Field(default=4000, ge=16)
    """A tool result longer than this is cut (with a marker) before the model sees it."""


@dataclass
class EpisodeState:
    """What an environment knows about the episode in progress."""

    task: dict[str, Any]
    messages: list[Message]
    turn: int = 0
    final_answer: str | None = None
    """The content of the message that ended the episode (set by the default ``on_answer``)."""
    tool_results: list[tuple[ToolCall, str, str | None]] = field(default_factory=list)
    """``(call, result, error)`` for every call run; ``error`` is ``None`` on success."""
    bad_calls: int = 0
    """Malformed blocks, unknown tools, bad arguments and calls over the per-turn cap."""
    stop_reason: str | None = None
    """Why the episode ended (``done``, ``max_turns``, ...), set by the runner before scoring."""
    data: dict[str, Any] = field(default_factory=dict)
    """Scratch space for the environment's own per-episode bookkeeping."""


@dataclass(frozen=True)
class Reply:
    """The environment's answer to a model message: new messages, and whether the episode ends."""

    messages: list[Message]
    done: bool

    @classmethod
    def user(cls, text: str, *, done: bool = False) -> Reply:
        """A user turn (feedback, a nudge, the next question)."""
        return cls(messages=[{"role": "user", "content": text}], done=done)

    @classmethod
    def end(cls) -> Reply:
        """End the episode with nothing more to say."""
        return cls(messages=[], done=True)
