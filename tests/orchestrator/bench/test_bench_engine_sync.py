"""``orchestrate bench sync --engine reference``: its JSON, exactness, and its flags' errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.bench import engine_sync
from orchestrator.bench.engine_sync import main


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--versions", "0"], "--versions: must be at least 1"),
        (["--link-mbit", "0"], "--link-mbit: must be > 0"),
        (["--link-rtt-ms", "-1"], "--link-rtt-ms: must be >= 0"),
        (["--density", "0"], "--density: must be in (0, 1]"),
        (["--poll-ms", "0"], "--poll-ms: must be > 0"),
    ],
)
def test_bench_sync_engine_names_a_bad_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--engine", "reference", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err
    assert "Traceback" not in err


def test_bench_sync_engine_follows_versions_a_round_trip_away(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # main() configures logging for a process; in the test session it would bind the captured
    # stream (closed after this test) for every later test
    monkeypatch.setattr(engine_sync, "configure", lambda **_: None)
    argv = ["--engine", "reference", "--model", str(tiny_model_dir), "--versions", "2"]
    assert main([*argv, "--link-rtt-ms", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (out["engine"], out["link_rtt_ms"], out["link_mbit_s"]) == ("reference", 20.0, 100.0)
    assert out["exact"] is True  # the live engine answers as a fresh one on the last version
    assert [r["version"] for r in out["versions"]] == [1, 2]
    for r in out["versions"]:
        assert r["sync_s"] >= 0.02  # at least the round trip of the first read of the version
        assert r["board_bytes_read"] >= r["patch_bytes"] > 0
    assert 0 <= out["pause_ms"]["p50"] <= out["pause_ms"]["p99"]
