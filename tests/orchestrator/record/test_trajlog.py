"""The trajectory log: round trip, rotation, torn tails (incl. a real SIGKILL), repair, datasets."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from datasets import load_dataset
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from orchestrator.errors import TrajlogError
from orchestrator.record.frames import parts, read_log, repair, scan_frames
from orchestrator.record.trajlog import (
    SCHEMA_VERSION,
    BatchRecord,
    EpisodeRecord,
    RunRecord,
    TrajectoryLog,
    batch_records,
    episode_records,
    run_header,
    to_dataset,
)
from orchestrator.types import (
    Batch,
    Episode,
    ErrorRecord,
    GroupDecision,
    SamplingParams,
    Segment,
    ToolCallRecord,
)
from policies.wire.lane import VersionStamp
from tests.support.trajectories import make_group, write_synthetic_log
from tests.support.waiting import until_sync


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    rng = random.Random(1)
    tlog = TrajectoryLog(tmp_path / "log", run="r1", config={"a": 1})
    written = [make_group(rng, i, 3) for i in range(3)]
    for group, decision in written:
        tlog.write_group(group, decision, trainer_version=3)
    tlog.write_batch(
        Batch(trained_at_version=3, groups=[written[0][0]], decisions=[]), 4, {"x": 1.5}
    )
    tlog.close()

    header = run_header(tmp_path / "log")
    assert header == RunRecord(run="r1", started_at=header.started_at, config={"a": 1})
    records = episode_records(tmp_path / "log")
    assert [r.episode for r in records] == [e for g, _ in written for e in g.episodes]
    assert [r.decision for r in records] == [d for g, d in written for _ in g.episodes]
    assert {r.schema_version for r in records} == {SCHEMA_VERSION}
    for r in records:
        assert r.trainer_version == 3
        sampled = [i for i, m in enumerate(r.loss_mask) if m]
        expected = [s.prompt_len + j for s in r.episode.segments for j in range(len(s.token_ids))]
        assert sampled == expected
    (batch,) = batch_records(tmp_path / "log")
    assert (batch.trained_at_version, batch.produced_version) == (3, 4)
    assert batch.groups == [written[0][0].id]
    assert batch.metrics == {"x": 1.5}


def test_decision_version_is_recovered_when_not_given(tmp_path: Path) -> None:
    group, decision = make_group(random.Random(2), 0, 5)
    tlog = TrajectoryLog(tmp_path)
    tlog.write_group(group, decision)
    tlog.close()
    assert {r.trainer_version for r in episode_records(tmp_path)} == {5}


def test_rotation_and_reopen_preserve_order(tmp_path: Path) -> None:
    rng = random.Random(3)
    groups = [make_group(rng, i, 1) for i in range(12)]
    tlog = TrajectoryLog(tmp_path, rotate_bytes=2000)
    for g, d in groups[:6]:
        tlog.write_group(g, d)
    tlog.close()
    n_first = len(parts(tmp_path, "episodes"))
    assert n_first > 1, "small rotate_bytes must rotate"
    tlog = TrajectoryLog(tmp_path, rotate_bytes=2000)  # a restart never appends to an old part
    for g, d in groups[6:]:
        tlog.write_group(g, d)
    tlog.close()
    assert len(parts(tmp_path, "episodes")) > n_first
    ids = [r.episode.id for r in episode_records(tmp_path)]
    assert ids == [e.id for g, _ in groups for e in g.episodes]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_torn_tail_keeps_exactly_the_complete_frames(tmp_path_factory, data) -> None:  # type: ignore[no-untyped-def]
    directory = tmp_path_factory.mktemp("torn")
    rng = random.Random(data.draw(st.integers(0, 1000)))
    groups = [make_group(rng, i, 1, size=2) for i in range(data.draw(st.integers(1, 5)))]
    tlog = TrajectoryLog(directory)
    ends = []
    for g, d in groups:
        tlog.write_group(g, d)
        assert tlog._episodes._f is not None
        ends.append(tlog._episodes._f.tell())
    tlog.close()
    (part,) = parts(directory, "episodes")
    blob = part.read_bytes()
    cut = data.draw(st.integers(0, 10**6)) * len(blob) // 10**6  # logged_at varies the size
    part.write_bytes(blob[:cut])
    complete = sum(1 for e in ends if e <= cut)
    with capture_logs() as logs:
        ids = [r.episode.id for r in episode_records(directory)]
    assert ids == [e.id for g, _ in groups[:complete] for e in g.episodes]
    torn = [entry for entry in logs if entry["event"] == "trajlog.torn_tail"]
    assert bool(torn) == (cut not in (0, *ends))


def test_corruption_before_the_tail_raises(tmp_path: Path) -> None:
    rng = random.Random(4)
    tlog = TrajectoryLog(tmp_path)
    for i in range(3):
        tlog.write_group(*make_group(rng, i, 1))
    tlog.close()
    (part,) = parts(tmp_path, "episodes")
    blob = bytearray(part.read_bytes())
    blob[len(blob) // 3] ^= 0xFF
    part.write_bytes(bytes(blob))
    with pytest.raises(TrajlogError, match="corrupt frame"):
        episode_records(tmp_path)
    with pytest.raises(TrajlogError, match="no trajectory log"):
        read_log(tmp_path / "missing")


WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from orchestrator.record.trajlog import FrameWriter
    w = FrameWriter(Path(sys.argv[1]), "episodes", rotate_bytes=4096)
    pad = "x" * 300
    for i in range(10**7):
        w.write([{"i": i, "j": k, "pad": pad} for k in range(3)])
        if i == 50:
            print("ready", flush=True)
    """
)


