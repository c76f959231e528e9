"""Hostile trajectory logs: ``inspect``, ``replay`` and ``report`` answer a zstd bomb, lines that
are not JSON, a record of another schema, a garbled ``run.json`` and a FIFO in a part's place with
one line naming the file, never a traceback, an exhausted memory or a hang."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard

from orchestrator.cli import main
from orchestrator.errors import TrajlogError
from orchestrator.record import frames
from orchestrator.record.frames import FrameWriter, iter_records, read_part
from tests.support.trajectories import write_synthetic_log

pytestmark = pytest.mark.usefixtures("cli_logging")

EPISODES = "episodes-000000.jsonl.zst"
POLICIES = '[policies.strict]\ndrop = { statistic = "max", max_lag = 0 }\n'


def _bomb(part: Path) -> None:
    """A frame of a few KiB that decompresses past the bound (all zeros, no newline)."""
    cobj = zstandard.ZstdCompressor(level=19).compressobj()
    with part.open("wb") as f:
        for _ in range(5):
            f.write(cobj.compress(bytes(1 << 20)))
        f.write(cobj.flush())


def _not_json(part: Path) -> None:
    part.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(b"{not json\n"))


def _other_schema(part: Path) -> None:
    records = list(read_part(part))
    for r in records:
        r["schema_version"] = 99
    part.unlink()
    writer = FrameWriter(part.parent, "episodes")
    writer.write(records)
    writer.close()


def _fifo(part: Path) -> None:
    part.unlink()
    os.mkfifo(part)


def _garbled_header(part: Path) -> None:
    (part.parent / "run.json").write_text('{"schema_version": 2, "type": "run", "run": [1]}')


HOSTILE: dict[str, tuple[Callable[[Path], None], str]] = {
    "bomb": (_bomb, "decompresses to more than"),
    "not_json": (_not_json, "a line is not JSON"),
    "other_schema": (_other_schema, "schema 99; this sprawl reads schema 2"),
    "fifo": (_fifo, "is not a regular file"),
    "garbled_header": (_garbled_header, "run.json: not a trajectory log this sprawl reads"),
}


@pytest.fixture
def small_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame bound of 1 MiB, so a bomb of 5 MiB is cheap to make."""
    monkeypatch.setattr(frames, "MAX_FRAME_BYTES", 1 << 20)


@pytest.mark.usefixtures("small_frames")
@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("command", ["inspect", "replay", "report"])
def test_a_hostile_log_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, command: str
) -> None:
    run = tmp_path / "runs" / "demo"
    log = run / "trajectories"
    write_synthetic_log(log, steps=2, seed=4)
    make, complaint = HOSTILE[case]
    make(log / EPISODES)
    (tmp_path / "p.toml").write_text(
        '[policies.strict]\ndrop = { statistic = "max", max_lag = 0 }\n'
    )
    argv = {
        "inspect": ["inspect", str(log)],
        "replay": ["replay", str(log), "--what-if", str(tmp_path / "p.toml")],
        "report": ["report", str(run), "--out", str(tmp_path / "r.html")],
    }[command]
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = int(str(exc.code))
    err = capsys.readouterr().err
    if case == "garbled_header" and command == "inspect":
        assert rc == 0, err  # inspect reads the records, not the header
        return
    assert rc == 2, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("orchestrate: error: "), err
    assert complaint in line, line
    assert str(log) in line


def test_a_large_write_is_split_into_frames_a_reader_takes(
    tmp_path: Path, small_frames: None
) -> None:
    records = [{"i": i, "pad": "x" * 100_000} for i in range(30)]  # ~3 MiB: three frames or more
    writer = FrameWriter(tmp_path, "episodes")
    writer.write(records)
    writer.close()
    payloads, _ = frames.scan_frames((tmp_path / EPISODES).read_bytes())
    assert len(payloads) > 1
    assert all(len(p) <= frames.MAX_FRAME_BYTES for p in payloads)
    assert list(iter_records(tmp_path, "episodes")) == records
    with pytest.raises(TrajlogError, match="larger than a frame may hold"):
        FrameWriter(tmp_path, "episodes").write([{"pad": "x" * (2 << 20)}])
