"""Structured logging set-up: structlog, pretty on a terminal, JSON lines otherwise.

Every process of a run (orchestrator, engines) calls :func:`configure` once at start-up. Context
is bound per component / episode with ``structlog.contextvars.bound_contextvars``. Logs go to
stderr so that stdout stays free for command output — to ``sys.stderr`` as it is when a line is
written, so that a live view redirecting it prints them above itself.
"""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, TextIO, cast

import structlog

LogFormat = Literal["auto", "pretty", "json"]


def configure(fmt: LogFormat = "auto", level: str = "info") -> None:
    """Configure structlog (and the stdlib root logger) for this process."""
    pretty = sys.stderr.isatty() if fmt == "auto" else fmt == "pretty"
    numeric = logging.getLevelNamesMapping()[level.upper()]
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer() if pretty else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks if not pretty else _identity,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, _CurrentStderr())),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr, force=True)


class _CurrentStderr(io.TextIOBase):
    """``sys.stderr`` as it is at each write, not as it was at :func:`configure`: a live view
    (``rich.live.Live``) swaps it for a proxy that prints above its region while it draws, so
    log lines land above the view instead of inside it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _identity(
    _logger: object, _name: str, event: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    return event


@contextmanager
def quiet_logs() -> Iterator[None]:
    """Only warnings and errors while the block runs (benchmarks silence per-patch info lines
    while measuring); the previous structlog configuration is restored after."""
    old = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        yield
    finally:
        structlog.configure(**old)
