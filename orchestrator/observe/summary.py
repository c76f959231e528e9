"""What a run did, printed when it ends (:class:`RunSummary`).

The summary ends with what a user wants to know first — did the loop learn: the mean reward of
every trainer step, the first quarter of the steps against the last with the noise band
(:func:`orchestrator.observe.trend.quarters`: "rose" only when the difference exceeds 2σ), and
one sampled transcript from before training and one from after (the first trained group's first
episode, and the last trained group's of the same task when there is one: the same question,
asked of the first and the last policy). Samples are of trained (kept) groups only; a group's
first episode is shown, not its best, so the "after" transcript is a draw, not a highlight.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.observe.trend import quarters
from orchestrator.types import Endpoint, Episode, Group, GroupDecision, NullEvents

if TYPE_CHECKING:
    from orchestrator.record import resume

_LINE = 100  # characters of one transcript line
MIN_STEPS_JUDGED = 8
"""Steps the learning verdict needs: quarters of two steps, so each has a standard error."""


class VersionSync(NullEvents):
    """Seconds from each version's publish (the ``trainer_version`` event) until every endpoint
    that reported it serves it (as the pool sees them: as often as it polls them); an event sink
    of the run's :class:`~orchestrator.observe.metrics.Tee`."""

    def __init__(self) -> None:
        self.published: dict[int, float] = {}
        self.seconds: dict[int, float] = {}
        self._seen: dict[str, int] = {}

    def emit(self, kind: str, **f: Any) -> None:
        if kind == "trainer_version":
            self.published.setdefault(int(f["version"]), time.monotonic())

    def endpoint(self, ep: Endpoint) -> None:
        if ep.applied_version is None:
            return
        now, before = time.monotonic(), self._seen.get(ep.id, -1)
        if ep.applied_version <= before:  # polled again, or rolled back: nothing new served
            return
        self._seen[ep.id] = ep.applied_version
        for v, t in self.published.items():
            if before < v <= ep.applied_version:
                self.seconds[v] = max(self.seconds.get(v, 0.0), now - t)

    def render(self) -> str | None:
        """``first version served in X s`` against the median of the later ones, if any."""
        if not self.seconds:
            return None
        first, *later = (self.seconds[v] for v in sorted(self.seconds))
        line = f"versions:  first version served in {first:.2f} s"
        if later:
            line += f" (later ones: median {statistics.median(later):.2f} s, {len(later)} versions)"
        return line


