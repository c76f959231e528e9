"""``orchestrate report RUN_DIR``: one self-contained HTML page about a run, with PNG plots.

    orchestrate report RUN_DIR [--out FILE]      (default RUN_DIR/report.html)

Reads the trajectory log (``RUN_DIR/trajectories``) and, when present, the scheduler event log
(``RUN_DIR/events``), and writes one HTML file whose plots are PNGs embedded as data URIs (no
external file, script or font: it opens offline and can be mailed):

- reward: mean reward per trainer step, and every episode's reward over time;
- lag: each episode's max lag (trainer version at decision − oldest version that sampled it)
  over time, kept and dropped;
- versions: the applied version of each endpoint over time (from ``endpoint`` and ``served``
  events), with the trainer version;
- sync: for each published version, seconds until each endpoint was seen serving it — as the
  orchestrator observed it (by poll or response stamp), so an upper bound on the real swap time;
- drops: drop rate per trainer step;
- length bias: drop rate per bucket of sampled tokens and of turns (the group's longest episode),
  the long-vs-short test and its verdict (:mod:`staleness.length_bias`, the live guard's code);
  groups the run's stop dropped are left out.

Times are seconds since the first record. A plot whose data is absent (no event log, no step
yet) says so instead of drawing. Pure data first (:func:`report_data`), rendering second.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import structlog
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from orchestrator.offline.inspect_log import LogSummary, resolve_log, summarize
from orchestrator.record.events import STOP_REASONS, read_events
from orchestrator.record.trajlog import (
    EpisodeRecord,
    batch_records,
    episode_records,
    run_header,
)
from staleness.config import LengthBiasConfig
from staleness.length_bias import AXES, Axis, LengthBias

log = structlog.get_logger(__name__)

Series = list[tuple[float, float]]


@dataclass
class ReportData:
    """Everything the page shows, as plain numbers (seconds since ``t0``)."""

    run: str
    summary: LogSummary
    step_reward: Series = field(default_factory=list)  # (t, reward mean) per trainer step
    step_versions: list[int] = field(default_factory=list)  # the version each step produced
    episode_reward: Series = field(default_factory=list)  # (t, reward)
    lag_kept: Series = field(default_factory=list)  # (t, max lag)
    lag_dropped: Series = field(default_factory=list)
    endpoint_versions: dict[str, Series] = field(default_factory=dict)  # id -> (t, version)
    trainer_versions: Series = field(default_factory=list)  # (t, version)
    sync: dict[str, Series] = field(default_factory=dict)  # id -> (version, seconds)
    step_drop_rate: Series = field(default_factory=list)  # (trainer version, drop rate)
    length_bias: LengthBias | None = None
    requeued: int = 0  # groups re-run after a staleness drop (``requeue`` events)
    has_events: bool = False


def report_data(run_dir: Path) -> ReportData:
    log_dir = resolve_log(run_dir)
    records = episode_records(log_dir)
    batches = batch_records(log_dir)
    header = run_header(log_dir)
    events_dir = log_dir.parent / "events"
    events = read_events(events_dir) if events_dir.is_dir() else []
    times = [r.episode.finished_at for r in records] + [b.logged_at for b in batches]
    times += [e["t"] for e in events]
    t0 = min(times) if times else 0.0
    d = ReportData(
        run=header.run if header else (records[0].run if records else run_dir.name),
        summary=summarize(records, batches),
        has_events=bool(events),
    )
    d.step_reward = [(b.logged_at - t0, b.metrics.get("reward_mean", 0.0)) for b in batches]
    d.step_versions = [b.produced_version for b in batches]
    for r in records:
        t = r.episode.finished_at - t0
        d.episode_reward.append((t, r.episode.reward))
        starts = [s.policy_version.start for s in r.episode.segments]
        if starts:
            lag = r.trainer_version - min(starts)
            (d.lag_kept if r.decision.decision == "kept" else d.lag_dropped).append((t, lag))
    first_of_group = {r.decision.group_id: r for r in reversed(records)}
    per_version: dict[int, list[bool]] = {}
    for r in first_of_group.values():
        per_version.setdefault(r.trainer_version, []).append(r.decision.decision == "dropped")
    d.step_drop_rate = [(v, sum(x) / len(x)) for v, x in sorted(per_version.items())]
    if records:
        d.length_bias = length_bias(records, header.config if header else None)
    _from_events(d, events, t0)
    return d


def length_bias(records: list[EpisodeRecord], config: dict[str, Any] | None = None) -> LengthBias:
    """The length-bias counts of the logged groups the staleness policy decided (one per group,
    its longest episode), with the run's thresholds when its config is known."""
    lb = LengthBiasConfig.model_validate(
        ((config or {}).get("staleness") or {}).get("length_bias") or {}
    )
    groups: dict[str, tuple[int, int, bool]] = {}
    for r in records:
        if r.decision.decision == "dropped" and r.decision.reason in STOP_REASONS:
            continue
        tokens, turns, _ = groups.get(r.decision.group_id, (0, 0, False))
        groups[r.decision.group_id] = (
            max(tokens, r.episode.n_sampled),
            max(turns, len(r.episode.segments)),
            r.decision.decision == "dropped",
        )
    return LengthBias.of(groups.values(), z_threshold=lb.z_threshold, min_groups=lb.min_groups)


