"""``orchestrate inspect LOG``: what is in a trajectory log, and one episode as a transcript.

    orchestrate inspect LOG [--episode ID] [--limit N] [--width W]

``LOG`` is a run directory (``runs/NAME``), its ``trajectories/`` log directory, or any of the
run's log files (``trajectories/episodes-*.jsonl.zst``, ``batches-*``, ``run.json``,
``events/events-*.jsonl.zst``): a file stands for the log it belongs to. Anything else is a
one-line error saying what is expected (:func:`resolve_log`).

Without ``--episode``: an overview (episodes, groups kept/dropped, stop reasons, lag histogram,
calls per endpoint and version), one row per trainer step, and the first ``--limit`` episodes;
when the log belongs to a run directory, also the exactly-once accounting of its groups
(:func:`orchestrator.record.accounting.account`) and every violation of it.
With ``--episode ID``: that episode's header (task, reward and its components, stop reason,
staleness decision, duration) and its chat transcript — each role, each assistant turn stamped
with the model call that produced it (policy version start→end, endpoint, tokens, latency),
tool calls with their arguments and results, and any error recorded on the episode.

Reads through :mod:`orchestrator.record.trajlog`, so a log torn by a crash shows every complete
record. Output is rich text on stdout; nothing here writes to the log.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from orchestrator.errors import TrajlogError
from orchestrator.record.accounting import Accounting, account
from orchestrator.record.frames import PART_SUFFIX, parts
from orchestrator.record.trajlog import BatchRecord, EpisodeRecord, batch_records, episode_records

ROLE_STYLE = {"system": "dim", "user": "bold cyan", "assistant": "bold green", "tool": "yellow"}


@dataclass
class LogSummary:
    """Counts over a log's episode and batch records (pure data; see :func:`summarize`)."""

    run: str = ""
    episodes: int = 0
    groups: int = 0
    groups_dropped: int = 0
    episodes_dropped: int = 0
    steps: int = 0
    reward_mean: float = 0.0
    stop_reasons: Counter[str] = field(default_factory=Counter)
    lags: Counter[int] = field(default_factory=Counter)  # segment lag -> model calls
    calls: Counter[tuple[str, int]] = field(default_factory=Counter)  # (endpoint, version)
    errors: int = 0


def segment_lags(record: EpisodeRecord) -> list[int]:
    """Lag of each model call at the trainer version of the record's decision (≥ 0)."""
    return [
        max(0, record.trainer_version - s.policy_version.start) for s in record.episode.segments
    ]


def summarize(records: Sequence[EpisodeRecord], batches: Sequence[BatchRecord]) -> LogSummary:
    s = LogSummary(run=records[0].run if records else "", steps=len(batches))
    decisions = {r.decision.group_id: r.decision.decision for r in records}
    s.groups = len(decisions)
    s.groups_dropped = sum(1 for d in decisions.values() if d == "dropped")
    s.episodes = len(records)
    s.episodes_dropped = sum(1 for r in records if r.decision.decision == "dropped")
    s.reward_mean = sum(r.episode.reward for r in records) / len(records) if records else 0.0
    for r in records:
        s.stop_reasons[r.episode.stop_reason] += 1
        s.errors += r.episode.error is not None
        s.lags.update(segment_lags(r))
        s.calls.update((seg.endpoint, seg.policy_version.start) for seg in r.episode.segments)
    return s