@dataclass
class RunSummary:
    """What a run did. A resumed run's steps, episodes, dropped groups, rewards and samples are
    the whole run's, read from its logs (:meth:`cover`); ``served`` and ``seconds`` are always
    this process's."""

    run_dir: Path
    steps: int = 0
    episodes: int = 0
    dropped_groups: int = 0
    rewards: list[float] = field(default_factory=list)
    served: dict[str, dict[int, int]] = field(default_factory=dict)
    interrupted: bool = False
    seconds: float = 0.0
    resumed_at: list[int] = field(default_factory=list)
    """The step (trainer version) each restart continued from; empty for a run never resumed."""
    by_environment: dict[str, list[int]] = field(default_factory=dict)
    """Environment → [groups decided, groups dropped]; shown for a mixture."""
    first_sample: Episode | None = None
    """The first trained group's first episode (before training)."""
    last_sample: Episode | None = None
    """The last trained group's first episode, of ``first_sample``'s task when there is one."""
    report: Path | None = None
    """The HTML report written when the run ended (``run.report``)."""
    sync: VersionSync = field(default_factory=VersionSync)
    """This process's publish → serving times (it reads the run's events)."""

    def cover(self, logged: resume.LoggedRun) -> None:
        """Count the whole run its logs describe (every process's records) instead of this
        process's share, so a resumed run's summary reads as one run from step 0."""
        self.steps = logged.steps
        self.episodes = logged.episodes
        self.dropped_groups = logged.dropped_groups
        self.rewards = list(logged.rewards)
        self.resumed_at = list(logged.resumed_at)
        self.by_environment = {}
        self.first_sample = self.last_sample = None
        for group, decision in logged.groups.values():
            self.count(group, decision)

    def count(self, group: Group, decision: GroupDecision) -> None:
        """Count a decided group under its environment, and keep it as a sample if it fits."""
        env = group.episodes[0].environment if group.episodes else "?"
        counts = self.by_environment.setdefault(env, [0, 0])
        counts[0] += 1
        counts[1] += decision.decision == "dropped"
        if decision.decision != "kept" or not group.episodes:
            return
        episode = group.episodes[0]
        if self.first_sample is None:
            self.first_sample = episode
        elif (
            self.last_sample is None
            or episode.task_id == self.first_sample.task_id
            or self.last_sample.task_id != self.first_sample.task_id
        ):
            self.last_sample = episode

    def render(self) -> str:
        lines = [
            f"run dir:   {self.run_dir}",
            f"status:    {'interrupted' if self.interrupted else 'finished'} "
            f"in {self.seconds:.1f}s",
        ]
        if self.resumed_at:
            at = ", ".join(str(v) for v in self.resumed_at)
            lines.append(
                f"resumed:   at step{'s' * (len(self.resumed_at) > 1)} {at} "
                "(counts: the whole run; time and calls served: since the restart)"
            )
        lines += [
            f"steps:     {self.steps}",
            f"episodes:  {self.episodes} ({self.dropped_groups} groups dropped)",
        ]
        if len(self.by_environment) > 1:
            for env, (decided, dropped) in sorted(self.by_environment.items()):
                lines.append(f"env {env}: {decided} groups ({dropped} dropped)")
        for ep, versions in sorted(self.served.items()):
            lines.append(f"{ep}: {_served(versions)}")
        if (synced := self.sync.render()) is not None:
            lines.append(synced)
        if self.report is not None:
            lines.append(f"report:    {self.report}")
        first, last = self.first_sample, self.last_sample
        if first is not None:
            lines += ["", *transcript(first, "before training")]
            if last is not None and _newest(last) > _newest(first):
                lines += ["", *transcript(last, "after training")]
        n = len(self.rewards)
        lines += ["", "reward:    " + (" → ".join(f"{r:.3f}" for r in self.rewards) or "n/a")]
        if n >= MIN_STEPS_JUDGED:
            q = n // 4
            c = quarters(self.rewards)
            lines.append(
                f"learning:  first vs last quarter (steps 1–{q} vs {n - q + 1}–{n}): {c.render()}"
            )
        else:
            lines.append(f"learning:  not judged ({n} steps; the verdict needs {MIN_STEPS_JUDGED})")
        return "\n".join(lines)


def transcript(episode: Episode, title: str) -> list[str]:
    """``episode``'s messages, one line each, under a heading naming the versions and reward."""
    versions = sorted({s.policy_version.start for s in episode.segments})
    sampled = "/".join(f"v{v}" for v in versions) or "no model call"
    lines = [
        f"{title} ({sampled}, task {episode.task_id}, reward {episode.reward:.2f}, "
        f"{episode.stop_reason}):"
    ]
    for message in episode.messages:
        lines.append(f"  {message.get('role', '?')!s:<10} {_one_line(message)}")
    if episode.error is not None:
        lines.append(f"  error      {episode.error.where}: {episode.error.message}"[:_LINE])
    return lines


def _newest(episode: Episode) -> int:
    return max((s.policy_version.end for s in episode.segments), default=-1)


def _one_line(message: dict[str, Any]) -> str:
    parts = [str(message.get("content") or "")]
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {})
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args)
        parts.append(f"→ {fn.get('name', '?')}({args})")
    text = " ".join(p for p in parts if p).replace("\n", "⏎ ")
    text = "".join(c if c.isprintable() else "�" for c in text)
    return text if len(text) <= _LINE else text[: _LINE - 1] + "…"


def _served(versions: dict[int, int]) -> str:
    """``v0×3, v1×5`` — or, past a handful of versions, the totals and the range."""
    if not versions:
        return "no calls"
    if len(versions) <= 6:
        return ", ".join(f"v{v}×{n}" for v, n in sorted(versions.items()))
    calls, low, high = sum(versions.values()), min(versions), max(versions)
    return f"{calls} calls on {len(versions)} versions, v{low}–v{high}"
