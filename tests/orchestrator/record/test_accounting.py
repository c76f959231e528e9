"""Exactly-once accounting from the logs: a faithful log passes, each kind of violation is named."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from orchestrator.record.accounting import account, account_records
from orchestrator.record.events import EventLog
from orchestrator.record.trajlog import TrajectoryLog
from orchestrator.types import Batch
from tests.support.trajectories import make_group


def _admit(i: int) -> dict[str, Any]:
    return {"kind": "admit", "index": i, "group_id": f"g{i:06d}", "task_id": f"t{i}"}


def _record(gid: str, decision: str, *, episodes: int = 2) -> list[dict[str, Any]]:
    reason = "" if decision == "kept" else "lag max exceeds staleness.drop.max_lag=1"
    return [
        {
            "decision": {"group_id": gid, "decision": decision, "reason": reason},
            "episode": {"id": f"{gid}-{i}"},
        }
        for i in range(episodes)
    ]


def _batch(version: int, *gids: str) -> dict[str, Any]:
    return {"produced_version": version, "groups": list(gids)}


def _faithful() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """g0..g5 admitted: g2 dropped, g0 g1 and g3 g4 trained, g5 kept at the end (unbatched)."""
    events = [{"kind": "run"}] + [_admit(i) for i in range(6)]
    events.append({"kind": "unbatched", "group_ids": ["g000005"], "reason": "max_steps"})
    episodes = [
        r
        for gid, d in [
            ("g000000", "kept"),
            ("g000001", "kept"),
            ("g000002", "dropped"),
            ("g000003", "kept"),
            ("g000004", "kept"),
            ("g000005", "kept"),
        ]
        for r in _record(gid, d)
    ]
    batches = [_batch(1, "g000000", "g000001"), _batch(2, "g000003", "g000004")]
    return events, episodes, batches


def test_a_faithful_log_accounts_for_every_group_once() -> None:
    acc = account_records(*_faithful())
    assert acc.ok, acc.problems
    assert acc.counts() == {
        "admitted": 6,
        "dropped": 1,
        "trained": 4,
        "unbatched": 1,
        "lost": 0,
        "unaccounted": 0,
        "duplicated": 0,
        "batches": 2,
    }
    assert acc.trained == {"g000000": 1, "g000001": 1, "g000003": 2, "g000004": 2}
    assert acc.dropped == {"g000002": "lag max exceeds staleness.drop.max_lag=1"}


def test_a_group_admitted_without_any_record_is_unaccounted() -> None:
    events, episodes, batches = _faithful()
    events.append(_admit(6))  # in flight when the process was killed; no restart recorded it
    acc = account_records(events, episodes, batches)
    assert acc.unaccounted == ["g000006"]
    assert not acc.duplicated
    assert acc.problems == ["g000006: unaccounted for (no group record, not listed in an event)"]


def test_a_kept_group_neither_trained_nor_listed_is_unaccounted() -> None:
    events, episodes, batches = _faithful()
    events = [e for e in events if e["kind"] != "unbatched"]
    acc = account_records(events, episodes, batches)
    assert acc.unaccounted == ["g000005"]


def test_a_lost_event_accounts_for_an_in_flight_group() -> None:
    events, episodes, batches = _faithful()
    events += [_admit(6), {"kind": "lost", "group_ids": ["g000006"], "reason": "in flight"}]
    acc = account_records(events, episodes, batches)
    assert acc.ok, acc.problems
    assert acc.lost == {"g000006": "in flight"}


def test_every_kind_of_double_accounting_is_a_duplicate() -> None:
    events, episodes, batches = _faithful()
    batches.append(_batch(3, "g000000", "g000005"))  # g0 trained twice; g5 also unbatched
    episodes += _record("g000003", "kept")  # g3's group record written twice
    events.append({"kind": "lost", "group_ids": ["g000004"], "reason": "in flight"})  # recorded
    acc = account_records(events, episodes, batches)
    assert acc.duplicated == ["g000000", "g000003", "g000004", "g000005"]
    assert not acc.unaccounted
    assert "g000000: accounted more than once: trained (version 1); trained (version 3)" in (
        acc.problems
    )


def test_a_group_recorded_twice_and_never_trained_is_both_unaccounted_and_duplicated() -> None:
    events, episodes, batches = _faithful()
    events = [e for e in events if e["kind"] != "unbatched"]
    episodes += _record("g000005", "kept")
    acc = account_records(events, episodes, batches)
    assert acc.unaccounted == acc.duplicated == ["g000005"]


def test_a_trained_dropped_group_and_a_stray_record_are_problems() -> None:
    events, episodes, batches = _faithful()
    batches[0]["groups"] = ["g000000", "g000002"]  # g2 was dropped; g1 silently vanished
    episodes += _record("g000099", "kept")  # never admitted
    acc = account_records(events, episodes, batches)
    assert "g000002: accounted more than once: dropped; trained (version 1)" in acc.problems
    assert "g000002: trained or listed unbatched without a kept group record" in acc.problems
    assert "g000099: in the logs but never admitted" in acc.problems
    assert acc.unaccounted == ["g000001"]


def test_a_missing_or_repeated_batch_version_is_a_problem() -> None:
    events, episodes, batches = _faithful()
    batches[1]["produced_version"] = 3
    assert "no batch record for versions [2]" in account_records(events, episodes, batches).problems
    batches[1]["produced_version"] = 1
    assert "version 1: 2 batch records" in account_records(events, episodes, batches).problems


def test_a_restart_restores_unbatched_groups_that_are_trained_later() -> None:
    events, episodes, batches = _faithful()
    events += [
        {"kind": "run"},
        {"kind": "resumed", "restored": ["g000005"], "trainer_version": 2},
        _admit(6),
    ]
    episodes += _record("g000006", "kept")
    batches.append(_batch(3, "g000005", "g000006"))
    acc = account_records(events, episodes, batches)
    assert acc.ok, acc.problems
    assert not acc.unbatched
    assert acc.trained["g000005"] == 3


def test_a_batch_listed_unbatched_at_a_stop_and_rebuilt_by_the_restart_is_trained_once() -> None:
    """The run stopped while its trainer stepped on g3 g4 (listed unbatched, no batch record);
    the trainer finished the step, so the restart rebuilt the batch; g5 was restored."""
    events, episodes, batches = _faithful()
    events[-1] = {"kind": "unbatched", "group_ids": ["g000003", "g000004"], "reason": "stopped"}
    events.append({"kind": "unbatched", "group_ids": ["g000005"], "reason": "stopped"})
    events += [
        {"kind": "run"},
        {"kind": "resumed", "restored": ["g000005"], "reconstructed": 2, "trainer_version": 2},
        {"kind": "unbatched", "group_ids": ["g000005"], "reason": "max_steps"},
    ]
    acc = account_records(events, episodes, batches)
    assert acc.ok, acc.problems
    assert acc.trained["g000003"] == acc.trained["g000004"] == 2
    assert acc.unbatched == {"g000005": "max_steps"}


def test_account_reads_a_run_directory(tmp_path: Path) -> None:
    """The files as the run writes them: events (admit flushed at once) and the trajectory log."""
    events = EventLog(tmp_path / "events")
    tlog = TrajectoryLog(tmp_path / "trajectories", run="acc")
    rng = random.Random(3)
    groups = [make_group(rng, i, 0) for i in range(3)]
    for i, (group, _) in enumerate(groups):
        events.emit("admit", index=i, group_id=group.id, task_id=group.task_id)
    events.emit("admit", index=3, group_id="g000003", task_id="x")  # never finished
    kept = [(g, d) for g, d in groups if d.decision == "kept"]
    for group, decision in groups:
        tlog.write_group(group, decision, trainer_version=0)
    batch = Batch(trained_at_version=0, groups=[g for g, _ in kept], decisions=[d for _, d in kept])
    tlog.write_batch(batch, 1, {"reward_mean": 0.0})
    tlog.close()
    acc = account(tmp_path)  # the event log is not closed: admits are on disk already
    assert acc.admitted == ["g000000", "g000001", "g000002", "g000003"]
    assert acc.unaccounted == ["g000003"]
    assert len(acc.trained) == len(kept)
    assert len(acc.dropped) == 3 - len(kept)
    events.close()