def _from_events(d: ReportData, events: list[dict[str, Any]], t0: float) -> None:
    published: dict[int, float] = {}
    synced: set[tuple[str, int]] = set()

    def applied(endpoint: str, version: int | None, t: float) -> None:
        if version is None:
            return
        series = d.endpoint_versions.setdefault(endpoint, [])
        if not series or series[-1][1] != version:
            series.append((t, version))
        for v, tp in published.items():
            if v <= version and (endpoint, v) not in synced:
                synced.add((endpoint, v))
                d.sync.setdefault(endpoint, []).append((v, max(0.0, t - tp)))

    for e in events:
        t = e["t"] - t0
        match e["kind"]:
            case "trainer_version":
                if not d.trainer_versions:  # the version before the first step, from the start
                    d.trainer_versions.append((events[0]["t"] - t0, e["version"] - 1))
                published[e["version"]] = t
                d.trainer_versions.append((t, e["version"]))
            case "endpoint":
                applied(e["id"], e["applied_version"], t)
            case "served":
                applied(e["endpoint"], e["end"], t)
            case "requeue":
                d.requeued += 1


# -- rendering ------------------------------------------------------------------------------------
STYLE = """<style>
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 80em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
th, td { text-align: left; padding: .2em 1em .2em 0; border-bottom: 1px solid #ddd; }
figure { display: inline-block; margin: 0 1em 1.5em 0; }
figcaption { font-weight: 600; margin-bottom: .3em; }
img { max-width: 100%; }
</style>"""
"""The stylesheet of every HTML page the offline tools write."""


def png(draw: Callable[[Axes], None], title: str) -> str:
    """One plot, drawn by ``draw`` on titled, gridded axes, as a base64 PNG."""
    fig = Figure(figsize=(7.5, 3.2), dpi=100, layout="tight")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    draw(ax)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode()


def _xy(series: Series) -> tuple[list[float], list[float]]:
    return [p[0] for p in series], [p[1] for p in series]


def _empty(ax: Axes, why: str) -> None:
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="gray")


