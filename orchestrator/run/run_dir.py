"""The run directory: a fresh one for a new run, the existing one for a resumed run.

A new run never replaces an earlier run's directory unless ``run.overwrite`` says so; the
refusal names when that run started. A fresh directory holds ``config.json``, the resolved
config, before anything else is written: its secrets (tokens) masked, the file readable by its
owner only.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from orchestrator.config import Config
from orchestrator.errors import ConfigError
from orchestrator.record import resume
from orchestrator.record.frames import write_private


def prepare_run_dir(cfg: Config) -> Path:
    """A fresh run directory (with ``config.json``), or the existing one with ``run.resume``."""
    if cfg.run.resume:
        return resume.check_run_dir(cfg)
    run_dir = cfg.run_dir
    if run_dir.exists():
        if not cfg.run.overwrite:
            raise ConfigError(
                f"run.name: {run_dir} holds an earlier run ({_started(run_dir)}); keep it and "
                "start another with --run.name NAME, continue it with --run.resume true, or "
                "replace it (deleting its logs, board and checkpoints) with --run.overwrite true"
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    write_private(run_dir / "config.json", cfg.model_dump_json(indent=2))  # secrets masked
    return run_dir


def _started(run_dir: Path) -> str:
    config = run_dir / "config.json"
    if not config.exists():
        return "no config.json: not a complete run directory"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(config.stat().st_mtime))
    return f"started {when}"
