"""``orchestrate chaos --config X --fault NAME… [--runs N] [--out DIR] [--json] [--section.key V…]``

Runs the loop once per fault and run with that fault injected (``--fault all``: every fault),
checks the invariants of :mod:`orchestrator.chaos.invariants`, and prints one table row per
fault (the table of ``docs/reliability.md``). Exit status 0 when every invariant held in every
run, 1 otherwise; the details of each violation are printed under the table (and in ``--json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import anyio

from orchestrator.chaos.faults import FAULTS
from orchestrator.chaos.harness import Outcome, trial
from orchestrator.config import load_config, parse_overrides
from orchestrator.errors import ConfigError

COLUMNS = (
    ("fault", "fault"),
    ("runs", "runs"),
    ("episodes", "episodes"),
    ("lost", "lost"),
    ("duplicated", "duplicated"),
    ("wrong_version", "wrong-version responses"),
    ("unverified", "unverified versions served"),
    ("failed_or_dropped", "failed/dropped (recorded)"),
    ("leftover", "processes left"),
    ("recovery_s", "recovery s (worst)"),
    ("ok", "invariants"),
    ("observed", "observed (first run)"),
)


def summarize(fault: str, outcomes: list[Outcome]) -> dict[str, Any]:
    """One table row over every run of ``fault``."""
    rows = [o.row() for o in outcomes]
    recoveries = [r["recovery_s"] for r in rows if r["recovery_s"] is not None]
    out: dict[str, Any] = {"fault": fault, "runs": len(rows)}
    for key in ("episodes", "lost", "duplicated", "wrong_version", "unverified"):
        out[key] = sum(r[key] for r in rows)
    out["failed_or_dropped"] = sum(r["failed_or_dropped"] for r in rows)
    out["leftover"] = sum(r["leftover"] for r in rows)
    out["recovery_s"] = max(recoveries) if recoveries else None
    out["ok"] = "held" if all(r["ok"] for r in rows) else "VIOLATED"
    out["what"] = FAULTS[fault].what
    out["observed"] = "; ".join(rows[0]["notes"]) if rows else ""
    out["trials"] = rows
    return out


def table(summaries: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(label for _, label in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    lines = [head, rule]
    for s in summaries:
        cells = ["n/a" if s[k] is None else str(s[k]) for k, _ in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="orchestrate chaos",
        description="Run the loop with injected faults and check that nothing was lost, "
        "duplicated or served at a wrong or unverified version.",
        epilog=f"Faults: {', '.join(FAULTS)}, or all.",
    )
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--fault", action="append", required=True, metavar="NAME")
    parser.add_argument("--runs", type=int, default=1, help="runs per fault (default 1)")
    parser.add_argument("--out", type=Path, default=Path("runs/chaos"))
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args, rest = parser.parse_known_args(argv)
    names = list(FAULTS) if "all" in args.fault else args.fault
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ConfigError(f"--fault: unknown {', '.join(unknown)} (known: {', '.join(FAULTS)})")
    if args.runs < 1:
        raise ConfigError("--runs: must be at least 1")
    overrides = parse_overrides(rest)
    load_config(args.config, overrides)  # a bad config fails before any run starts
    args.out.mkdir(parents=True, exist_ok=True)

    async def go() -> list[dict[str, Any]]:
        out = []
        for name in names:
            outcomes = [
                await trial(FAULTS[name], args.config, overrides, args.out, i)
                for i in range(args.runs)
            ]
            out.append(summarize(name, outcomes))
        return out

    summaries = anyio.run(go)
    if args.json:
        sys.stdout.write(json.dumps(summaries, indent=2) + "\n")
    else:
        sys.stdout.write(table(summaries) + "\n")
        for s in summaries:
            for t in s["trials"]:
                for p in t["problems"]:
                    sys.stdout.write(f"{s['fault']} ({t['run_dir']}): {p}\n")
    return 0 if all(s["ok"] == "held" for s in summaries) else 1