def test_sigkill_mid_write_loses_at_most_the_last_frame(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        # killed while it writes on, once it has rotated to a second part
        until_sync(lambda: len(parts(tmp_path, "episodes")) > 1, "a second part", every_s=0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    records = list(read_log(tmp_path))
    assert len(records) >= 150
    assert len(records) % 3 == 0, "a frame is all of one write or none of it"
    assert [(r["i"], r["j"]) for r in records] == [
        (i, k) for i in range(len(records) // 3) for k in range(3)
    ]
    assert len(parts(tmp_path, "episodes")) > 1


def test_repair_makes_every_part_loadable_by_datasets(tmp_path: Path) -> None:
    log_dir = tmp_path / "log"
    write_synthetic_log(log_dir, steps=2)
    (part,) = parts(log_dir, "episodes")
    full = part.read_bytes()
    part.write_bytes(full[:-7])  # a torn tail, as after a kill
    n = len(episode_records(log_dir))
    assert repair(log_dir) == [part]
    assert repair(log_dir) == []
    assert scan_frames(part.read_bytes())[1] == part.stat().st_size
    direct = load_dataset(
        "json",
        data_files=str(log_dir / "episodes-*.jsonl.zst"),
        split="train",
        cache_dir=str(tmp_path / "cache"),
    )
    ds = to_dataset(log_dir)
    assert len(direct) == len(ds) == n
    assert (
        direct[0]["episode"]["segments"][0]["token_ids"]
        == ds[0]["episode"]["segments"][0]["token_ids"]
    )
    assert direct[0]["decision"]["decision"] in {"kept", "dropped"}
    assert sum(direct[0]["loss_mask"]) == sum(
        len(s["token_ids"]) for s in direct[0]["episode"]["segments"]
    )
    assert len(to_dataset(log_dir, "batches")) == 2


def test_schema_doc_names_every_field() -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "trajectory-schema.md").read_text()
    assert f"schema_version = {SCHEMA_VERSION}" in doc.replace("`", "")
    models = [RunRecord, EpisodeRecord, BatchRecord, Episode, Segment, GroupDecision]
    models += [SamplingParams, ToolCallRecord, ErrorRecord, VersionStamp]
    documented = set(re.findall(r"`([a-z_]+)`", doc))
    missing = {f"{m.__name__}.{f}" for m in models for f in m.model_fields if f not in documented}
    assert not missing, f"undocumented fields: {sorted(missing)}"
