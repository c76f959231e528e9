"""``orchestrate bench publish`` at a small size: its JSON, and that bad world sizes are refused."""

from __future__ import annotations

import json

import pytest

from orchestrator.bench.publish import main


@pytest.mark.parametrize("ranks", ["0,2", "one", ""])
def test_bad_world_sizes_are_refused_naming_the_flag(
    ranks: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--ranks", ranks])
    assert e.value.code == 2
    assert f"--ranks {ranks!r}" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_publish_small_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--ranks", "1,2", "--size-mb", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert [w["ranks"] for w in result["worlds"]] == [1, 2]
    for w in result["worlds"]:
        assert [r["rank"] for r in w["per_rank"]] == list(range(w["ranks"]))
        assert {r["kind"] for r in w["per_rank"]} == {"delta"}  # version 1 is a delta
        assert w["publish_s"] == max(r["publish_s"] for r in w["per_rank"]) > 0
        assert all(r["peak_rss_bytes"] >= r["baseline_rss_bytes"] > 0 for r in w["per_rank"])
    one, two = result["worlds"]
    assert result["speedup"] == round(one["publish_s"] / two["publish_s"], 2)
    assert result["memory_ratio"] == round(two["peak_rss_bytes"] / one["peak_rss_bytes"], 3)
    assert two["per_rank"][0]["delta_bytes"] > 0
    assert result["net_memory_ratio"] is None or result["net_memory_ratio"] > 0
