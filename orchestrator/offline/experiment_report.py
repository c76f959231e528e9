"""What ``orchestrate experiment lag`` writes besides ``summary.json``: the per-step rewards as
CSV and PNG, and ``report.html``, one self-contained page (PNG plots as data URIs, drawn as
``orchestrate report`` draws them, :func:`orchestrator.offline.report.png`) with the verdict, the
table of second-half reward per arm and lag, reward against lag per arm (mean ± 95% t-interval
over seeds; the lag-0 point of every arm is on-policy), and each run's reward per step; where
the runs were scored, the final-policy reward's table and plot as well.
"""

from __future__ import annotations

import csv
import html
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from matplotlib.axes import Axes

from orchestrator.offline.experiment_arms import ARMS, ArmResult
from orchestrator.offline.experiment_verdict import (
    FINAL,
    FINAL_TITLE,
    SECOND_HALF,
    ArmStats,
    Statistic,
    arm_stats,
    scored,
    table,
)
from orchestrator.offline.report import STYLE, png


def write_csv(results: Sequence[ArmResult], path: Path) -> None:
    steps = max((len(r.rewards) for r in results), default=0)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *(f"{r.arm}/s{r.seed}" for r in results)])
        for i in range(steps):
            w.writerow(
                [i + 1, *(f"{r.rewards[i]:.6f}" if i < len(r.rewards) else "" for r in results)]
            )


def _by_run(results: Sequence[ArmResult]) -> dict[str, list[ArmResult]]:
    by_run: dict[str, list[ArmResult]] = {}
    for r in results:
        by_run.setdefault(r.arm, []).append(r)
    return by_run


def draw_steps(results: Sequence[ArmResult], ax: Axes) -> None:
    """Each run's reward per trainer step, averaged over seeds (raw and a moving average)."""
    for runs in _by_run(results).values():
        n = min(len(r.rewards) for r in runs)
        mean = [sum(r.rewards[i] for r in runs) / len(runs) for i in range(n)]
        xs = list(range(1, n + 1))
        (line,) = ax.plot(xs, mean, alpha=0.3, linewidth=1)
        k = max(1, n // 8)
        smooth = [
            sum(mean[max(0, i - k + 1) : i + 1]) / len(mean[max(0, i - k + 1) : i + 1])
            for i in range(n)
        ]
        label = f"{runs[0].label} ({len(runs)} seed{'s' * (len(runs) > 1)})"
        ax.plot(xs, smooth, color=line.get_color(), linewidth=2, label=label)
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean episode reward over seeds")
    ax.legend(fontsize=7)


def draw_lags(stats: Sequence[ArmStats], ax: Axes, ylabel: str = "second-half reward") -> None:
    """A statistic (``ylabel``) against lag, one line per arm from on-policy at lag 0, with the
    95% t-interval over seeds as error bars; on-policy's level as a dashed line."""
    ref = next(s for s in stats if s.lag == 0)
    ax.axhline(ref.mean, color="gray", linestyle="--", linewidth=1, label=ref.label)
    for arm in ARMS:
        lagged = sorted((s for s in stats if s.correction == arm.name), key=lambda s: s.lag)
        points = [ref, *lagged]
        if len(points) > 1:
            ax.errorbar(
                [s.lag for s in points],
                [s.mean for s in points],
                yerr=[s.ci95 for s in points],
                marker="o",
                capsize=3,
                label=arm.label,
            )
    lags = sorted({s.lag for s in stats})
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks(lags, [str(lag) for lag in lags])
    ax.set_xlabel("scheduler.max_lag (trainer versions)")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


def write_png(results: Sequence[ArmResult], path: Path, title: str) -> None:
    """``rewards.png``: :func:`draw_steps` with ``title`` (the verdict) above it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=120, layout="tight")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=7, loc="left")
    ax.grid(alpha=0.3)
    draw_steps(results, ax)
    fig.savefig(path)


def _html_table(results: Sequence[ArmResult], statistic: Statistic) -> str:
    header, rows = table(results, statistic)
    cells = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>\n"
    cells += "\n".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table>\n{cells}\n</table>"


def render_html(results: Sequence[ArmResult], text: str, command: str) -> str:
    tables = _html_table(results, SECOND_HALF)
    figures = {
        "Reward against lag per arm": png(
            partial(draw_lags, arm_stats(results)), "second-half reward, mean ± 95% over seeds"
        ),
    }
    if scored(results):
        tables += f"\n<h2>{html.escape(FINAL_TITLE.capitalize())}</h2>\n"
        tables += _html_table(results, FINAL)
        figures["Final-policy reward against lag per arm"] = png(
            partial(draw_lags, arm_stats(results, FINAL), ylabel="final-policy reward"),
            "final-policy reward, mean ± 95% over seeds",
        )
    figures["Reward per step"] = png(partial(draw_steps, results), "reward per trainer step")
    body = "\n".join(
        f"<figure><figcaption>{html.escape(title)}</figcaption>"
        f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}"></figure>'
        for title, data in figures.items()
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>sprawl lag experiment</title>
{STYLE}</head>
<body>
<h1>sprawl lag experiment</h1>
<p><code>{html.escape(command)}</code></p>
<h2>Second-half reward, mean ± 95% t-interval over seeds</h2>
{tables}
<pre>{html.escape(text)}</pre>
{body}
</body></html>
"""


def write_html(results: Sequence[ArmResult], text: str, command: str, path: Path) -> None:
    """``report.html`` (written whole: temp file + rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(render_html(results, text, command), encoding="utf-8")
    tmp.replace(path)
