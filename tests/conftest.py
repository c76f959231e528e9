"""Shared fixtures: sprawl's own tiny model (cached per machine, copied per test session)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.support.models import model_copy


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_copy("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_copy("tiny-moe", tmp_path_factory.mktemp("models") / "tiny-moe")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def cli_logging() -> Iterator[None]:
    """For tests that call ``orchestrator.cli.main``: the command line configures logging onto
    the (captured) stderr, which is closed after the test; put the configuration back."""
    root = logging.getLogger()
    handlers, level, config = root.handlers[:], root.level, structlog.get_config()
    yield
    structlog.configure(**config)
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # aiohttp runs on asyncio
