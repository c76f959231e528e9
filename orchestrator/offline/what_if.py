"""``orchestrate replay LOG --what-if POLICIES.toml``: re-decide a logged run under other policies.

``POLICIES.toml`` holds one :class:`WhatIfPolicy` per table: a
:class:`~staleness.config.StalenessConfig`, and optionally the ``dynamic_sampling`` of
``[scheduler.dynamic_sampling]``::

    [policies.drop2]
    drop = { statistic = "max", max_lag = 2 }
    [policies.tis2]
    correction = { type = "tis", cap = 2.0 }
    [policies.no_filter]
    dynamic_sampling = { enabled = false }
    [policies.penalty]
    overlong = "soft_penalty"
    overlong_buffer = 8

Each policy re-decides every logged group with the run's own decision code
(:meth:`orchestrator.loop.batcher.Batcher.decide`) at the trainer version the group was logged at,
and the results are printed side by side with the logged decisions: kept/dropped groups and
episodes, the groups dynamic sampling dropped (``groups/filtered``), the episodes overlong
handling masks or penalizes, drop rate per bucket of sampled tokens and of turns and the
length-bias test (:class:`staleness.length_bias.LengthBias`, one count per group: its longest
episode; a dynamic-sampling drop counts like any other), and — for the kept episodes — the
policy's correction (:func:`staleness.corrections.correct`) and its IS-weight statistics and
effective sample size (:func:`staleness.metrics.correction_metrics`). A policy without a
``drop`` rule drops by the run's ``scheduler.max_lag``, and one without ``dynamic_sampling``
filters as the run's ``[scheduler.dynamic_sampling]`` did (so the run's own policy reproduces
the logged decisions, dynamic-sampling drops included). μ is the logged behaviour log probs.
π_prox is **not** in the log: with ``--model DIR`` it is that model's log probs of the logged
tokens (at each call's sampling temperature) — pass the trainer version you want to compare
against, e.g. from ``orchestrate materialize``; without ``--model`` only the lag and drop
statistics are printed.

The schedule is held fixed: a different policy would have changed which groups were admitted and
when the trainer stepped (dynamic sampling's refills, and its ``max_refills`` bound, included);
this answers "what would this policy have done to *these* groups". Groups the run's stop dropped
(:data:`~orchestrator.record.events.STOP_REASONS`: finished but not trained, or still in flight)
were never decided by a staleness policy: they stay dropped, are counted apart
(``groups/stopped``, ``episodes/stopped``), and every column — the logged one included — is
computed over the decided groups only, so drop rates compare like with like.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError
from rich.console import Console
from rich.table import Table

from orchestrator.config import DynamicSamplingConfig
from orchestrator.errors import ConfigError
from orchestrator.loop.batcher import EQUAL_REWARDS, Batcher, overlong_fields
from orchestrator.record.events import STOP_REASONS
from orchestrator.record.trajlog import EpisodeRecord
from orchestrator.types import Episode, Group, GroupDecision
from staleness.config import StalenessConfig
from staleness.length_bias import AXES, LengthBias

LOGGED = "logged"


class WhatIfPolicy(StalenessConfig):
    """One what-if policy: a ``[staleness]`` table, plus ``dynamic_sampling`` (the keys of
    ``[scheduler.dynamic_sampling]``; absent: the run's)."""

    dynamic_sampling: DynamicSamplingConfig | None = None
    """Dynamic sampling under this policy (``enabled = false`` turns it off); None: the run's."""


class PolicyFile(BaseModel):
    """A what-if file: named policies."""

    model_config = ConfigDict(extra="forbid")
    policies: dict[str, WhatIfPolicy]


def load_policies(path: Path) -> dict[str, WhatIfPolicy]:
    try:
        data = tomllib.loads(path.read_text())
        policies = PolicyFile.model_validate(data).policies
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{path}: {where}: {first['msg']}") from exc
    if not policies or LOGGED in policies:
        raise ConfigError(f"{path}: need at least one [policies.NAME] table (not '{LOGGED}')")
    return policies


def groups_of(records: Sequence[EpisodeRecord]) -> list[tuple[Group, int, GroupDecision]]:
    """Logged groups in log order with the trainer version they were decided at and the logged
    decision."""
    order: dict[str, list[EpisodeRecord]] = {}
    for r in records:
        order.setdefault(r.decision.group_id, []).append(r)
    return [
        (
            Group(id=gid, task_id=rs[0].episode.task_id, episodes=[r.episode for r in rs]),
            rs[0].trainer_version,
            rs[0].decision,
        )
        for gid, rs in order.items()
    ]


def decide_all(
    groups: Sequence[tuple[Group, int, GroupDecision]],
    policy: StalenessConfig,
    max_lag: int,
    dynamic_sampling: DynamicSamplingConfig | None = None,
) -> list[GroupDecision]:
    """Each group's decision by the run's own batcher at its logged version (``max_lag``: the
    run's ``scheduler.max_lag``, the rule of a policy without ``drop``; ``dynamic_sampling``: the
    filter the policy applies)."""
    version = [0]
    batcher = Batcher(policy, 1, max_lag, lambda: version[0], dynamic_sampling=dynamic_sampling)
    decisions = []
    for group, at, _ in groups:
        version[0] = at
        decisions.append(batcher.decide(group))
    return decisions


def stopped_groups(records: Sequence[EpisodeRecord]) -> set[str]:
    """Ids of the groups the run's stop dropped, not a staleness policy (their logged reason is
    one of :data:`~orchestrator.record.events.STOP_REASONS`)."""
    return {
        r.decision.group_id
        for r in records
        if r.decision.decision == "dropped" and r.decision.reason in STOP_REASONS
    }


@dataclass(frozen=True)
class Outcome:
    """What one policy does to the logged groups that a staleness policy decided; the groups the
    run's stop dropped are only counted (``*_stopped``, the same in every column)."""

    name: str
    groups_kept: int
    groups_dropped: int
    episodes_kept: int
    episodes_dropped: int
    by_length: LengthBias
    correction: dict[str, float] | None
    groups_stopped: int = 0
    episodes_stopped: int = 0
    groups_filtered: int = 0
    episodes_masked: int = 0
    episodes_penalized: int = 0

    def as_dict(self) -> dict[str, float]:
        out = {
            "groups/kept": float(self.groups_kept),
            "groups/dropped": float(self.groups_dropped),
            "groups/stopped": float(self.groups_stopped),
            "groups/filtered": float(self.groups_filtered),
            "episodes/kept": float(self.episodes_kept),
            "episodes/dropped": float(self.episodes_dropped),
            "episodes/stopped": float(self.episodes_stopped),
            "episodes/overlong_masked": float(self.episodes_masked),
            "episodes/overlong_penalized": float(self.episodes_penalized),
        }
        out.update(self.by_length.as_dict())
        out.update(self.correction or {})
        return out


Scorer = Callable[[Episode], list[float]]
"""π_prox log probs of an episode's sampled tokens, in segment order."""


def _overlong(episodes: Sequence[Episode], policy: StalenessConfig | None) -> tuple[int, int]:
    """Episodes masked and penalized: as logged (``policy`` None), or under ``policy``."""
    masked = penalized = 0
    for e in episodes:
        fields = (
            {"overlong_masked": e.overlong_masked, "overlong_penalty": e.overlong_penalty}
            if policy is None
            else overlong_fields(e, policy)
        )
        masked += bool(fields["overlong_masked"])
        penalized += bool(fields["overlong_penalty"] < 0)
    return masked, penalized


def what_if(
    records: Sequence[EpisodeRecord],
    policies: Mapping[str, StalenessConfig],
    scorer: Scorer | None = None,
    *,
    max_lag: int = 2**31,
    dynamic_sampling: DynamicSamplingConfig | None = None,
) -> list[Outcome]:
    """The logged decisions, then each policy's, over the same decided groups (``max_lag``: the
    run's ``scheduler.max_lag``, the drop rule of a policy without ``drop``, as in the run's
    batcher; ``dynamic_sampling``: the run's, the filter of a policy without its own). Groups the
    run's stop dropped are left out of every column and counted apart."""
    stopped = stopped_groups(records)
    every = groups_of(records)
    groups = [g for g in every if g[0].id not in stopped]
    decided = [e for g, _, _ in groups for e in g.episodes]
    lengths = [
        (
            max((e.n_sampled for e in g.episodes), default=0),
            max((len(e.segments) for e in g.episodes), default=0),
        )
        for g, _, _ in groups
    ]
    prox: dict[str, list[float]] = {}
    verdicts = {LOGGED: [d for _, _, d in groups]}
    for name, p in policies.items():
        own = p.dynamic_sampling if isinstance(p, WhatIfPolicy) else None
        verdicts[name] = decide_all(
            groups, p, max_lag, own if own is not None else dynamic_sampling
        )
    outcomes = []
    for name, decisions in verdicts.items():
        kept = [d.decision == "kept" for d in decisions]
        per_episode = [k for (g, _, _), k in zip(groups, kept, strict=True) for _ in g.episodes]
        kept_eps = [e for (g, _, _), k in zip(groups, kept, strict=True) if k for e in g.episodes]
        correction = None
        if scorer is not None and name != LOGGED and kept_eps:
            for e in kept_eps:
                if e.id not in prox:
                    prox[e.id] = scorer(e)
            correction = correction_stats(policies[name], kept_eps, prox)
        masked, penalized = _overlong(decided, policies.get(name))
        outcomes.append(
            Outcome(
                name=name,
                groups_kept=sum(kept),
                groups_dropped=len(kept) - sum(kept),
                episodes_kept=sum(per_episode),
                episodes_dropped=len(per_episode) - sum(per_episode),
                by_length=LengthBias.of(
                    (t, n, not k) for (t, n), k in zip(lengths, kept, strict=True)
                ),
                correction=correction,
                groups_stopped=len(every) - len(groups),
                episodes_stopped=sum(len(g.episodes) for g, _, _ in every if g.id in stopped),
                groups_filtered=sum(d.reason == EQUAL_REWARDS for d in decisions),
                episodes_masked=masked,
                episodes_penalized=penalized,
            )
        )
    return outcomes


def correction_stats(
    policy: StalenessConfig, episodes: Sequence[Episode], prox: Mapping[str, list[float]]
) -> dict[str, float]:
    """The policy's correction over the sampled tokens of ``episodes`` (one row each)."""
    import torch

    from staleness.corrections import correct
    from staleness.metrics import correction_metrics

    width = max(max(e.n_sampled for e in episodes), 1)
    logp_prox = torch.zeros(len(episodes), width)
    logp_behav = torch.zeros(len(episodes), width)
    mask = torch.zeros(len(episodes), width, dtype=torch.bool)
    for i, e in enumerate(episodes):
        behav = [lp for s in e.segments for lp in s.logprobs]
        logp_behav[i, : len(behav)] = torch.tensor(behav)
        logp_prox[i, : len(behav)] = torch.tensor(prox[e.id])
        mask[i, : len(behav)] = True
    corrected = correct(policy.correction, logp_prox=logp_prox, logp_behav=logp_behav, mask=mask)
    return correction_metrics(
        policy.correction, corrected, logp_prox=logp_prox, logp_behav=logp_behav, mask=mask
    )


class ModelScorer:
    """π_prox from a model directory: log probs of logged tokens under the distribution each call
    sampled from (its temperature, top-k and top-p, as the trainer scores them:
    :func:`policies.train.scoring.sampled_logprobs`); a token outside a call's top-k / top-p set
    scores −inf."""

    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.device = device
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = model.to(device).eval()  # type: ignore[arg-type]

    def __call__(self, episode: Episode) -> list[float]:
        import torch

        from policies.train.scoring import TokenSampling, sampled_logprobs

        ids = torch.tensor([episode.token_ids], dtype=torch.long, device=self.device)
        with torch.no_grad():
            logits: torch.Tensor = self.model(input_ids=ids).logits[0].float()
        out: list[float] = []
        for seg in episode.segments:
            lo, n, s = seg.prompt_len, len(seg.token_ids), seg.sampling
            sampling = TokenSampling(
                temperature=torch.full((n,), s.temperature, device=self.device),
                top_k=torch.full((n,), s.top_k, dtype=torch.long, device=self.device),
                top_p=torch.full((n,), s.top_p, device=self.device),
            )
            logp, _ = sampled_logprobs(logits[lo - 1 : lo - 1 + n], ids[0, lo : lo + n], sampling)
            out += logp.tolist()
        return out


def render_what_if(outcomes: Sequence[Outcome], console: Console, with_is: bool) -> None:
    table = Table(title="what-if (schedule held fixed; μ = logged log probs)")
    table.add_column("metric", style="bold")
    for o in outcomes:
        table.add_column(o.name, justify="right")

    def row(label: str, cells: list[str]) -> None:
        table.add_row(label, *cells)

    row("groups kept / dropped", [f"{o.groups_kept} / {o.groups_dropped}" for o in outcomes])
    row("episodes kept / dropped", [f"{o.episodes_kept} / {o.episodes_dropped}" for o in outcomes])
    row("groups stopped (not decided)", [str(o.groups_stopped) for o in outcomes])
    row("groups filtered (equal rewards)", [str(o.groups_filtered) for o in outcomes])
    row("episodes overlong masked", [str(o.episodes_masked) for o in outcomes])
    row("episodes overlong penalized", [str(o.episodes_penalized) for o in outcomes])
    row("drop rate", [f"{o.by_length.as_dict()['drop/rate']:.1%}" for o in outcomes])
    for axis in AXES:  # the same groups in every column, so the same buckets
        for i, (label, _) in enumerate(outcomes[0].by_length.rows(axis)):
            cells = [f"{o.by_length.rows(axis)[i][1].drop_rate:.1%}" for o in outcomes]
            row(f"drop rate, {label} {axis}", cells)
        row(f"long vs short z, {axis}", [f"{o.by_length.verdict(axis).z:.2f}" for o in outcomes])
    row("length-biased", ["yes" if o.by_length.biased else "no" for o in outcomes])
    keys = ["is/weight_mean", "is/weight_max", "is/weight_p99", "is/frac_masked"]
    keys += ["is/frac_truncated", "is/nonfinite_tokens", "is/ess", "is/ess_frac", "mismatch/kl_k3"]
    for key in keys if with_is else []:
        row(key, [f"{o.correction[key]:.4g}" if o.correction else "-" for o in outcomes])
    console.print(table)
    if not with_is:
        console.print("IS statistics need π_prox, which the log does not hold: pass --model DIR.")
