"""``orchestrate bench async``: synchronous vs asynchronous RL on a simulated fleet.

Runs the real scheduler against :mod:`orchestrator.bench.simulate`'s heterogeneous fleet (lognormal
generation lengths, three speed classes, one endpoint that applies versions a minute late) and
a trainer whose step takes a fixed time, in virtual time. Reports, per ``max_lag``, trained
episodes per second and the trainer's idle fraction, with the ratio to the synchronous run
(``max_lag = 0``, a barrier per step) measured in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from functools import partial
from pathlib import Path

import anyio
from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer
from trio.testing import MockClock

from orchestrator.bench.simulate import SimResult, simulate
from policies.wire.logs import configure


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="orchestrate bench async")
    parser.add_argument("--lags", default="0,1,2,4", help="max_lag values; 0 is the baseline")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--trainer-step-s", type=float, default=10.0, help="simulated trainer step (virtual s)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, help="tokenizer dir (default: build sprawl's tiny)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    lags = [int(x) for x in args.lags.split(",")]
    configure("auto", "warning")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from policies.model.build import init_model

            model = init_model(Path(tmp) / "tiny", "tiny")
        tokenizer = AutoTokenizer.from_pretrained(model)
        results = [
            anyio.run(
                partial(
                    simulate,
                    tokenizer,
                    max_lag=lag,
                    steps=args.steps,
                    seed=args.seed,
                    trainer_step_s=args.trainer_step_s,
                ),
                backend="trio",
                backend_options={"clock": MockClock(autojump_threshold=0)},
            )
            for lag in lags
        ]
    base = results[0]
    rows = [
        {**asdict(r), "speedup": round(r.episodes_per_s / base.episodes_per_s, 2)} for r in results
    ]
    if args.json:
        sys.stdout.write(json.dumps({"baseline_max_lag": base.max_lag, "runs": rows}, indent=1))
        sys.stdout.write("\n")
    else:
        _table(rows, base)
    return 0


def _table(rows: list[dict[str, float]], base: SimResult) -> None:
    table = Table(
        "max_lag",
        "virtual s",
        "episodes/s",
        f"× max_lag={base.max_lag}",
        "trainer idle",
        "dropped groups",
        "mean lag",
    )
    for r in rows:
        table.add_row(
            str(r["max_lag"]),
            str(r["seconds"]),
            str(r["episodes_per_s"]),
            str(r["speedup"]),
            f"{r['trainer_idle']:.0%}",
            str(r["dropped_groups"]),
            str(r["mean_lag"]),
        )
    Console().print(table)
