"""Waiting for a log event instead of sleeping: what a test of a background task waits on."""

from __future__ import annotations

import threading
from collections.abc import MutableMapping
from typing import Any

import anyio


class Logged:
    """A structlog processor that records every entry and wakes whoever waits for one: pass it
    to ``structlog.testing.capture_logs(processors=[logged])``. Entries may come from any
    thread (a sidecar logs from its reconcile task and from worker threads)."""

    def __init__(self) -> None:
        self._seen = threading.Condition()
        self.entries: list[dict[str, Any]] = []

    def __call__(
        self, logger: object, method: str, entry: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        with self._seen:
            self.entries.append(dict(entry))
            self._seen.notify_all()
        return entry

    def _first(self, event: str, fields: dict[str, object]) -> dict[str, Any] | None:
        return next(
            (
                e
                for e in self.entries
                if e["event"] == event and all(e.get(k) == v for k, v in fields.items())
            ),
            None,
        )

    async def until(self, event: str, timeout_s: float = 20.0, **fields: object) -> dict[str, Any]:
        """The first entry ``event`` whose ``fields`` are those given, once it is logged; an
        ``AssertionError`` if it is not within ``timeout_s``."""

        def wait() -> dict[str, Any] | None:
            with self._seen:
                self._seen.wait_for(lambda: self._first(event, fields) is not None, timeout_s)
                return self._first(event, fields)

        found = await anyio.to_thread.run_sync(wait)
        assert found is not None, f"no {event} {fields} logged within {timeout_s:g} s"
        return found
