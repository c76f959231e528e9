"""Fault injection at named sites, for ``orchestrate chaos``: inert unless ``SPRAWL_FAULTS`` is set.

Some faults cannot be injected from outside a process at the right instant: a patch damaged on
its way to storage must be damaged *before* the pointer names its version, microseconds after it
is written. Such sites call :func:`mutate`, which returns the data unchanged (one dictionary
lookup) unless the environment variable ``SPRAWL_FAULTS`` holds a JSON list of rules::

    [{"site": "board.write", "match": "*/versions/00000002/from-00000001.patch",
      "action": "corrupt", "times": 1}]

``match`` is an ``fnmatch`` pattern over the site's key (for ``board.write``: the object path);
``times`` (default 1) is how many matching calls are mutated. Actions on the bytes:

- ``corrupt`` — flip one bit in the middle (storage or transfer corruption);
- ``truncate`` — keep the first half (a torn upload);
- ``reorder`` — substitute the bytes of the previous call at this site whose key had the same
  suffix (e.g. another version's patch: a well-formed file in the wrong place).

Sites: ``board.write`` (:meth:`policies.board.store.Store.write`). Each mutation is logged as
``failpoint.fired``. A rule that cannot be parsed raises at the first call, naming the rule.
"""

from __future__ import annotations

import fnmatch
import json
import os
import threading
from dataclasses import dataclass

import structlog

ENV = "SPRAWL_FAULTS"
ACTIONS = ("corrupt", "truncate", "reorder")

log = structlog.get_logger(__name__)


@dataclass
class _Rule:
    site: str
    match: str
    action: str
    times: int


_lock = threading.Lock()
_rules: list[_Rule] | None = None
_last: dict[tuple[str, str], bytes] = {}


def _parse(raw: str) -> list[_Rule]:
    try:
        items = json.loads(raw)
        if not isinstance(items, list):
            raise ValueError("not a JSON list")
        rules = [
            _Rule(str(r["site"]), str(r["match"]), str(r["action"]), int(r.get("times", 1)))
            for r in items
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{ENV}: expected a JSON list of rules ({exc}): {raw!r}") from None
    for r in rules:
        if r.action not in ACTIONS:
            raise ValueError(f"{ENV}: unknown action {r.action!r} (one of {', '.join(ACTIONS)})")
    return rules


def _active() -> list[_Rule]:
    global _rules
    if _rules is None:
        raw = os.environ.get(ENV)
        _rules = _parse(raw) if raw else []
    return _rules


def _suffix(key: str) -> str:
    return os.path.splitext(key)[1]


def mutate(site: str, key: str, data: bytes) -> bytes:
    """``data`` as the active rules for ``site`` leave it (unchanged when none match)."""
    rules = _active()
    if not rules:
        return data
    with _lock:
        previous = _last.get((site, _suffix(key)))
        _last[(site, _suffix(key))] = data
        for rule in rules:
            if rule.site != site or rule.times <= 0 or not fnmatch.fnmatch(key, rule.match):
                continue
            if (rule.action == "reorder" and previous is None) or not data:
                continue  # nothing to substitute or damage
            rule.times -= 1
            log.warning("failpoint.fired", site=site, key=key, action=rule.action)
            if rule.action == "corrupt":
                mid = len(data) // 2
                return data[:mid] + bytes([data[mid] ^ 0x10]) + data[mid + 1 :]
            if rule.action == "truncate":
                return data[: len(data) // 2]
            assert previous is not None
            return previous
    return data


def reset() -> None:
    """Forget the parsed rules and history (tests change ``SPRAWL_FAULTS`` between cases)."""
    global _rules
    with _lock:
        _rules = None
        _last.clear()
