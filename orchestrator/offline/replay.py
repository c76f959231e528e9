"""``orchestrate replay``: re-run staleness policies or a trainer over a logged run, offline.

    orchestrate replay LOG --what-if POLICIES.toml [--model DIR] [--json]
    orchestrate replay LOG --train --config X.toml [--out DIR] [--seed N] [overrides…]

**What-if.** ``POLICIES.toml`` holds one :class:`~staleness.config.StalenessConfig` per table::

    [policies.drop2]
    drop = { statistic = "max", max_lag = 2 }
    [policies.tis2]
    correction = { type = "tis", cap = 2.0 }

Each policy re-decides every logged group with the run's own decision code
(:meth:`orchestrator.loop.batcher.Batcher.decide`) at the trainer version the group was logged at,
and the results are printed side by side with the logged decisions: kept/dropped groups and
episodes, drop rate per bucket of sampled tokens and of turns and the length-bias test
(:class:`staleness.length_bias.LengthBias`, one count per group: its longest episode), and — for
the kept episodes — the policy's correction
(:func:`staleness.corrections.correct`) and its IS-weight statistics and effective sample size
(:func:`staleness.metrics.correction_metrics`). μ is the logged behaviour log probs. π_prox is
**not** in the log: with ``--model DIR`` it is that model's log probs of the logged tokens (at each
call's sampling temperature) — pass the trainer version you want to compare against, e.g. from
``orchestrate materialize``; without ``--model`` only the lag and drop statistics are printed.
The schedule is held fixed: a different policy would have changed which groups were admitted and
when the trainer stepped; this answers "what would this policy have done to *these* groups".
Groups the run's stop dropped (:data:`~orchestrator.record.events.STOP_REASONS`: finished but not
trained, or still in flight) were never decided by a staleness policy: they stay dropped, are
counted apart (``groups/stopped``, ``episodes/stopped``), and every column — the logged one
included — is computed over the decided groups only, so drop rates compare like with like.

**Train.** Feeds the logged batches, in trainer-step order, to a fresh
:class:`~policies.train.trainer.Trainer` built from the config (model, ``[trainer]``, staleness
correction), publishing to a new board under ``--out``. The samples are built by the run's own
:func:`orchestrator.loop.train_sink.batch_samples`. Same log + config + seed → bit-identical weights
on the same machine and torch build (the trainer seeds torch; CPU kernels are deterministic). Not
covered: GPU determinism (cuBLAS/atomics would need ``torch.use_deterministic_algorithms``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, ValidationError
from rich.console import Console
from rich.table import Table

from orchestrator.errors import ConfigError, TrajlogError
from orchestrator.loop.batcher import Batcher
from orchestrator.offline.inspect_log import resolve_log
from orchestrator.record.events import STOP_REASONS
from orchestrator.record.trajlog import EpisodeRecord, batch_records, episode_records, run_header
from orchestrator.types import Batch, Episode, Group
from policies.codec.digests import state_digest
from staleness.config import StalenessConfig
from staleness.length_bias import AXES, LengthBias

if TYPE_CHECKING:
    import torch

    from orchestrator.config import Config

LOGGED = "logged"


class PolicyFile(BaseModel):
    """A what-if file: named staleness policies."""

    model_config = ConfigDict(extra="forbid")
    policies: dict[str, StalenessConfig]


def load_policies(path: Path) -> dict[str, StalenessConfig]:
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


def groups_of(records: Sequence[EpisodeRecord]) -> list[tuple[Group, int, str]]:
    """Logged groups in log order with the trainer version they were decided at and the logged
    decision."""
    order: dict[str, list[EpisodeRecord]] = {}
    for r in records:
        order.setdefault(r.decision.group_id, []).append(r)
    return [
        (
            Group(id=gid, task_id=rs[0].episode.task_id, episodes=[r.episode for r in rs]),
            rs[0].trainer_version,
            rs[0].decision.decision,
        )
        for gid, rs in order.items()
    ]


def decide_all(
    groups: Sequence[tuple[Group, int, str]], policy: StalenessConfig, max_lag: int
) -> list[bool]:
    """Kept (True) or dropped per group, by the run's own batcher at each logged version
    (``max_lag``: the run's ``scheduler.max_lag``, the rule of a policy without ``drop``)."""
    version = [0]
    batcher = Batcher(policy, 1, max_lag, lambda: version[0])
    kept = []
    for group, at, _ in groups:
        version[0] = at
        kept.append(batcher.decide(group).decision == "kept")
    return kept


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

    def as_dict(self) -> dict[str, float]:
        out = {
            "groups/kept": float(self.groups_kept),
            "groups/dropped": float(self.groups_dropped),
            "groups/stopped": float(self.groups_stopped),
            "episodes/kept": float(self.episodes_kept),
            "episodes/dropped": float(self.episodes_dropped),
            "episodes/stopped": float(self.episodes_stopped),
        }
        out.update(self.by_length.as_dict())
        out.update(self.correction or {})
        return out


Scorer = Callable[[Episode], list[float]]
"""π_prox log probs of an episode's sampled tokens, in segment order."""


def what_if(
    records: Sequence[EpisodeRecord],
    policies: Mapping[str, StalenessConfig],
    scorer: Scorer | None = None,
    *,
    max_lag: int = 2**31,
) -> list[Outcome]:
    """The logged decisions, then each policy's, over the same decided groups (``max_lag``: the
    run's ``scheduler.max_lag``, the drop rule of a policy without ``drop``, as in the run's
    batcher). Groups the run's stop dropped are left out of every column and counted apart."""
    stopped = stopped_groups(records)
    every = groups_of(records)
    groups = [g for g in every if g[0].id not in stopped]
    n_stopped = len(every) - len(groups)
    eps_stopped = sum(len(g.episodes) for g, _, _ in every if g.id in stopped)
    lengths = [
        (
            max((e.n_sampled for e in g.episodes), default=0),
            max((len(e.segments) for e in g.episodes), default=0),
        )
        for g, _, _ in groups
    ]
    prox: dict[str, list[float]] = {}
    verdicts = {LOGGED: [d == "kept" for _, _, d in groups]}
    verdicts.update({name: decide_all(groups, p, max_lag) for name, p in policies.items()})
    outcomes = []
    for name, kept in verdicts.items():
        per_episode = [k for (g, _, _), k in zip(groups, kept, strict=True) for _ in g.episodes]
        kept_eps = [e for (g, _, _), k in zip(groups, kept, strict=True) if k for e in g.episodes]
        correction = None
        if scorer is not None and name != LOGGED and kept_eps:
            for e in kept_eps:
                if e.id not in prox:
                    prox[e.id] = scorer(e)
            correction = correction_stats(policies[name], kept_eps, prox)
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
                groups_stopped=n_stopped,
                episodes_stopped=eps_stopped,
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


# -- train ----------------------------------------------------------------------------------------
def logged_batches(path: Path) -> list[Batch]:
    """The logged trainer steps as batches of their logged groups, in step order."""
    groups = {g.id: g for g, _, _ in groups_of(episode_records(path))}
    out = []
    for b in sorted(batch_records(path), key=lambda b: b.trained_at_version):
        missing = [gid for gid in b.groups if gid not in groups]
        if missing:
            raise TrajlogError(f"batch at v{b.trained_at_version}: groups {missing} not in the log")
        out.append(
            Batch(
                trained_at_version=b.trained_at_version,
                groups=[groups[g] for g in b.groups],
                decisions=[],
            )
        )
    return out


def train(path: Path, cfg: Config, out: Path, seed: int) -> tuple[str, list[dict[str, float]]]:
    """Replay every logged batch through a fresh trainer; the final weights' digest and metrics."""
    from orchestrator.loop.train_sink import batch_samples, build_trainer
    from policies.board import Board

    batches = logged_batches(path)
    if not batches:
        raise TrajlogError(f"{path}: the log holds no trainer step to replay")
    board = Board(str(out / "board"), cfg.run.name)
    trainer = build_trainer(cfg, cfg.model.path, board, seed=seed)
    trainer.publish()
    metrics = [trainer.step(batch_samples(b.groups)) for b in batches]
    return state_digest(trainer.model.state_dict()), metrics


def main(argv: list[str], console: Console | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="orchestrate replay",
        description="Re-run staleness policies (--what-if) or a trainer (--train) over a log.",
        epilog="With --train, any config field can be overridden with --section.key VALUE.",
    )
    parser.add_argument("log", type=Path, help="a trajectory log directory (or run directory)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--what-if", type=Path, metavar="POLICIES.toml")
    mode.add_argument("--train", action="store_true")
    parser.add_argument(
        "--model", type=Path, help="what-if: a model dir whose log probs are π_prox"
    )
    parser.add_argument("--json", action="store_true", help="what-if: print JSON, not a table")
    parser.add_argument("--config", type=Path, help="train: the run config")
    parser.add_argument("--out", type=Path, help="train: output dir (default LOG/../replay)")
    parser.add_argument("--seed", type=int, help="train: trainer seed (default: run.seed)")
    args, rest = parser.parse_known_args(argv)
    path = resolve_log(args.log)
    console = console or Console()
    if args.what_if is not None:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        policies = load_policies(args.what_if)
        scorer = ModelScorer(args.model) if args.model else None
        header = run_header(path)
        max_lag = 2**31
        if header is not None and header.config is not None:
            max_lag = int(header.config.get("scheduler", {}).get("max_lag", max_lag))
        outcomes = what_if(episode_records(path), policies, scorer, max_lag=max_lag)
        if args.json:
            sys.stdout.write(json.dumps({o.name: o.as_dict() for o in outcomes}) + "\n")
        else:
            render_what_if(outcomes, console, with_is=scorer is not None)
        return 0
    from orchestrator.config import load_config, parse_overrides

    header = run_header(path)
    if args.config is None and (header is None or header.config is None):
        parser.error("--train needs --config (the log has no run config)")
    cfg = load_config(args.config, parse_overrides(rest)) if args.config else None
    if cfg is None:
        from orchestrator.config import Config

        assert header is not None
        cfg = Config.model_validate(header.config)
    seed = cfg.run.seed if args.seed is None else args.seed
    digest, metrics = train(path, cfg, args.out or path.parent / "replay", seed)
    for i, m in enumerate(metrics):
        console.print(f"step {i + 1}: loss={m['loss']:.6g} reward_mean={m['reward_mean']:.4g}")
    console.print(f"weights digest {digest}")
    return 0