def _reward(d: ReportData, ax: Axes) -> None:
    if d.episode_reward:
        ax.scatter(*_xy(d.episode_reward), s=6, alpha=0.3, label="episode")
    if d.step_reward:
        ax.plot(*_xy(d.step_reward), "o-", color="C1", label="step mean")
        for (t, r), v in zip(d.step_reward, d.step_versions, strict=True):
            ax.annotate(f"v{v}", (t, r), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("seconds")
    ax.set_ylabel("reward")
    if d.episode_reward or d.step_reward:
        ax.legend(fontsize=8)
    else:
        _empty(ax, "no episodes logged")


def _lag(d: ReportData, ax: Axes) -> None:
    if d.lag_kept:
        ax.scatter(*_xy(d.lag_kept), s=8, label="kept")
    if d.lag_dropped:
        ax.scatter(*_xy(d.lag_dropped), s=8, color="C3", marker="x", label="dropped")
    ax.set_xlabel("seconds")
    ax.set_ylabel("max lag (versions)")
    if d.lag_kept or d.lag_dropped:
        ax.legend(fontsize=8)
    else:
        _empty(ax, "no model calls logged")


def _versions(d: ReportData, ax: Axes) -> None:
    for name, series in sorted(d.endpoint_versions.items()):
        ax.step(*_xy(series), where="post", label=name)
    if d.trainer_versions:
        ax.step(*_xy(d.trainer_versions), where="post", color="k", ls="--", label="trainer")
    ax.set_xlabel("seconds")
    ax.set_ylabel("version")
    if d.endpoint_versions or d.trainer_versions:
        ax.legend(fontsize=8)
    else:
        _empty(ax, "no event log" if not d.has_events else "no version seen")


def _sync(d: ReportData, ax: Axes) -> None:
    for name, series in sorted(d.sync.items()):
        ax.plot(*_xy(series), "o-", label=name)
    ax.set_xlabel("version")
    ax.set_ylabel("seconds to observed sync")
    if d.sync:
        ax.legend(fontsize=8)
    else:
        _empty(ax, "no event log" if not d.has_events else "no version published")


def _by_length(axis: Axis, d: ReportData, ax: Axes) -> None:
    rows = d.length_bias.rows(axis) if d.length_bias is not None else []
    if rows:
        ax.bar([lbl for lbl, _ in rows], [c.drop_rate for _, c in rows], color="C3")
        for i, (_, c) in enumerate(rows):
            ax.annotate(f"{c.decided}", (i, c.drop_rate), ha="center", fontsize=7)
        ax.set_xlabel(f"{axis} of the group's longest episode (groups above bars)")
    else:
        _empty(ax, "no decided groups logged")
    ax.set_ylabel("drop rate")
    ax.set_ylim(0, 1)


def _step_drops(d: ReportData, ax: Axes) -> None:
    if d.step_drop_rate:
        ax.plot(*_xy(d.step_drop_rate), "o-", color="C3")
    else:
        _empty(ax, "no decisions logged")
    ax.set_xlabel("trainer version at decision")
    ax.set_ylabel("group drop rate")
    ax.set_ylim(0, 1)


_PLOTS: tuple[tuple[str, str, Callable[[ReportData, Axes], None]], ...] = (
    ("Reward", "reward: episodes over time, mean per step", _reward),
    ("Lag over time", "max lag per episode", _lag),
    ("Version per endpoint", "applied version per endpoint", _versions),
    ("Sync durations", "publish → endpoint serving it", _sync),
    ("Drop rate by sampled tokens", "drop rate by sampled tokens", partial(_by_length, "tokens")),
    ("Drop rate by turns", "drop rate by turns", partial(_by_length, "turns")),
    ("Drop rate per step", "groups dropped per trainer version", _step_drops),
)
"""The page's plots in page order: title, the plot's own title, how it is drawn."""


def plots(d: ReportData) -> dict[str, str]:
    """Title → base64 PNG, one per plot, in page order."""
    return {title: png(partial(draw, d), caption) for title, caption, draw in _PLOTS}


def render_html(d: ReportData) -> str:
    s = d.summary
    rows = [
        ("episodes", f"{s.episodes} ({s.episodes_dropped} dropped, {s.errors} errors)"),
        ("groups", f"{s.groups} ({s.groups_dropped} dropped)"),
        ("trainer steps", str(s.steps)),
        ("mean reward", f"{s.reward_mean:.4f}"),
        ("stop reasons", ", ".join(f"{k}×{n}" for k, n in s.stop_reasons.most_common())),
        ("length-biased drops", "yes" if d.length_bias and d.length_bias.biased else "no"),
        ("groups requeued", str(d.requeued)),
    ]
    table = "\n".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows
    )
    section = _length_section(d.length_bias)
    figures = "\n".join(
        f"<figure><figcaption>{html.escape(title)}</figcaption>"
        f'<img alt="{html.escape(title)}" src="data:image/png;base64,{png}"></figure>'
        for title, png in plots(d).items()
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>sprawl run {html.escape(d.run)}</title>
{STYLE}</head>
<body>
<h1>sprawl run <code>{html.escape(d.run)}</code></h1>
<table>
{table}
</table>
{section}
{figures}
</body></html>
"""


def _length_section(lb: LengthBias | None) -> str:
    """The length-bias section: per axis, the short and long halves' drop rates and the test."""
    if lb is None or not lb.decided:
        return '<h2 id="length-bias">Length bias</h2><p>no decided groups logged</p>'
    rows = []
    for axis in AXES:
        v = lb.verdict(axis)
        if v.split < 0:
            cells = ["-", "-", "-", "too few buckets"]
        else:
            cells = [
                f"{v.short.drop_rate:.1%} of {v.short.decided}",
                f"{v.long.drop_rate:.1%} of {v.long.decided}",
                f"{v.z:.2f}",
                "BIASED" if v.biased else "no",
            ]
        rows.append(
            f"<tr><th>{axis}</th>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"
        )
    return (
        '<h2 id="length-bias">Length bias</h2>\n'
        f"<p>{lb.decided} groups decided by the staleness policy, {lb.dropped} dropped (the run's "
        f"stop drops left out). Biased: z ≥ {lb.z_threshold:g} with ≥ {lb.min_groups} groups "
        "per half.</p>\n<table>\n<tr><th>by</th><th>short half dropped</th>"
        "<th>long half dropped</th><th>z</th><th>verdict</th></tr>\n"
        + "\n".join(rows)
        + "\n</table>"
    )


def write_report(run_dir: Path, out: Path) -> Path:
    """Render ``run_dir``'s report into ``out`` (written whole: temp file + rename)."""
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(render_html(report_data(run_dir)), encoding="utf-8")
    tmp.replace(out)
    return out


def write_run_report(run_dir: Path) -> Path | None:
    """``<run dir>/report.html`` at the end of a run (``run.report``); None if it failed, which
    is logged: the run itself is done and its logs are intact, ``orchestrate report`` retries."""
    try:
        return write_report(run_dir, run_dir / "report.html")
    except Exception as exc:  # a plot must not turn a finished run into a failed one
        log.warning("report_failed", run_dir=str(run_dir), error=f"{type(exc).__name__}: {exc}")
        return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="orchestrate report", description="Write a self-contained HTML report of a run."
    )
    parser.add_argument("run_dir", type=Path, help="a run directory (holds trajectories/)")
    parser.add_argument("--out", type=Path, help="output file (default RUN_DIR/report.html)")
    args = parser.parse_args(argv)
    out = write_report(args.run_dir, args.out or args.run_dir / "report.html")
    sys.stdout.write(f"{out}\n")
    return 0
