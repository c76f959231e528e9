"""Reading what a sandbox probe reported: the probes print one JSON object as their last line."""

from __future__ import annotations

import json

from sandbox.types import ExecResult


def verdict(result: ExecResult) -> dict[str, object]:
    """The JSON object the probe printed last."""
    assert result.killed_reason is None, result
    lines = result.stdout.strip().splitlines()
    assert lines, result
    parsed = json.loads(lines[-1])
    assert isinstance(parsed, dict)
    return parsed
