"""Prometheus metrics move with the event log and are served on ``GET /metrics``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.loop.admin import AdminApp
from orchestrator.loop.pool import Pool
from orchestrator.observe.metrics import RunMetrics
from orchestrator.record.events import read_events
from tests.support.events import pool_run
from tests.support.fakes import ScriptedTransport


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
    runner = web.AppRunner(AdminApp(pool, token=None, metrics=metrics).app)  # the admin API
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            samples = _samples(await r.text())
    finally:
        await runner.cleanup()
    assert samples[("sprawl_trainer_version", ())] == 3
    assert samples[("sprawl_groups_total", (("decision", "dropped"),))] == 1
    assert samples[("sprawl_group_lag_bucket", (("le", "4.0"),))] == 0
    assert samples[("sprawl_group_lag_bucket", (("le", "6.0"),))] == 1
