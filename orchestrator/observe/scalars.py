"""TensorBoard scalars of a run, in ``<run dir>/tensorboard/``, one point per trainer step.

Per step (x axis: the version the step produced): every trainer metric (``trainer/…``: reward,
loss, grad norm, IS weights, ESS, log-prob mismatch, KL, entropy), and from the groups decided
since the previous step: ``rollout/max_lag_mean``, ``rollout/drop_rate``,
``rollout/episodes_per_s`` and ``rollout/tokens_per_s``.
"""

from __future__ import annotations

import time
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from orchestrator.types import Group, GroupDecision


class Scalars:
    def __init__(self, directory: Path) -> None:
        self.writer = SummaryWriter(log_dir=str(directory))
        self._since = time.monotonic()
        self._lags: list[int] = []
        self._dropped = 0
        self._episodes = 0
        self._tokens = 0

    def group(self, group: Group, decision: GroupDecision) -> None:
        self._lags.append(decision.max_lag)
        self._dropped += decision.decision == "dropped"
        self._episodes += len(group.episodes)
        self._tokens += sum(e.n_sampled for e in group.episodes)

    def step(self, version: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(f"trainer/{name}", value, version)
        elapsed = max(time.monotonic() - self._since, 1e-9)
        if self._lags:
            self.writer.add_scalar(
                "rollout/max_lag_mean", sum(self._lags) / len(self._lags), version
            )
            self.writer.add_scalar("rollout/drop_rate", self._dropped / len(self._lags), version)
        self.writer.add_scalar("rollout/episodes_per_s", self._episodes / elapsed, version)
        self.writer.add_scalar("rollout/tokens_per_s", self._tokens / elapsed, version)
        self.writer.flush()
        self._since, self._lags, self._dropped = time.monotonic(), [], 0
        self._episodes = self._tokens = 0

    def close(self) -> None:
        self.writer.close()
