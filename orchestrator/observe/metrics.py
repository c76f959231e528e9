"""Prometheus metrics for the orchestrator, fed by the same events as the event log.

:class:`RunMetrics` is an :class:`~orchestrator.record.events.EventSink`: put it next to the
:class:`~orchestrator.record.events.EventLog` with :class:`Tee` (``trajlog.events = Tee(log,
metrics)``) and every decision the log records also moves a metric, so the two never disagree.
The orchestrator's admin API serves them as ``GET /metrics`` (Prometheus text format).

Metrics (all prefixed ``sprawl_``; one private registry per :class:`RunMetrics`):
``calls_total{endpoint}``, ``call_failures_total{endpoint}``,
``version_unavailable_total{endpoint}``, ``call_latency_seconds{endpoint}`` (histogram),
``endpoint_applied_version{endpoint}``, ``endpoint_healthy{endpoint}``, ``trainer_version``,
``admitted_groups_total``, ``groups_total{decision}``, ``group_lag`` (histogram of the lag of
decided groups), ``groups_filtered_total`` (groups dynamic sampling dropped for equal rewards,
``scheduler.dynamic_sampling``; among the ``dropped`` of ``groups_total``),
``waiting_routes_total`` (routing attempts that found no endpoint).

Supervision of the local fleet (:mod:`orchestrator.fleet.supervisor`):
``island_deaths_total{endpoint}`` (an island exited, stayed unhealthy, or failed to come up on a
restart), ``island_restarts_total{endpoint}`` (restarts that came up and serve again) and
``island_give_ups_total{endpoint}`` (restarts spent: out of rotation for the rest of the run).

The length-bias guard (:mod:`staleness.length_bias`; groups the run's stop dropped are left out):
``groups_decided_by_tokens_total{bucket,decision}`` and ``groups_decided_by_turns_total{bucket,
decision}`` (power-of-two buckets of the group's longest episode: ``0-1``, ``2``, ``3-4``, …),
``length_bias_z{axis}`` (the long-vs-short z statistic), ``length_bias{axis}`` (1 while the test
fires; a ``length_bias`` warning is logged once per crossing) and ``groups_requeued_total``.

``/metrics`` needs the admin API's bearer token like its other routes (a Prometheus scrape job
sets it from ``<run dir>/admin.json``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from orchestrator.loop.batcher import EQUAL_REWARDS
from orchestrator.record.events import STOP_REASONS
from orchestrator.types import EventSink, NullEvents
from staleness.config import LengthBiasConfig
from staleness.length_bias import AXES, Axis, LengthBias, bucket, bucket_label

if TYPE_CHECKING:
    from orchestrator.types import Endpoint
    from policies.wire.lane import VersionBounds


class Tee:
    """An event sink that forwards every call to several sinks, in order."""

    def __init__(self, *sinks: EventSink) -> None:
        self.sinks = sinks

    def emit(self, kind: str, **fields: Any) -> None:
        for s in self.sinks:
            s.emit(kind, **fields)

    def route(
        self,
        endpoints: Iterable[Endpoint],
        bounds: VersionBounds,
        affinity: str | None,
        exclude: Iterable[str],
        chosen: Endpoint | None,
    ) -> None:
        endpoints, exclude = list(endpoints), list(exclude)
        for s in self.sinks:
            s.route(endpoints, bounds, affinity, exclude, chosen)

    def endpoint(self, ep: Endpoint) -> None:
        for s in self.sinks:
            s.endpoint(ep)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


class RunMetrics(NullEvents):
    """Prometheus counters, gauges and histograms driven by orchestrator events."""

    def __init__(self, length_bias: LengthBiasConfig | None = None) -> None:
        lb = length_bias or LengthBiasConfig()
        self.length_bias = LengthBias(
            z_threshold=lb.z_threshold, min_groups=lb.min_groups, warn=True
        )
        self.registry = CollectorRegistry()
        # family by family, in the order /metrics lists them
        self._register_calls(self.registry)
        self._register_groups(self.registry)
        self._register_supervision(self.registry)
        self._register_episodes(self.registry)
        self._register_length_bias(self.registry)

    def _register_calls(self, r: CollectorRegistry) -> None:
        """Per endpoint: model calls, failures, 409s and latency; applied version and health."""
        self.calls = Counter("sprawl_calls", "Model calls served", ["endpoint"], registry=r)
        self.failures = Counter(
            "sprawl_call_failures", "Failed model calls", ["endpoint"], registry=r
        )
        self.conflicts = Counter(
            "sprawl_version_unavailable", "409 answers", ["endpoint"], registry=r
        )
        self.latency = Histogram(
            "sprawl_call_latency_seconds", "Model call latency", ["endpoint"], registry=r
        )
        self.applied = Gauge(
            "sprawl_endpoint_applied_version", "Applied policy version", ["endpoint"], registry=r
        )
        self.healthy = Gauge(
            "sprawl_endpoint_healthy", "1 when the endpoint is healthy", ["endpoint"], registry=r
        )

    def _register_groups(self, r: CollectorRegistry) -> None:
        """The trainer's version; groups admitted and decided (also by environment), their lag;
        routing attempts that found no endpoint."""
        self.trainer_version = Gauge("sprawl_trainer_version", "Trainer version", registry=r)
        self.admitted = Counter("sprawl_admitted_groups", "Groups admitted", registry=r)
        self.admitted_by_env = Counter(
            "sprawl_environment_admitted_groups",
            "Groups admitted, by environment",
            ["environment"],
            registry=r,
        )
        self.groups_by_env = Counter(
            "sprawl_environment_groups",
            "Groups decided, by environment and decision",
            ["environment", "decision"],
            registry=r,
        )
        self.groups = Counter(
            "sprawl_groups", "Groups decided, by decision", ["decision"], registry=r
        )
        self.group_lag = Histogram(
            "sprawl_group_lag",
            "Max lag of decided groups (versions)",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16, float("inf")),
            registry=r,
        )
        self.filtered = Counter(
            "sprawl_groups_filtered",
            "Groups dynamic sampling dropped because their rewards were all equal "
            "(scheduler.dynamic_sampling)",
            registry=r,
        )
        self.waiting = Counter(
            "sprawl_waiting_routes", "Routing attempts that found no endpoint", registry=r
        )

    def _register_supervision(self, r: CollectorRegistry) -> None:
        """The local fleet's supervision: deaths, restarts, give-ups per endpoint."""
        self.island_deaths = Counter(
            "sprawl_island_deaths",
            "Islands that went down (exited, unhealthy, failed to restart)",
            ["endpoint"],
            registry=r,
        )
        self.island_restarts = Counter(
            "sprawl_island_restarts",
            "Islands restarted and serving again",
            ["endpoint"],
            registry=r,
        )
        self.island_give_ups = Counter(
            "sprawl_island_give_ups",
            "Islands left out of rotation after fleet.max_restarts",
            ["endpoint"],
            registry=r,
        )

    def _register_episodes(self, r: CollectorRegistry) -> None:
        """Episodes whose history the template re-rendered, or that sprawl's turn logic ended."""
        self.history_rewritten = Counter(
            "sprawl_episodes_history_rewritten",
            "Episodes whose chat template re-renders earlier turns differently from the tokens "
            "the model saw (their reasoning left out)",
            registry=r,
        )
        self.orchestrator_errors = Counter(
            "sprawl_episodes_orchestrator_error",
            "Episodes ended by an exception in sprawl's own turn logic (a bug of ours, logged "
            "with its traceback as episode_orchestrator_error)",
            registry=r,
        )

    def _register_length_bias(self, r: CollectorRegistry) -> None:
        """The length-bias guard: decisions by length bucket, z and verdict per axis, requeues."""
        self.by_length = {
            axis: Counter(
                f"sprawl_groups_decided_by_{axis}",
                f"Groups decided by the staleness policy, by the {axis} of their longest episode "
                "(power-of-two bucket) and decision; the run's stop drops are left out",
                ["bucket", "decision"],
                registry=r,
            )
            for axis in AXES
        }
        self.bias_z = Gauge(
            "sprawl_length_bias_z",
            "z of 'long groups are dropped more than short ones' (staleness.length_bias)",
            ["axis"],
            registry=r,
        )
        self.biased = Gauge(
            "sprawl_length_bias", "1 while the length-bias test fires", ["axis"], registry=r
        )
        self.requeued = Counter(
            "sprawl_groups_requeued",
            "Groups re-run after a staleness drop (staleness.length_bias.requeue)",
            registry=r,
        )

    def _decided(self, f: dict[str, Any]) -> None:
        if "max_sampled_tokens" not in f or f.get("reason") in STOP_REASONS:
            return
        tokens, turns = int(f["max_sampled_tokens"]), int(f["max_turns"])
        self.length_bias.add(tokens, turns, dropped=f["decision"] == "dropped")
        lengths: dict[Axis, int] = {"tokens": tokens, "turns": turns}
        for axis, n in lengths.items():
            label = bucket_label(bucket(n))
            self.by_length[axis].labels(label, f["decision"]).inc()
            v = self.length_bias.verdict(axis)
            self.bias_z.labels(axis).set(v.z)
            self.biased.labels(axis).set(float(v.biased))

    def emit(self, kind: str, **f: Any) -> None:
        match kind:
            case "served":
                self.calls.labels(f["endpoint"]).inc()
                self.latency.labels(f["endpoint"]).observe(f["latency_s"])
            case "call_failed":
                self.failures.labels(f["endpoint"]).inc()
            case "version_unavailable":
                self.conflicts.labels(f["endpoint"]).inc()
            case "trainer_version":
                self.trainer_version.set(f["version"])
            case "admit":
                self.admitted.inc()
                if f.get("environment") is not None:
                    self.admitted_by_env.labels(f["environment"]).inc()
            case "decide":
                self.groups.labels(f["decision"]).inc()
                if f.get("environment") is not None:
                    self.groups_by_env.labels(f["environment"], f["decision"]).inc()
                self.group_lag.observe(f["max_lag"])
                if f.get("reason") == EQUAL_REWARDS:
                    self.filtered.inc()
                self.history_rewritten.inc(f.get("history_rewritten", 0))
                self.orchestrator_errors.inc(f.get("orchestrator_errors", 0))
                self._decided(f)
            case "requeue":
                self.requeued.inc()
            case "island_died":
                self.island_deaths.labels(f["endpoint"]).inc()
            case "island_restarted":
                self.island_restarts.labels(f["endpoint"]).inc()
            case "island_gave_up":
                self.island_give_ups.labels(f["endpoint"]).inc()
            case _:
                pass

    def route(
        self,
        endpoints: Iterable[Endpoint],
        bounds: VersionBounds,
        affinity: str | None,
        exclude: Iterable[str],
        chosen: Endpoint | None,
    ) -> None:
        if chosen is None:
            self.waiting.inc()

    def endpoint(self, ep: Endpoint) -> None:
        self.healthy.labels(ep.id).set(1.0 if ep.healthy else 0.0)
        if ep.applied_version is not None:
            self.applied.labels(ep.id).set(ep.applied_version)

    def exposition(self) -> bytes:
        """The current values in Prometheus text format."""
        data: bytes = generate_latest(self.registry)
        return data
