"""``orchestrate bench sync`` at a small size: its JSON, and that the sparse paths are exact."""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from orchestrator.bench import sync as bench_sync
from orchestrator.bench.link import Link
from orchestrator.bench.sync import main
from orchestrator.bench.synthetic import adam_step, same_bits, synthetic_view


def test_link_takes_the_time_its_bytes_need() -> None:
    link = Link(80.0)  # 10 MB/s
    t0 = time.perf_counter()
    link.carry(500_000)
    link.carry(500_000)
    elapsed = time.perf_counter() - t0
    assert 0.1 <= elapsed < 0.3
    assert link.bytes == 1_000_000


def test_reads_in_flight_together_overlap_their_round_trips_but_not_their_bytes() -> None:
    link = Link(80.0, rtt_ms=200.0)  # 10 MB/s: 100 KB take 10 ms
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: link.carry(100_000, t0), range(2)))
    both = time.perf_counter() - t0
    assert 0.22 <= both < 0.4  # one round trip and both reads' bytes, not two round trips
    t1 = time.perf_counter()
    link.carry(None)  # not there: the answer still takes a round trip, and carries no bytes
    assert 0.2 <= time.perf_counter() - t1 < 0.35
    assert link.bytes == 200_000


def test_adam_step_moves_values_by_one_ulp_and_stays_finite() -> None:
    view = synthetic_view(1)
    view["edge"] = torch.tensor([0.0, -0.0, 3.3895e38, 1.0], dtype=torch.bfloat16)
    step = adam_step(view, 0.5, torch.Generator().manual_seed(0))
    assert not same_bits(view, step)
    for name, t in view.items():
        a, b = t.view(torch.int16).int(), step[name].view(torch.int16).int()
        assert int((a - b).abs().max()) <= 1
        assert torch.isfinite(step[name].float()).all()


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--repeats", "0"], "--repeats: must be at least 1"),
        (["--islands", "0"], "--islands: must be at least 1"),
        (["--link-mbit", "0"], "--link-mbit: must be > 0"),
        (["--link-rtt-ms", "-1"], "--link-rtt-ms: must be >= 0"),
        (["--density", "1.5"], "--density: must be in (0, 1]"),
    ],
)
def test_bench_sync_names_a_bad_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_bench_sync_small_run(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # main() configures logging for a process; in the test session it would bind the captured
    # stream (closed after this test) for every later test
    monkeypatch.setattr(bench_sync, "configure", lambda **_: None)
    argv = ["--model", str(tiny_model_dir), "--size-mb", "16", "--pause-trials", "4", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["link_mbit_s"] == 100.0
    assert out["link_rtt_ms"] == 0.0
    for part in ("demo", "synthetic"):
        r = out[part]
        assert r["exact"] is True
        assert r["full"]["bytes"] >= r["view_bytes"]
        assert 0 < r["sync"]["patch_bytes"] < r["view_bytes"] / 10
        assert r["sync_s"] > 0
        assert r["speedup"] == pytest.approx(  # printed to one decimal
            r["full"]["s"] / r["sync_s"], rel=0.1, abs=0.051
        )
        assert r["patch_link_s"] == pytest.approx(r["sync"]["patch_bytes"] * 8 / 1e8, abs=5e-4)
        ratio = r["full"]["bytes"] / r["sync"]["patch_bytes"]
        assert r["limit_ratio"] == pytest.approx(r["speedup"] / ratio, rel=0.1, abs=0.002)
    syn = out["synthetic"]
    assert syn["view_bytes"] == 16 * 2**20
    # five syncs (the default --repeats); the figures are their median
    assert len(syn["runs"]) == 5
    median = statistics.median(r["sync_s"] for r in syn["runs"])
    assert syn["sync_s"] == pytest.approx(median, abs=1e-3)
    # 16 MiB over 100 Mbit/s cannot arrive in under 16 * 2**20 * 8 / 1e8 s
    assert syn["full"]["s"] >= 16 * 2**20 * 8 / 1e8
    cu = syn["catch_up"]
    assert cu["exact"] is True
    assert (cu["squashed"]["patches"], cu["chained"]["patches"]) == (1, 8)
    assert cu["squashed"]["bytes"] < cu["chained"]["bytes"]
    pause = out["demo"]["pause"]
    assert 0 <= pause["p50_ms"] <= pause["p99_ms"]
