"""``orchestrate bench device`` on a CPU at tiny sizes: every part's JSON file and its fields (the
ones an H200 run writes), the bitwise checks, and that a round trip that is not bitwise says so."""

from __future__ import annotations

import json
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator.bench import device, device_publish
from orchestrator.bench.device_models import model_dir
from orchestrator.bench.device_scale import SCALES, Report, with_overrides
from policies.board import BoardReader, Manifest
from tests.support.models import model_copy

SIZES = [
    "--set", "view_mb=34", "--set", "models=tiny", "--set", "engine_model=tiny",
    "--set", "train_steps=2", "--set", "pause_trials=3",
]  # fmt: skip
CODEC_ROW = {
    "density", "changed", "patch_bytes", "bits_per_changed_element", "encode_s", "encode_gbps",
    "copy_s", "device_memcpy_gbps", "encode_vs_memcpy", "scan_s", "scan_gbps", "to_host_bytes",
    "to_host_vs_patch", "exact",
}  # fmt: skip
PUBLISH = {
    "view_bytes", "density", "anchor_s", "publish_s", "kind", "patch_bytes", "changed",
    "bytes_written", "to_host_bytes", "to_host_vs_patch", "reader_load_s", "reader_advance_s",
    "exact",
}  # fmt: skip
TRAINER_MODEL = {
    "model", "parameters", "view_bytes", "steps", "anchor_s", "first_step_s", "step_s",
    "steps_per_s", "publish_s", "publish_max_s", "publish_vs_step", "kinds", "patch_bytes",
    "changed_fraction", "to_host_bytes",
}  # fmt: skip
PAUSE = {
    "trials", "load_requests", "density", "patch_bytes", "tensors_changed", "p50_ms", "p99_ms",
    "max_ms", "to_step_boundary_p50_ms", "to_step_boundary_p99_ms", "copy_p50_ms", "step_ms",
    "exact",
}  # fmt: skip
HEAD = {"part", "status", "elapsed_s", "device", "scale"}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A work dir holding the tiny model already (the cached build, not a new one)."""
    root = tmp_path_factory.mktemp("bench-device")
    model_copy("tiny", root / "models" / "tiny")
    (root / "models" / "tiny.built").write_text("tiny\n")
    return root


def _read(out: Path, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    return data


@pytest.mark.slow
@pytest.mark.usefixtures("cli_logging")
def test_the_tiny_cpu_run_writes_every_part_with_the_device_runs_fields(
    tmp_path: Path, work: Path
) -> None:
    out = tmp_path / "out"
    parts = ["env", "codec", "publish", "trainer", "engine", "summary"]
    args = [*parts, "--out", str(out), "--work", str(work), *SIZES]
    assert device.main([*args, "--device", "cpu", "--scale", "tiny"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        f"{n}.json" for n in ("codec", "device", "engine", "publish", "trainer")
    ]
    for name in ("codec", "publish", "trainer", "engine"):
        data = _read(out, name)
        assert data["status"] == "ok", data.get("error")
        assert (data["device"], data["scale"]) == ("cpu", "tiny")

    codec = _read(out, "codec")
    assert set(codec) == HEAD | {"view_bytes", "tensors", "repeats", "rows", "device_memcpy_gbps"}
    assert (codec["view_bytes"], codec["tensors"]) == (34 << 20, 2)
    assert [r["density"] for r in codec["rows"]] == [0.001, 0.01, 0.03]
    units = codec["view_bytes"] // 2
    for row in codec["rows"]:
        assert set(row) == CODEC_ROW
        assert row["exact"] is True
        assert row["changed"] == pytest.approx(row["density"] * units, rel=0.01)
        assert row["encode_gbps"] > 0
        assert row["device_memcpy_gbps"] > 0
        assert row["to_host_bytes"] == 0  # the view is on the host already

    publish = _read(out, "publish")
    assert set(publish) == HEAD | PUBLISH
    assert (publish["kind"], publish["exact"]) == ("delta", True)
    assert publish["changed"] == pytest.approx(0.01 * units, rel=0.01)
    assert publish["patch_bytes"] < publish["bytes_written"] < 2 * publish["patch_bytes"]
    assert not (work / "boards" / "publish").exists()  # the board is removed after the part

    trainer = _read(out, "trainer")
    [model] = trainer["models"]
    assert set(model) == TRAINER_MODEL
    assert (model["model"], model["steps"], model["kinds"]) == ("tiny", 2, ["delta", "delta"])
    assert model["steps_per_s"] > 0
    assert 0 < model["changed_fraction"] < 0.5

    engine = _read(out, "engine")
    assert [t["concurrency"] for t in engine["throughput"]] == [1, 8]
    assert all(t["tokens_per_s"] > 0 for t in engine["throughput"])
    assert set(engine["activation_pause"]) == PAUSE
    assert engine["activation_pause"]["exact"] is True

    summary = _read(out, "device")
    assert summary["status"] == "ok"
    assert summary["applies"] is False
    assert summary["sizes"]["view_mb"] == 34
    assert summary["parts"] == {
        "tests": "missing", "codec": "ok", "publish": "ok", "trainer": "ok", "engine": "ok"
    }  # fmt: skip
    exact = next(t for t in summary["targets"] if t["target"].startswith("exact"))
    assert (exact["value"], exact["met"]) == (0, True)


class _Flipping(BoardReader):
    """An island whose advance from a version it holds leaves one bit of the view wrong."""

    def advance(
        self,
        view: MutableMapping[str, torch.Tensor],
        have: int | None,
        want: int | None = None,
        *,
        verify_base: bool = False,
    ) -> Manifest:
        manifest = super().advance(view, have, want, verify_base=verify_base)
        if have is not None:  # not the load of version 0 (load advances from nothing)
            next(iter(view.values())).view(-1).view(torch.int16)[0] ^= 1
        return manifest


def test_a_replica_that_is_not_bitwise_is_not_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(device_publish, "BoardReader", _Flipping)
    report = Report(tmp_path, "publish")
    device_publish.run(with_overrides(SCALES["tiny"], ["view_mb=2"]), "cpu", tmp_path, report)
    assert (report.data["kind"], report.data["exact"]) == ("delta", False)


def test_a_wider_shape_is_built_on_its_size(tmp_path: Path) -> None:
    path = model_dir(tmp_path, "tiny-wide")
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (128, 3)
    assert len(config.get("layer_types", [None] * 3)) == 3
    assert (path / "tokenizer.json").is_file()
    assert model_dir(tmp_path, "tiny-wide") == path  # built once


def test_bad_sizes_and_parts_are_refused_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    for bad, said in (
        (["--set", "view_mib=3"], "--set 'view_mib=3'"),
        (["--set", "repeats=x"], "'x' is not a int"),
        (["codex"], "unknown part 'codex'"),
    ):
        with pytest.raises(SystemExit) as e:
            device.main(["--out", "unused", *bad])
        assert e.value.code == 2
        assert said in capsys.readouterr().err
