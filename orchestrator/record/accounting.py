"""Exactly-once accounting of a run's groups, from its logs alone (across restarts).

The rule (``docs/trajectory-schema.md``, "Accounting"): every group id named by an ``admit``
event is accounted for exactly once, as one of

- **dropped** — its group record (the episode records of one frame) says ``dropped``, with a reason;
- **trained** — its group record says ``kept`` and it is in exactly one batch record;
- **unbatched** — its group record says ``kept``, it is in no batch record, and an ``unbatched``
  event lists it (the run ended before a full batch);
- **lost** — it has no group record and a ``lost`` event lists it (it was in flight when the
  orchestrator was killed; the restart recorded it).

Events are read in order: a restart puts every kept, untrained group back into the batcher (a
``resumed`` event's ``restored``) or into the batch it rebuilt (the trainer was one step ahead of
the log), so no ``unbatched`` listing before a ``resumed`` event counts any more (its groups may
be trained, or listed again, later).

:func:`account` reads ``<run_dir>/events`` and ``<run_dir>/trajectories`` (every part, torn tails
skipped) and returns the counts and every violation; it reads, never writes, so it can run on a
run that is still going (groups in flight then show as unaccounted).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.record.events import read_events
from orchestrator.record.frames import iter_records


@dataclass
class Accounting:
    """Where every admitted group ended, and what breaks the exactly-once rule."""

    admitted: list[str] = field(default_factory=list)
    """Group ids of ``admit`` events, in admission order."""
    dropped: dict[str, str] = field(default_factory=dict)
    """Group id → drop reason (from its group record)."""
    trained: dict[str, int] = field(default_factory=dict)
    """Group id → ``produced_version`` of the batch that trained it."""
    unbatched: dict[str, str] = field(default_factory=dict)
    """Kept group id → reason of the ``unbatched`` event that lists it."""
    lost: dict[str, str] = field(default_factory=dict)
    """Group id → reason of the ``lost`` event that lists it."""
    unaccounted: list[str] = field(default_factory=list)
    """Violation: admitted, but none of the four outcomes (silently lost)."""
    duplicated: list[str] = field(default_factory=list)
    """Violation: accounted more than once (recorded twice, two batches, recorded and lost, …)."""
    problems: list[str] = field(default_factory=list)
    """Every violation, one readable line each (also those of groups never admitted, batches)."""
    produced_versions: list[int] = field(default_factory=list)
    """``produced_version`` of every batch record, in log order."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def counts(self) -> dict[str, int]:
        return {
            "admitted": len(self.admitted),
            "dropped": len(self.dropped),
            "trained": len(self.trained),
            "unbatched": len(self.unbatched),
            "lost": len(self.lost),
            "unaccounted": len(self.unaccounted),
            "duplicated": len(self.duplicated),
            "batches": len(self.produced_versions),
        }


@dataclass
class _Groups:
    """What the trajectory log says of each group."""

    decisions: dict[str, set[str]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    times_recorded: Counter[str] = field(default_factory=Counter)
    batches: dict[str, list[int]] = field(default_factory=dict)


def account(run_dir: Path) -> Accounting:
    """Account for every admitted group of the run in ``run_dir`` (see the module docstring)."""
    return account_records(
        read_events(run_dir),
        list(iter_records(run_dir / "trajectories", "episodes")),
        list(iter_records(run_dir / "trajectories", "batches")),
    )


def account_records(
    events: list[dict[str, Any]],
    episodes: list[dict[str, Any]],
    batches: list[dict[str, Any]],
) -> Accounting:
    """:func:`account` on records already read (events in order, episode and batch records)."""
    acc = Accounting()
    lost_listed: Counter[str] = Counter()
    for ev in events:
        kind = ev["kind"]
        if kind == "admit":
            acc.admitted.append(ev.get("group_id") or f"g{ev['index']:06d}")
        elif kind == "unbatched":
            acc.unbatched.update(dict.fromkeys(ev["group_ids"], ev["reason"]))
        elif kind == "resumed":
            acc.unbatched.clear()
        elif kind == "lost":
            acc.lost.update(dict.fromkeys(ev["group_ids"], ev["reason"]))
            lost_listed.update(ev["group_ids"])
    groups = _groups(episodes, batches, acc)
    _check(acc, groups, lost_listed)
    return acc


def _groups(
    episodes: list[dict[str, Any]], batches: list[dict[str, Any]], acc: Accounting
) -> _Groups:
    g = _Groups()
    seen_episodes: Counter[str] = Counter()
    for r in episodes:
        gid = r["decision"]["group_id"]
        g.decisions.setdefault(gid, set()).add(r["decision"]["decision"])
        g.reasons[gid] = r["decision"]["reason"]
        seen_episodes[r["episode"]["id"]] += 1
        g.times_recorded[gid] = max(g.times_recorded[gid], seen_episodes[r["episode"]["id"]])
    for b in batches:
        acc.produced_versions.append(b["produced_version"])
        for gid in b["groups"]:
            g.batches.setdefault(gid, []).append(b["produced_version"])
    return g


def _check(acc: Accounting, g: _Groups, lost_listed: Counter[str]) -> None:
    admitted = Counter(acc.admitted)
    for gid in sorted(set(g.decisions) | set(g.batches) | set(acc.lost) | set(acc.unbatched)):
        if gid not in admitted:
            acc.problems.append(f"{gid}: in the logs but never admitted")
    for gid, n in sorted(admitted.items()):
        outcomes = _outcomes(gid, acc, g, lost_listed)
        repeats = [f"admitted {n} times"] if n > 1 else []
        if g.times_recorded[gid] > 1:
            repeats.append(f"group record written {g.times_recorded[gid]} times")
        if not outcomes:
            acc.unaccounted.append(gid)
            what = "kept but neither trained nor" if gid in g.decisions else "no group record, not"
            acc.problems.append(f"{gid}: unaccounted for ({what} listed in an event)")
        if len(outcomes) > 1 or repeats:
            acc.duplicated.append(gid)
            acc.problems.append(f"{gid}: accounted more than once: {'; '.join(outcomes + repeats)}")
    _check_versions(acc)


def _outcomes(gid: str, acc: Accounting, g: _Groups, lost_listed: Counter[str]) -> list[str]:
    """Every way the logs account for ``gid`` (exactly one is right); fills ``acc``'s maps and
    adds a problem line for an outcome without the record it needs."""
    outcomes: list[str] = []
    decisions = g.decisions.get(gid, set())
    batches = g.batches.get(gid, [])
    if "dropped" in decisions:
        acc.dropped[gid] = g.reasons[gid]
        outcomes.append("dropped")
    for version in batches:
        acc.trained[gid] = version
        outcomes.append(f"trained (version {version})")
    if gid in acc.unbatched:
        outcomes.append("listed unbatched")
    outcomes += ["listed lost"] * lost_listed[gid]
    if (batches or gid in acc.unbatched) and "kept" not in decisions:
        acc.problems.append(f"{gid}: trained or listed unbatched without a kept group record")
    return outcomes


def _check_versions(acc: Accounting) -> None:
    """Each version is produced by exactly one batch record: 1, 2, 3, … with no gap."""
    counts = Counter(acc.produced_versions)
    for version, n in sorted(counts.items()):
        if n > 1:
            acc.problems.append(f"version {version}: {n} batch records")
    if counts:
        missing = sorted(set(range(1, max(counts) + 1)) - set(counts))
        if missing:
            acc.problems.append(f"no batch record for versions {missing}")
