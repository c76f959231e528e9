"""The sidecar's Prometheus metrics: versions served, activations and their pauses, refusals.

One :class:`SidecarMetrics` per sidecar, registered in the registry its lane serves at
``GET /metrics``. The names are part of what a user sees (dashboards and alerts read them;
``docs/fleet.md``); a counter ``sprawl_x`` is exposed as ``sprawl_x_total``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class SidecarMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.applied = Gauge(
            "sprawl_applied_version", "Policy version being served", registry=registry
        )
        self.activations = Counter(
            "sprawl_version_activations", "Versions activated", registry=registry
        )
        self.failures = Counter(
            "sprawl_version_failures", "Versions refused by verification", registry=registry
        )
        self.pause = Histogram(
            "sprawl_activation_pause_seconds",
            "Time generation was held while a version was applied",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0),
            registry=registry,
        )
        self.conflicts = Counter(
            "sprawl_version_conflicts", "Requests answered 409", registry=registry
        )
        self.tokens = Counter("sprawl_generated_tokens", "Tokens sampled", registry=registry)
        self.stamp_mismatches = Counter(
            "sprawl_version_stamp_mismatch",
            "Choices whose engine-reported versions disagree with the sidecar's stamps",
            registry=registry,
        )
        self.board_bytes = Counter(
            "sprawl_board_bytes_read",
            "Bytes read from the board to stage versions (patches; anchors when needed)",
            registry=registry,
        )
        self.activation_failures = Counter(
            "sprawl_activation_failures",
            "Activations the engine failed (the old version kept serving; retried with backoff)",
            registry=registry,
        )