def render_summary(
    records: Sequence[EpisodeRecord], batches: Sequence[BatchRecord], console: Console, limit: int
) -> None:
    s = summarize(records, batches)
    overview = Table(title=f"run {s.run or '?'}", show_header=False)
    overview.add_column(style="bold")
    overview.add_column()
    overview.add_row("episodes", f"{s.episodes} ({s.episodes_dropped} dropped, {s.errors} errors)")
    overview.add_row("groups", f"{s.groups} ({s.groups_dropped} dropped)")
    overview.add_row("trainer steps", str(s.steps))
    overview.add_row("mean reward", f"{s.reward_mean:.3f}")
    overview.add_row("stop reasons", ", ".join(f"{k}×{n}" for k, n in s.stop_reasons.most_common()))
    overview.add_row("call lag", ", ".join(f"{k}: {n}" for k, n in sorted(s.lags.items())))
    per_ep: dict[str, list[str]] = {}
    for (ep, v), n in sorted(s.calls.items()):
        per_ep.setdefault(ep, []).append(f"v{v}×{n}")
    for ep, served in per_ep.items():
        overview.add_row(f"calls on {ep}", ", ".join(served))
    console.print(overview)

    if batches:
        steps = Table(title="trainer steps")
        for col in ("version", "groups", "reward", "loss", "ESS frac", "masked"):
            steps.add_column(col, justify="right")
        for b in batches:
            m = b.metrics
            steps.add_row(
                f"{b.trained_at_version}→{b.produced_version}",
                str(len(b.groups)),
                _num(m.get("reward_mean")),
                _num(m.get("loss")),
                _num(m.get("is/ess_frac")),
                _num(m.get("is/frac_masked")),
            )
        console.print(steps)

    eps = Table(title=f"episodes (first {min(limit, len(records))} of {len(records)})")
    eps.add_column("episode", no_wrap=True)
    for col in ("task", "reward", "stop", "calls", "tokens", "versions", "decision"):
        eps.add_column(col)
    for r in records[:limit]:
        e = r.episode
        versions = sorted({seg.policy_version.start for seg in e.segments})
        eps.add_row(
            e.id,
            e.task_id,
            f"{e.reward:.2f}",
            e.stop_reason,
            str(len(e.segments)),
            str(e.n_sampled),
            ",".join(f"v{v}" for v in versions) or "-",
            r.decision.decision + (f" (lag {r.decision.max_lag})" if r.decision.max_lag else ""),
        )
    console.print(eps)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def render_episode(record: EpisodeRecord, console: Console) -> None:
    e = record.episode
    head = Table(show_header=False, box=None)
    head.add_column(style="bold")
    head.add_column()
    head.add_row("episode", f"{e.id} (group {e.group_id}, task {e.task_id}, env {e.environment})")
    parts = ", ".join(f"{k}={v:g}" for k, v in e.rewards.items())
    head.add_row("reward", f"{e.reward:g}" + (f" ({parts})" if parts else ""))
    if e.overlong_penalty or e.overlong_masked:
        head.add_row(
            "overlong",
            "truncated: no loss (staleness.overlong = mask)"
            if e.overlong_masked
            else f"penalty {e.overlong_penalty:g}: trained on reward {e.trained_reward:g}",
        )
    head.add_row("stop reason", e.stop_reason)
    d = record.decision
    head.add_row(
        "staleness",
        f"{d.decision} at trainer v{record.trainer_version}, max lag {d.max_lag}"
        + (f" — {d.reason}" if d.reason else ""),
    )
    head.add_row(
        "duration", f"{e.duration_s:.2f}s, {len(e.segments)} calls, {e.n_sampled} sampled tokens"
    )
    console.print(head)
    if e.error is not None:
        console.print(Text(f"error in {e.error.where}: {e.error.type}: {e.error.message}", "red"))

    segments = iter(e.segments)
    for msg in e.messages:
        role = str(msg.get("role", "?"))
        title = role
        if role == "assistant":
            seg = next(segments, None)
            if seg is not None:
                v = seg.policy_version
                ver = f"v{v.start}" if v.start == v.end else f"v{v.start}→v{v.end}"
                title = (
                    f"assistant · turn {seg.turn} · {ver} · {seg.endpoint} · "
                    f"{len(seg.token_ids)} tok · {seg.latency_s:.2f}s · {seg.finish_reason}"
                )
        body = Text(_content(msg.get("content")))
        for call in msg.get("tool_calls") or []:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            body.append(f"\n→ {fn.get('name', '?')}({fn.get('arguments', '')})", style="magenta")
        if role == "tool" and msg.get("tool_call_id"):
            title = f"tool result · {msg['tool_call_id']}"
        console.print(Panel(body, title=title, title_align="left", style=ROLE_STYLE.get(role, "")))
    for call in e.tool_calls:
        if call.error:
            console.print(Text(f"tool {call.name} failed: {call.error}", "red"))


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return json.dumps(content, ensure_ascii=False)


