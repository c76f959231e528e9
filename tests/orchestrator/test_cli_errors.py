"""``orchestrate`` on user mistakes: one line naming what was wrong, exit code 2, no traceback."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.record.events import EventLog
from orchestrator.record.frames import FrameWriter, iter_records
from orchestrator.record.trajlog import episode_records
from tests.support.trajectories import write_synthetic_log

pytestmark = pytest.mark.usefixtures("cli_logging")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "demo"
    write_synthetic_log(run / "trajectories", steps=2, seed=4)
    events = EventLog(run / "events")
    for i, r in enumerate(episode_records(run / "trajectories")):
        events.emit("admit", index=i, group_id=r.decision.group_id, task_id="t")
    events.close()
    return run


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        rc = int(str(exc.code))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(("orchestrate: error: ", "orchestrate serve: error: ")), err
    return lines[-1]


@pytest.mark.parametrize(
    "part",
    [
        "trajectories/episodes-000000.jsonl.zst",
        "trajectories/batches-000000.jsonl.zst",
        "trajectories/run.json",
        "events/events-000000.jsonl.zst",
    ],
)
def test_inspect_takes_any_log_file_of_a_run_for_its_log(
    run_dir: Path, part: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (run_dir / part).is_file()
    assert main(["inspect", str(run_dir), "--width", "200"]) == 0
    whole = capsys.readouterr().out
    assert main(["inspect", str(run_dir / part), "--width", "200"]) == 0
    assert capsys.readouterr().out == whole
    assert re.search(r"accounting: \d+ groups admitted", whole)


def test_inspect_says_what_it_expects(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "notes.txt", tmp_path / "empty"):
        line = _one_line_error(capsys, ["inspect", str(path)])
        assert str(path) in line
        assert "give a run directory (e.g. runs/demo), its trajectories/ directory" in line


def test_inspect_names_a_log_of_another_schema(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    # an events part where an episodes part belongs: records that are not episode records
    shutil.copy(run_dir / "events" / "events-000000.jsonl.zst", other / "episodes-000000.jsonl.zst")
    line = _one_line_error(capsys, ["inspect", str(other)])
    assert f"{other}: not a trajectory log this sprawl reads" in line
    assert "EpisodeRecord records" in line


def test_inspect_names_a_log_of_an_older_schema_version(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "old"
    records = list(iter_records(run_dir / "trajectories", "episodes"))
    for r in records:
        r["schema_version"] = 1
    writer = FrameWriter(old, "episodes")
    writer.write(records)
    writer.close()
    line = _one_line_error(capsys, ["inspect", str(old)])
    assert f"{old}: not a trajectory log this sprawl reads" in line
    assert "schema 1; this sprawl reads schema 2" in line


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--config", "{empty}"], "{empty}: Is a directory"),
        (["init-model", "--out", "{file}"], "{file}: File exists"),
        (["report", "{run}", "--out", "{tmp}/missing/report.html"], "{tmp}/missing/"),
        (
            ["materialize", "--board", "{tmp}/b", "--version", "0", "--out", "{file}/x"],
            "{file}/x",
        ),
        (["versions", "--board", "{file}"], "Not a directory"),
        (["replay", "{file}", "--what-if", "{file}"], "{file} is not a trajectory log file"),
        (["report", "{empty}"], "{empty} holds no trajectory log"),
        (
            ["serve", "--model", "{empty}", "--port", "70000"],
            "--port: 70000: Input should be less than",
        ),
        (
            ["serve", "--model", "{empty}", "--poll-interval", "0"],
            "--poll-interval: 0: Input should be greater",
        ),
        (
            ["serve", "--model", "{empty}", "--tls-cert", "{tmp}/no.pem", "--tls-key", "{file}"],
            "TLS certificate {tmp}/no.pem",
        ),
        (["serve", "--board", "{tmp}/b", "--run", "../.."], "run name '../..' is not valid"),
    ],
)
def test_bad_paths_and_arguments_are_one_line_errors(
    run_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    named: str,
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("not what anything expects")
    fill = {"empty": tmp_path / "empty", "file": tmp_path / "file.txt", "tmp": tmp_path}
    fill["run"] = run_dir
    line = _one_line_error(capsys, [a.format(**fill) for a in argv])
    assert named.format(**fill) in line
