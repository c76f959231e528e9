"""What must hold after any fault, checked from a run's logs, its board and the process table.

- **exactly once**: every admitted group is dropped (with a reason), trained in exactly one
  batch, listed as unbatched at the end, or recorded as lost in flight — never silently missing
  (``lost``) or counted twice (``duplicated``) (:func:`orchestrator.record.accounting.account`);
- **in bounds**: every model call's response was stamped with a version inside the bounds its
  request carried (``segments[].bounds`` in the trajectory log);
- **verified**: every (endpoint, version) that served a call was activated on that island with
  the board's digest of that version (``version_activated`` in the engine's log), so no island
  served bits whose checksums failed;
- **progress**: the trainer's newest version on the board reached ``trainer.max_steps``;
- **no orphans**: no process of the run (the orchestrator, engines, trainer, sandboxes, seen by
  the harness while the run went on) is alive after it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.record.accounting import account
from orchestrator.record.frames import iter_records
from policies.board import Board
from policies.errors import BoardError


@dataclass
class Verdict:
    episodes: int = 0
    """Admitted episodes (admitted groups × group size)."""
    lost: int = 0
    """Admitted episodes neither trained nor recorded with a reason."""
    duplicated: int = 0
    """Episodes accounted more than once."""
    failed_or_dropped: int = 0
    """Episodes recorded with an error, or in a group dropped or lost with a recorded reason."""
    wrong_version: int = 0
    """Model calls answered at a version outside their request's bounds."""
    unverified: int = 0
    """Model calls served by an island at a version it never activated with the board's digest."""
    final_version: int | None = None
    leftover: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def activations(log_dir: Path) -> dict[str, dict[int, set[str | None]]]:
    """Per engine log (``engine-<i>``): version → digests it activated (across restarts)."""
    out: dict[str, dict[int, set[str | None]]] = {}
    for path in sorted(log_dir.glob("engine-*.log")):
        seen: dict[int, set[str | None]] = defaultdict(set)
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # tracebacks and other non-JSON lines
            if isinstance(rec, dict) and rec.get("event") == "version_activated":
                seen[int(rec["version"])].add(rec.get("digest"))
        out[path.stem] = dict(seen)
    return out


def check(
    run_dir: Path,
    board: Board,
    *,
    group_size: int,
    max_steps: int,
    aliases: dict[str, str] | None = None,
    leftover: list[str] | None = None,
) -> Verdict:
    """Every invariant of the run in ``run_dir``; ``aliases`` maps endpoint ids to the engine
    behind them (a proxy in front of ``engine-0``), ``leftover`` the processes still alive."""
    v = Verdict(leftover=list(leftover or []))
    acc = account(run_dir)
    v.episodes = len(acc.admitted) * group_size
    v.lost = len(acc.unaccounted) * group_size
    v.duplicated = len(acc.duplicated) * group_size
    v.problems += [f"accounting: {p}" for p in acc.problems]
    digests: dict[int, str | None] = {}
    activated = activations(run_dir / "logs")
    errors = 0
    for rec in iter_records(run_dir / "trajectories", "episodes"):
        ep = rec["episode"]
        errors += ep.get("error") is not None or rec["decision"]["decision"] == "dropped"
        for seg in ep["segments"]:
            start, bounds = seg["policy_version"]["start"], seg.get("bounds") or {}
            lo, hi = bounds.get("min"), bounds.get("max")
            if (lo is not None and start < lo) or (hi is not None and start > hi):
                v.wrong_version += 1
                v.problems.append(f"{ep['id']}: served at v{start} outside [{lo}, {hi}]")
            engine = (aliases or {}).get(seg["endpoint"], seg["endpoint"])
            if engine not in activated:
                continue  # not one of the run's local engines: its log is not ours to read
            if start not in digests:
                digests[start] = _digest(board, start)
            if digests[start] not in activated[engine].get(start, set()):
                v.unverified += 1
                v.problems.append(
                    f"{ep['id']}: {seg['endpoint']} served v{start} without activating it "
                    "with the board's digest"
                )
    v.failed_or_dropped = errors + len(acc.lost) * group_size
    v.final_version = max(board.versions(), default=None)  # a real version, not a bare pointer
    if v.final_version is None or v.final_version < max_steps:
        v.problems.append(f"the trainer reached v{v.final_version}, not v{max_steps}")
    v.problems += [f"left running: {p}" for p in v.leftover]
    return v


def _digest(board: Board, version: int) -> str | None:
    try:
        return board.manifest(version).digest
    except BoardError:
        return None
