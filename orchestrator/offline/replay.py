"""``orchestrate replay``: re-run staleness policies or a trainer over a logged run, offline.

    orchestrate replay LOG --what-if POLICIES.toml [--model DIR] [--json]
    orchestrate replay LOG --train --config X.toml [--out DIR] [--seed N] [overrides…]

**What-if** (:mod:`orchestrator.offline.what_if`): each policy of ``POLICIES.toml`` (a
``[staleness]`` table, optionally with ``dynamic_sampling``) re-decides every logged group with
the run's own decision code at the trainer version it was logged at, side by side with the logged
decisions: drops (by lag, and by dynamic sampling), overlong handling, the length-bias test, and —
given ``--model DIR`` as π_prox — the correction's IS statistics. The schedule is held fixed.

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
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError
from rich.console import Console

from orchestrator.config import DynamicSamplingConfig, SchedulerConfig
from orchestrator.errors import TrajlogError
from orchestrator.offline.inspect_log import resolve_log
from orchestrator.offline.what_if import (
    ModelScorer,
    groups_of,
    load_policies,
    render_what_if,
    what_if,
)
from orchestrator.record.trajlog import batch_records, episode_records, run_header
from orchestrator.types import Batch
from policies.codec.digests import state_digest

if TYPE_CHECKING:
    from orchestrator.config import Config


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


def _run_scheduler(path: Path) -> tuple[int, DynamicSamplingConfig | None]:
    """The logged run's ``scheduler.max_lag`` and ``[scheduler.dynamic_sampling]`` (from its
    header's config; no lag budget and no filter when the log holds none)."""
    header = run_header(path)
    config = {} if header is None or header.config is None else header.config
    try:
        scheduler = SchedulerConfig.model_validate(
            {"max_lag": 2**31, **config.get("scheduler", {})}
        )
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(map(str, first["loc"]))
        raise TrajlogError(f"{path}: run.json: scheduler.{where}: {first['msg']}") from None
    return scheduler.max_lag, scheduler.filters_groups


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
        max_lag, ds = _run_scheduler(path)
        outcomes = what_if(
            episode_records(path), policies, scorer, max_lag=max_lag, dynamic_sampling=ds
        )
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
