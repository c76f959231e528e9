"""``orchestrate bench device``: the device path (codec, publish, trainer, engine) in one prepared
run on a GPU, or at tiny sizes on a CPU; its results as JSON files in ``--out``.

    orchestrate bench device --out DIR [--device cpu|cuda] [--scale tiny|h200]
                             [--work DIR] [--set FIELD=VALUE …] [PART …]

Parts, in this order unless named (each writes ``<out>/<file>.json``):

- ``env`` → ``device.json``: the machine, torch, CUDA, the package versions, ``commit``
  (``$SPRAWL_COMMIT``, else ``git rev-parse``), the scale's sizes;
- ``tests`` → ``tests.json``: the tests named for CUDA (``-k cuda``) in every test file that
  checks ``torch.cuda.is_available()``, run by pytest in a child process: they skip without a GPU;
- ``codec`` → ``codec.json`` (:mod:`~orchestrator.bench.device_codec`), ``publish`` →
  ``publish.json`` (:mod:`~orchestrator.bench.device_publish`), ``trainer`` → ``trainer.json``
  (:mod:`~orchestrator.bench.device_trainer`), ``engine`` → ``engine.json``
  (:mod:`~orchestrator.bench.device_engine`);
- ``summary`` → ``device.json``'s ``parts`` (each part's status: ``ok``, ``error``, ``incomplete``
  when it was killed midway, ``missing``) and ``targets`` (issue #44's, each with its value and
  ``met``; they are set for the ``h200`` scale: ``applies`` says whether this run is at it).

The sizes are :mod:`~orchestrator.bench.device_scale`'s; the figures each part reports, with its
same-run baseline, are in its module's docstring. ``scripts/gpu-check.sh`` runs each part in a
process of its own under a time limit. Exit status: 1 if a part failed, else 0 (missed targets
are figures, not failures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from orchestrator.bench.device_scale import (
    SCALES,
    Device,
    Report,
    Scale,
    scale_dict,
    with_overrides,
)

REPO = Path(__file__).resolve().parents[2]
PARTS = ("env", "tests", "codec", "publish", "trainer", "engine", "summary")
FILES = {"env": "device", "summary": "device"}
"""A part's JSON file, where it is not the part's name."""
PACKAGES = (
    "torch", "triton", "numpy", "numba", "transformers", "tokenizers", "safetensors",
    "huggingface-hub", "peft", "pydantic", "structlog", "zstandard", "xxhash", "anyio", "gguf",
)  # fmt: skip
WORK = Path(os.environ.get("TMPDIR", "/tmp")) / "sprawl-bench-device"


def _commit() -> str | None:
    if os.environ.get("SPRAWL_COMMIT"):
        return os.environ["SPRAWL_COMMIT"]
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
    except OSError:
        return None
    return done.stdout.strip() or None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def env(scale: Scale, device: Device, report: Report) -> None:
    import torch

    gpu = torch.cuda.get_device_properties(0) if device == "cuda" else None
    report.update(
        commit=_commit(),
        python=platform.python_version(),
        machine=platform.machine(),
        cpu_count=os.cpu_count(),
        cuda=torch.version.cuda,
        gpu=None if gpu is None else gpu.name,
        gpu_memory_bytes=None if gpu is None else gpu.total_memory,
        packages={name: _version(name) for name in PACKAGES},
        sizes=scale_dict(scale),
    )


def _cases(junit: Path) -> list[dict[str, Any]]:
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", None
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome, message = kind.replace("failure", "failed"), found.get("message")
        name = f"{case.get('classname')}::{case.get('name')}"
        out.append(
            {
                "test": name,
                "outcome": outcome,
                "seconds": float(case.get("time", 0)),
                "message": message,
            }
        )
    return out


def tests(report: Report, work: Path) -> None:
    files = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if "cuda.is_available()" in p.read_text()
    )
    work.mkdir(parents=True, exist_ok=True)
    junit = work / "cuda-tests.xml"
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda",
        f"--junitxml={junit}", *files,
    ]  # fmt: skip
    report.update(files=files, command=" ".join(command[1:]))
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    cases = _cases(junit) if junit.is_file() else []
    counts = {
        k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")
    }
    report.update(exit_code=done.returncode, **counts, cases=cases, output_tail=done.stdout[-3000:])


def _status(out: Path, name: str) -> tuple[str, dict[str, Any]]:
    path = out / f"{name}.json"
    if not path.is_file():
        return "missing", {}
    data: dict[str, Any] = json.loads(path.read_text())
    status = data.get("status")
    return ("incomplete" if status == "running" else str(status)), data


def _target(what: str, value: float | None, limit: float, higher: bool) -> dict[str, Any]:
    met = value is not None and (value >= limit if higher else value <= limit)
    return {"target": what, "value": value, "limit": limit, "met": met}


def _failing(tested: dict[str, Any]) -> int | None:
    """Tests failed or in error; a pytest that ended otherwise (collection error, crash: exit
    status not 0, 1 or 5) counts one at least."""
    if "exit_code" not in tested:
        return None
    bad = int(tested.get("failed", 0)) + int(tested.get("error", 0))
    return bad if tested["exit_code"] in (0, 1, 5) else max(bad, 1)


def summary(scale: Scale, out: Path, report: Report) -> None:
    found = {p: _status(out, p) for p in ("tests", "codec", "publish", "trainer", "engine")}
    codec, publish, engine = found["codec"][1], found["publish"][1], found["engine"][1]
    at_1: dict[str, Any] = next((r for r in codec.get("rows", []) if r["density"] == 0.01), {})
    pause = engine.get("activation_pause", {})
    exact = [r.get("exact") for r in codec.get("rows", [])]
    exact += [publish.get("exact"), pause.get("exact")]
    tested = found["tests"][1]
    targets = [
        _target("codec: scan + encode GB/s of view at 1%", at_1.get("encode_gbps"), 1000, True),
        _target("publish: to_host_bytes / patch bytes", publish.get("to_host_vs_patch"), 3, False),
        _target("engine: activation pause p50 ms", pause.get("p50_ms"), 5, False),
        _target(
            "exact: checks not exact (or not run)", sum(e is not True for e in exact), 0, False
        ),
        _target("tests: failed or in error", _failing(tested), 0, False),
    ]
    report.update(
        parts={p: status for p, (status, _) in found.items()},
        targets=targets,
        applies=scale.name == "h200",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orchestrate bench device",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("parts", nargs="*", metavar="PART", help=f"any of {', '.join(PARTS)}")
    parser.add_argument("--out", type=Path, required=True, help="where the JSON files go")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--scale", choices=sorted(SCALES), default="tiny")
    parser.add_argument(
        "--work", type=Path, default=WORK, help=f"models and boards (default {WORK})"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="override one size"
    )
    return parser


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    bad = [p for p in args.parts if p not in PARTS]
    if bad:
        parser.error(f"unknown part {bad[0]!r}: choose from {', '.join(PARTS)}")
    try:
        scale = with_overrides(SCALES[args.scale], args.set)
    except ValueError as exc:
        parser.error(str(exc))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("orchestrate bench device: --device cuda: no CUDA GPU is available here")
    args.out.mkdir(parents=True, exist_ok=True)
    return run_parts(args.parts or list(PARTS), scale, args.device, args.out, args.work)


def run_parts(parts: list[str], scale: Scale, device: Device, out: Path, work: Path) -> int:
    """Run ``parts`` in order, each into its JSON file; 1 if one failed (the others still run)."""
    from transformers.utils import logging as hf_logging

    from policies.codec.warm import warm_up
    from policies.wire.logs import configure

    configure(level="warning")
    if {"codec", "publish", "trainer", "engine"} & set(parts):
        warm_up()  # the codec's kernels compiled before any part times them
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        failed = sum(_run_part(part, scale, device, out, work) for part in parts)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    return 1 if failed else 0


def _run_part(part: str, scale: Scale, device: Device, out: Path, work: Path) -> bool:
    """Run one part into its file; whether it failed (its error is in the file)."""
    file = FILES.get(part, part)
    report = Report.resume(out, file) if part == "summary" else Report(out, file)
    report.update(device=device, scale=scale.name)
    try:
        _runner(part, scale, device, out, work)(report)
    except Exception as exc:  # recorded in the part's file; the next part still runs
        report.finish(exc)
        sys.stderr.write(f"orchestrate bench device: {part}: {type(exc).__name__}: {exc}\n")
        return True
    report.finish()
    return False


def _runner(
    part: str, scale: Scale, device: Device, out: Path, work: Path
) -> Callable[[Report], None]:
    if part == "env":
        return lambda r: env(scale, device, r)
    if part == "tests":
        return lambda r: tests(r, work)
    if part == "summary":
        return lambda r: summary(scale, out, r)
    import importlib

    module = importlib.import_module(f"orchestrator.bench.device_{part}")
    run: Callable[..., None] = module.run
    if part == "codec":
        return lambda r: run(scale, device, r)
    return lambda r: run(scale, device, work, r)
