"""The fault-injection suite: the real loop, one fault per run, every invariant checked.

Each case is one ``orchestrate chaos`` trial (subprocesses: orchestrator, engines, and a trainer
or restarts where the fault needs them). A trial passes only when the fault left its trace in
the logs (it really struck) and nothing was lost, duplicated, served out of bounds or served
unverified, the trainer reached ``max_steps`` and no process was left behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.chaos.faults import FAULTS
from orchestrator.chaos.harness import trial
from sandbox import SandboxConfig, SandboxPool
from sandbox.errors import SandboxUnavailableError

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

CONFIG = Path(__file__).resolve().parents[2] / "tests" / "support" / "loop.toml"


@pytest.mark.parametrize("name", [n for n in FAULTS if n != "none"])
async def test_nothing_lost_duplicated_or_served_wrong(
    name: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    if name == "sandbox-crash":
        try:
            SandboxPool(SandboxConfig())
        except SandboxUnavailableError as exc:
            pytest.skip(f"bubblewrap cannot run here: {exc}")
    overrides = {"model.path": str(tiny_model_dir)}  # else the chaos defaults, as in the docs
    outcome = await trial(FAULTS[name], CONFIG, overrides, tmp_path, timeout_s=300)
    row = outcome.row()
    assert row["ok"], "\n".join(row["problems"])
    assert row["episodes"] > 0
    assert (row["lost"], row["duplicated"], row["wrong_version"], row["unverified"]) == (0, 0, 0, 0)
    assert row["final_version"] >= 4
    assert row["leftover"] == 0
