"""Loading an environment's tasks from its configured source into a ``datasets.Dataset``.

Sources (``[environment.args] tasks = {source = ...}``): ``generated`` calls the environment's
``generate_tasks()``; ``files`` reads local json / jsonl / csv / parquet files with
``datasets.load_dataset(<format>, data_files=...)``; ``saved`` reads a directory written by
``save_to_disk`` with ``datasets.load_from_disk``.

Guarantees: the returned dataset is non-empty and has every required column (always ``id``);
any problem raises :class:`~environments.errors.TaskSourceError` whose message starts with the
config key to change (``environment.args.tasks...``). Reading is done once per call; callers
cache (``Environment.tasks`` does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import datasets
from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

from environments.errors import TaskSourceError
from environments.types import FileTasks, GeneratedTasks, SavedTasks

KEY = "environment.args.tasks"


def load_tasks(
    source: GeneratedTasks | FileTasks | SavedTasks,
    generate: Callable[[], Dataset | list[dict[str, Any]]],
    *,
    required: Sequence[str] = ("id",),
) -> Dataset:
    """The tasks ``source`` describes, checked for ``required`` columns and cut to its limit."""
    if isinstance(source, GeneratedTasks):
        made = generate()
        ds = Dataset.from_list(made) if isinstance(made, list) else made
        where = f"{KEY} (generated)"
    elif isinstance(source, FileTasks):
        ds = _read_files(source)
        where = f"{KEY}.path"
    else:
        ds = _read_saved(source)
        where = f"{KEY}.path"
    missing = [c for c in ("id", *required) if c not in ds.column_names]
    if missing:
        raise TaskSourceError(
            f"{where}: the tasks lack column(s) {sorted(set(missing))}; they have {ds.column_names}"
        )
    if len(ds) == 0:
        raise TaskSourceError(f"{where}: the task source holds no tasks")
    if source.limit is not None and source.limit < len(ds):
        ds = ds.select(range(source.limit))
    return ds


@contextmanager
def _quiet() -> Iterator[None]:
    """No datasets progress bars on stderr (they would interleave with structured logs)."""
    was_disabled = datasets.is_progress_bar_enabled() is False
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _read_files(source: FileTasks) -> Dataset:
    builder = "json" if source.format in ("json", "jsonl") else source.format
    assert builder is not None  # FileTasks infers the format at validation
    files = [str(p) for p in source.path]
    try:
        with _quiet():
            ds = load_dataset(builder, data_files=files, split="train")
    except Exception as exc:  # third-party errors are converted at the edge
        raise TaskSourceError(
            f"{KEY}.path: cannot read {files} as {source.format}: {type(exc).__name__}: {exc}"
        ) from exc
    assert isinstance(ds, Dataset)
    return ds


def _read_saved(source: SavedTasks) -> Dataset:
    try:
        with _quiet():
            loaded = load_from_disk(str(source.path))
    except Exception as exc:  # third-party errors are converted at the edge
        raise TaskSourceError(
            f"{KEY}.path: {str(source.path)!r} is not a saved dataset: {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(loaded, DatasetDict):
        if source.split is None or source.split not in loaded:
            raise TaskSourceError(
                f"{KEY}.split: {str(source.path)!r} holds splits {sorted(loaded)}; "
                f"set split to one of them (got {source.split!r})"
            )
        return loaded[source.split]
    if source.split is not None:
        raise TaskSourceError(
            f"{KEY}.split: {str(source.path)!r} holds a single dataset, not splits; remove split"
        )
    assert isinstance(loaded, Dataset)
    return loaded
