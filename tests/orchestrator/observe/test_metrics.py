"""Prometheus metrics move with the event log and are served on ``GET /metrics``."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from orchestrator.loop.admin import AdminApp
from orchestrator.loop.pool import Pool
from orchestrator.observe.metrics import RunMetrics
from orchestrator.record.events import STOPPED_UNTRAINED, read_events
from orchestrator.record.trajlog import TrajectoryLog
from orchestrator.types import Decision, Group, GroupDecision
from staleness.config import LengthBiasConfig
from tests.support.events import pool_run
from tests.support.fakes import ScriptedTransport
from tests.support.trajectories import make_episode


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_agree_with_the_event_log(tmp_path: Path) -> None:
    metrics = RunMetrics()
    pool_run(tmp_path, also=metrics)
    events = read_events(tmp_path)
    samples = _samples(metrics.exposition().decode())
    for kind, name in [
        ("served", "sprawl_calls_total"),
        ("call_failed", "sprawl_call_failures_total"),
        ("version_unavailable", "sprawl_version_unavailable_total"),
    ]:
        per_endpoint = Counter(e["endpoint"] for e in events if e["kind"] == kind)
        assert per_endpoint, kind
        for ep, n in per_endpoint.items():
            assert samples[(name, (("endpoint", ep),))] == n
    last = {e["id"]: e for e in events if e["kind"] == "endpoint"}
    for ep, e in last.items():
        assert samples[("sprawl_endpoint_healthy", (("endpoint", ep),))] == float(e["healthy"])
    assert samples[("sprawl_endpoint_applied_version", (("endpoint", "a"),))] == 2
    waits = sum(e["kind"] == "route" and e["chosen"] is None for e in events)
    assert samples[("sprawl_waiting_routes_total", ())] == waits > 0


@pytest.mark.anyio
async def test_metrics_endpoint_serves_prometheus_text() -> None:
    metrics = RunMetrics()
    metrics.emit("trainer_version", version=3)
    metrics.emit(
        "decide", group_id="g1", trainer_version=3, decision="dropped", max_lag=5, reason=""
    )
    pool = Pool(ScriptedTransport({}), version_wait_s=1.0, poll_interval_s=1.0)
    runner = web.AppRunner(AdminApp(pool, token="t0k", metrics=metrics).app)  # the admin API
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        async with (
            aiohttp.ClientSession(headers={"Authorization": "Bearer t0k"}) as s,
            s.get(f"http://127.0.0.1:{port}/metrics") as r,
        ):
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            samples = _samples(await r.text())
    finally:
        await runner.cleanup()
    assert samples[("sprawl_trainer_version", ())] == 3
    assert samples[("sprawl_groups_total", (("decision", "dropped"),))] == 1
    assert samples[("sprawl_group_lag_bucket", (("le", "4.0"),))] == 0
    assert samples[("sprawl_group_lag_bucket", (("le", "6.0"),))] == 1


def _group(rng: random.Random, index: int, turns: int) -> Group:
    gid = f"g{index:06d}"
    return Group(
        id=gid,
        task_id=f"t{index}",
        episodes=[make_episode(rng, gid, i, 3, turns=turns) for i in range(2)],
    )


def test_length_bias_metrics_follow_the_decide_events(tmp_path: Path) -> None:
    """Decisions written by the trajectory log move the by-length counters; the run's stop drops
    are left out; the gauge and the warning fire once long groups are dropped beyond noise."""
    metrics = RunMetrics(LengthBiasConfig(min_groups=10))
    tlog = TrajectoryLog(tmp_path, run="t", events=metrics)
    rng = random.Random(0)
    groups = [(_group(rng, i, 1), i % 10 == 0) for i in range(20)]  # short: 10 % dropped
    groups += [(_group(rng, 20 + i, 12), i % 5 < 4) for i in range(20)]  # long: 80 % dropped
    with capture_logs() as logs:
        for g, dropped in groups:
            decision: Decision = "dropped" if dropped else "kept"
            tlog.write_group(
                g, GroupDecision(group_id=g.id, decision=decision, max_lag=1, reason="")
            )
        for i in range(5):  # the run's stop: not a staleness decision
            g = _group(rng, 100 + i, 1)
            stop = GroupDecision(
                group_id=g.id, decision="dropped", max_lag=0, reason=STOPPED_UNTRAINED
            )
            tlog.write_group(g, stop)
    tlog.close()
    samples = _samples(metrics.exposition().decode())
    by_turns = {
        (dict(labels)["bucket"], dict(labels)["decision"]): v
        for (name, labels), v in samples.items()
        if name == "sprawl_groups_decided_by_turns_total"
    }
    assert by_turns == {
        ("0-1", "kept"): 18,
        ("0-1", "dropped"): 2,
        ("9-16", "kept"): 4,
        ("9-16", "dropped"): 16,
    }
    by_tokens = [
        v for (name, _), v in samples.items() if name == "sprawl_groups_decided_by_tokens_total"
    ]
    assert sum(by_tokens) == 40  # every staleness decision once, the 5 stop drops left out
    assert samples[("sprawl_groups_total", (("decision", "dropped"),))] == 18 + 5
    assert samples[("sprawl_length_bias", (("axis", "turns"),))] == 1.0
    assert samples[("sprawl_length_bias_z", (("axis", "turns"),))] > 3
    warned = [e for e in logs if e["event"] == "length_bias"]
    assert "turns" in [w["axis"] for w in warned]
    assert len(warned) == len({w["axis"] for w in warned})  # once per crossing
    metrics.emit("requeue", group_id="g000021", task_id="t21", depth=1)
    assert _samples(metrics.exposition().decode())[("sprawl_groups_requeued_total", ())] == 1


def test_admissions_and_decisions_are_counted_per_environment() -> None:
    m = RunMetrics()
    m.emit("admit", index=0, group_id="g000000", task_id="t", environment="calc")
    m.emit("admit", index=1, group_id="g000001", task_id="t")  # a log without the field
    for env, decision in [("calc", "kept"), ("guess", "dropped"), ("guess", "dropped")]:
        m.emit("decide", group_id="g", environment=env, decision=decision, max_lag=1, reason="")
    got = _samples(m.exposition().decode())
    assert got[("sprawl_environment_admitted_groups_total", (("environment", "calc"),))] == 1
    assert got[("sprawl_admitted_groups_total", ())] == 2
    key = (("decision", "dropped"), ("environment", "guess"))
    assert got[("sprawl_environment_groups_total", key)] == 2
    assert (
        got[("sprawl_environment_groups_total", (("decision", "kept"), ("environment", "calc")))]
        == 1
    )