def find_episode(records: Sequence[EpisodeRecord], episode_id: str) -> EpisodeRecord:
    for r in records:
        if r.episode.id == episode_id:
            return r
    raise TrajlogError(f"no episode {episode_id!r} in the log ({len(records)} episodes)")


def main(argv: list[str], console: Console | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="orchestrate inspect", description="Summarize a trajectory log or show one episode."
    )
    parser.add_argument("log", type=Path, help=f"what to read: {EXPECTED}")
    parser.add_argument("--episode", help="render this episode as a transcript")
    parser.add_argument(
        "--limit", type=int, default=20, help="episodes listed in the summary (≥ 0)"
    )
    parser.add_argument("--width", type=int, default=None, help="console width (≥ 20)")
    args = parser.parse_args(argv)
    if args.limit < 0:
        parser.error(f"argument --limit: {args.limit} is negative")
    if args.width is not None and args.width < 20:
        parser.error(f"argument --width: {args.width} is narrower than 20 columns")
    path = resolve_log(args.log)
    console = console or Console(width=args.width)
    records, batches = read_log(path)
    if args.episode:
        render_episode(find_episode(records, args.episode), console)
    else:
        render_summary(records, batches, console, args.limit)
        if (path.parent / "events").is_dir():  # a run directory: check the exactly-once rule
            render_accounting(account(path.parent), console)
    return 0


def read_log(path: Path) -> tuple[list[EpisodeRecord], list[BatchRecord]]:
    """The episode and batch records of the log directory ``path``; a record this sprawl's
    schema does not read is a :class:`TrajlogError` naming the log and the first field."""
    return episode_records(path), batch_records(path)


def render_accounting(acc: Accounting, console: Console) -> None:
    """One line of where every admitted group ended, then each violation of exactly-once."""
    c = acc.counts()
    console.print(
        f"accounting: {c['admitted']} groups admitted — {c['trained']} trained, "
        f"{c['dropped']} dropped, {c['unbatched']} unbatched, {c['lost']} lost in flight: "
        + ("every group accounted for once" if acc.ok else f"{len(acc.problems)} violations")
    )
    for problem in acc.problems:
        console.print(f"  [red]{problem}[/red]")


EXPECTED = (
    "a run directory (e.g. runs/demo), its trajectories/ directory, or one of its log files "
    "(trajectories/episodes-*.jsonl.zst, batches-*.jsonl.zst, run.json, events/events-*.jsonl.zst)"
)


def resolve_log(path: Path) -> Path:
    """The trajectory log directory ``path`` names (see the module docstring: a run directory,
    a log directory, or a file of either); :class:`TrajlogError` saying what is expected
    otherwise."""
    if path.is_file():
        stream = path.name.split("-", 1)[0] if path.name.endswith(PART_SUFFIX) else None
        if stream in ("episodes", "batches") or path.name == "run.json":
            path = path.parent
        elif stream == "events" and path.parent.name == "events":
            path = path.parent.parent
        else:
            raise TrajlogError(f"{path} is not a trajectory log file: give {EXPECTED}")
    if (path / "trajectories").is_dir():
        return path / "trajectories"
    if not path.exists():
        raise TrajlogError(f"{path}: no such trajectory log")
    if not (parts(path, "episodes") or parts(path, "batches") or (path / "run.json").exists()):
        raise TrajlogError(f"{path} holds no trajectory log: give {EXPECTED}")
    return path
