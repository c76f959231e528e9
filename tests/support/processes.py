"""Running ``orchestrate`` as a user would: commands and the processes they leave."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

LOOP = "tests/support/loop.toml"
"""The small random-init loop most end-to-end tests run (run name ``demo``)."""


def orchestrate_cmd(
    tmp_path: Path,
    model_dir: Path,
    *extra: str,
    command: str | None = None,
    config: str | Path = LOOP,
) -> list[str]:
    """``orchestrate [command] --config CONFIG`` on ``model_dir``, its run directory under
    ``tmp_path``, JSON logs; ``extra`` are more arguments (``--section.key VALUE``)."""
    return [
        sys.executable,
        "-m",
        "orchestrator.cli",
        *([command] if command else []),
        "--config",
        str(config),
        "--run.root",
        str(tmp_path),
        "--model.path",
        str(model_dir),
        "--log-format",
        "json",
        *extra,
    ]


def external_trainer_args(tmp_path: Path) -> list[str]:
    """A board and batch directory that outlive the run directory, shared with the trainer."""
    return [
        "--board.url",
        str(tmp_path / "board"),
        "--trainer.batch_dir",
        str(tmp_path / "batches"),
        "--fleet.local_engines",
        "1",
    ]


def engine_pids(stderr: str) -> list[int]:
    pids = []
    for line in stderr.splitlines():
        if '"engine_started"' in line:
            pids.append(json.loads(line)["pid"])
    return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
