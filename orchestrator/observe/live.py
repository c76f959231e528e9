"""The live terminal view of a run: endpoints, trainer version, lag histogram, throughput, steps,
and the length-bias guard (drop rate by sampled tokens and by turns, :mod:`staleness.length_bias`;
the run's stop drops left out).

:class:`LiveView` is an :class:`~orchestrator.record.events.EventSink` (tee it next to the event log
with :class:`orchestrator.observe.metrics.Tee`): it counts served calls, decided groups and their
lags, and follows the trainer version from the events; endpoint state (applied version, load,
health) is read from the pool when a frame is drawn. :meth:`LiveView.run` redraws with ``rich.live``
every ``refresh_s`` until cancelled — only call it when stdout is a terminal
(:func:`wanted`); otherwise the structured logs are the view.

Not covered: the engines' staged versions (the pool only knows applied versions).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import anyio
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from orchestrator.record.events import STOP_REASONS
from orchestrator.types import NullEvents
from staleness.config import LengthBiasConfig
from staleness.length_bias import AXES, LengthBias

if TYPE_CHECKING:
    from orchestrator.types import Endpoint
    from policies.wire.lane import VersionBounds


def wanted(stream: Any = None) -> bool:
    """Whether to draw the live view: only on an interactive terminal."""
    stream = sys.stdout if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


class LiveView(NullEvents):
    def __init__(self, max_steps: int, length_bias: LengthBiasConfig | None = None) -> None:
        lb = length_bias or LengthBiasConfig()
        self.length_bias = LengthBias(z_threshold=lb.z_threshold, min_groups=lb.min_groups)
        self.requeued = 0
        self.endpoints: dict[str, Endpoint] = {}  # the pool's live objects, as events name them
        self.max_steps = max_steps
        self.trainer_version = 0
        self.calls = 0
        self.groups: Counter[str] = Counter()
        self.lags: Counter[int] = Counter()
        self.t0 = time.monotonic()

    # -- EventSink ------------------------------------------------------------------------------
    def endpoint(self, ep: Endpoint) -> None:
        self.endpoints[ep.id] = ep

    def route(
        self,
        endpoints: Iterable[Endpoint],
        bounds: VersionBounds,
        affinity: str | None,
        exclude: Iterable[str],
        chosen: Endpoint | None,
    ) -> None:
        for ep in endpoints:
            self.endpoints.setdefault(ep.id, ep)

    def emit(self, kind: str, **f: Any) -> None:
        if kind == "served":
            self.calls += 1
        elif kind == "trainer_version":
            self.trainer_version = f["version"]
        elif kind == "decide":
            self.groups[f["decision"]] += 1
            self.lags[f["max_lag"]] += 1
            if "max_sampled_tokens" in f and f.get("reason") not in STOP_REASONS:
                self.length_bias.add(
                    f["max_sampled_tokens"], f["max_turns"], dropped=f["decision"] == "dropped"
                )
        elif kind == "requeue":
            self.requeued += 1

    # -- drawing --------------------------------------------------------------------------------
    def frame(self) -> Group:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        eps = Table(title="endpoints", expand=False)
        for col in ("endpoint", "applied", "lag", "load", "health"):
            eps.add_column(col)
        for e in self.endpoints.values():
            v = e.applied_version
            eps.add_row(
                e.id,
                "-" if v is None else f"v{v}",
                "-" if v is None else str(max(0, self.trainer_version - v)),
                f"{e.outstanding}/{max(1, int(e.limit))}",
                "[green]ok" if e.healthy and not e.removed else "[red]down",
            )
        hist = Table(title="group lag at decision", expand=False)
        hist.add_column("lag")
        hist.add_column("groups")
        hist.add_column("")
        top = max(self.lags.values(), default=1)
        for lag, n in sorted(self.lags.items()):
            hist.add_row(str(lag), str(n), "█" * max(1, round(20 * n / top)))
        kept, dropped = self.groups["kept"], self.groups["dropped"]
        status = (
            f"trainer v{self.trainer_version}/{self.max_steps} · "
            f"{self.calls / elapsed:.1f} calls/s · groups kept {kept}, dropped {dropped} · "
            f"{elapsed:.0f}s"
        )
        bar = ProgressBar(total=self.max_steps, completed=min(self.trainer_version, self.max_steps))
        if self.requeued:
            status += f" · requeued {self.requeued}"
        return Group(status, bar, eps, hist, self._length_table())

    def _length_table(self) -> Table:
        """One row per axis: drop rate per bucket, and the long-vs-short verdict."""
        t = Table(title="drop rate by length (longest episode of the group)", expand=False)
        for col in ("by", "buckets: drop rate (groups)", "long vs short"):
            t.add_column(col)
        for axis in AXES:
            v = self.length_bias.verdict(axis)
            cells = " ".join(
                f"{label}:{c.drop_rate:.0%}({c.decided})"
                for label, c in self.length_bias.rows(axis)
            )
            if v.split < 0:
                verdict = "-"
            else:
                verdict = f"{v.long.drop_rate:.0%} vs {v.short.drop_rate:.0%} z={v.z:.1f}"
                if v.biased:
                    verdict = f"[red]{verdict} BIASED"
            t.add_row(axis, cells or "-", verdict)
        return t

    async def run(self, console: Console | None = None, refresh_s: float = 0.5) -> None:
        """Redraw until cancelled (a display refresh, not coordination: sleeping is right)."""
        with Live(self.frame(), console=console, auto_refresh=False, transient=False) as live:
            while True:
                live.update(self.frame(), refresh=True)
                await anyio.sleep(refresh_s)
