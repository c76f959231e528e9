"""``orchestrate bench router-replay``: engine/trainer log-prob mismatch on an MoE model, with and
without router replay, and what the routing costs on the lane and in the trajectory log.

Setup, as a run has it: the reference trainer loads ``--model`` (fp32 masters), publishes
nothing, and hands its served view (``trainer.served_view``, bf16 by default) to a reference
:class:`~policies.serve.engine.Engine`; the engine samples ``--prompts`` continuations of
``--max-tokens`` tokens (prompts are corpus text, :mod:`policies.model.corpus`, temperature
``--temperature``, one seed each) and returns each one's ``routed_experts``. The trainer then
rescores every sampled token (:meth:`~policies.train.trainer.Trainer.logprobs`) twice: routing by
its own router (``trainer.router_replay = false``) and replaying the engine's
(``trainer.router_replay = true``). Reported for each:

- ``mean_abs_logprob_diff``, ``max_abs_logprob_diff``: |engine log prob − trainer log prob| over
  the sampled tokens — the baseline is the run without replay, measured in the same run;
- ``routing_mismatch``: the fraction of (position, MoE layer) pairs whose set of experts differs
  between the engine and the trainer's forward (0 by construction with replay; recorded from the
  forward, not assumed);
- ``tokens_after_a_flip``: the fraction of sampled tokens with such a pair at some earlier
  position, and ``mean_abs_logprob_diff_after_a_flip`` the mean |Δ| over the tokens the forward
  *without* replay flipped before (the same tokens in both rows: what replay fixes).

Overhead: ``lane_bytes_per_token`` is the ``routed_experts`` string of a response over the
positions it covers (vLLM's base64 ``.npy`` form), next to the whole ``/v1/generate`` response
JSON per sampled token without it (``lane_response_bytes_per_token``, the baseline);
``log_bytes_per_token`` is what the routing adds to a trajectory-log segment (its JSON with the
two routing fields minus without), per sampled token.

Not covered: multi-turn episodes (each call routes only the positions not routed before, so the
log stores each position once; the lane figure is per position either way) and vLLM itself
(whose ``routed_experts`` has the same form: ``policies.wire.routing``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

from orchestrator.types import SamplingParams, Segment
from policies.board import Board
from policies.model.build import init_model
from policies.model.corpus import generate_corpus
from policies.model.moe import RoutingRecorder
from policies.serve.engine import Engine
from policies.train.config import TrainerConfig
from policies.train.samples import TrainSample
from policies.train.trainer import Trainer
from policies.wire.batches import SegmentSampling
from policies.wire.lane import (
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    Usage,
    VersionStamp,
)
from policies.wire.logs import quiet_logs
from policies.wire.routing import decode_routing
from staleness.config import StalenessConfig


def _trainer(model_dir: Path, board_dir: Path, replay: bool) -> Trainer:
    return Trainer(
        model_dir,
        Board(str(board_dir), "bench"),
        TrainerConfig(router_replay=replay),
        staleness=StalenessConfig(),
        temperature=1.0,
        group_size=1,
    )


def _prompts(model_dir: Path, count: int, length: int, seed: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for doc in generate_corpus(count * 4, seed):
        ids = tok(doc)["input_ids"]
        if len(ids) >= 4:
            out.append(ids[:length])
        if len(out) == count:
            return out
    raise ValueError(f"the corpus gave {len(out)} prompts of >= 4 tokens, not {count}")


def _samples(
    prompts: list[list[int]], choices: list[GenerateChoice], temperature: float
) -> list[TrainSample]:
    out = []
    for prompt, choice in zip(prompts, choices, strict=True):
        n = len(prompt) + len(choice.token_ids)
        assert choice.routed_experts is not None
        out.append(
            TrainSample(
                token_ids=prompt + choice.token_ids,
                mask=[False] * len(prompt) + [True] * len(choice.token_ids),
                behaviour_logprobs=[0.0] * len(prompt) + choice.logprobs,
                reward=0.0,
                sampling=[SegmentSampling(len(prompt), n, temperature, 0, 1.0)],
                routed_experts=torch.from_numpy(decode_routing(choice.routed_experts)),
            )
        )
    return out


def _forward(
    trainer: Trainer, samples: list[TrainSample]
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per sampled token (all samples in order): |engine − trainer| log prob, and whether the
    trainer routed some position before it otherwise than the engine did; and the fraction of
    (position, MoE layer) pairs it routed otherwise."""
    recorder = RoutingRecorder(trainer.model)
    diffs, flipped = [], []
    flips = pairs = 0
    try:
        for sample in samples:  # one at a time: the recorder's rows are the sample's positions
            logp, _ = trainer.logprobs([sample])
            engine = sample.routed_experts
            assert engine is not None
            mine = recorder.take()[: engine.shape[0]]
            same = (mine.sort(dim=-1).values == engine.sort(dim=-1).values).all(dim=-1)
            flips += int((~same).sum())
            pairs += same.numel()
            before = (~same).any(dim=-1).cumsum(0) > 0  # token t+1 sees positions 0..t
            sampled = torch.tensor(sample.mask[1:])
            behav = torch.tensor(sample.behaviour_logprobs[1:])
            diffs.append((logp[0][sampled] - behav[sampled]).abs())
            flipped.append(before[sampled[: before.shape[0]]])
    finally:
        recorder.close()
    return torch.cat(diffs), torch.cat(flipped), flips / pairs


def _summary(
    forward: tuple[torch.Tensor, torch.Tensor, float], after: torch.Tensor
) -> dict[str, float]:
    """The figures of one :func:`_forward` (``after``: the tokens the forward without replay
    routed otherwise before, so both rows describe the same tokens)."""
    diff, flipped, mismatch = forward
    return {
        "routing_mismatch": mismatch,
        "mean_abs_logprob_diff": float(diff.mean()),
        "max_abs_logprob_diff": float(diff.max()),
        "mean_abs_logprob_diff_after_a_flip": float(diff[after].mean()) if after.any() else 0.0,
        "tokens_after_a_flip": float(flipped.float().mean()),
    }


def _overhead(
    prompts: list[list[int]], choices: list[GenerateChoice], temperature: float
) -> dict[str, float]:
    lane = routed = response = log = sampled = 0
    sampling = SamplingParams(temperature=temperature, top_p=1.0, top_k=0, max_tokens=1)
    for prompt, choice in zip(prompts, choices, strict=True):
        assert choice.routed_experts is not None
        lane += len(json.dumps({"routed_experts": choice.routed_experts}))
        routed += int(decode_routing(choice.routed_experts).shape[0])
        bare = choice.model_copy(update={"routed_experts": None})
        stamp = VersionStamp(start=0, end=0)
        usage = Usage(prompt_tokens=len(prompt), completion_tokens=len(choice.token_ids))
        response += len(
            GenerateResponse(
                id="x",
                model="m",
                prompt_token_ids=prompt,
                choices=[bare],
                policy_version=stamp,
                usage=usage,
            ).model_dump_json()
        )
        segment = Segment(
            turn=0,
            prompt_len=len(prompt),
            token_ids=choice.token_ids,
            logprobs=choice.logprobs,
            finish_reason=choice.finish_reason,
            policy_version=stamp,
            endpoint="e",
            latency_s=0.0,
            sampling=sampling,
        )
        with_routing = segment.model_copy(update={"routed_experts": choice.routed_experts})
        log += len(with_routing.model_dump_json()) - len(segment.model_dump_json())
        sampled += len(choice.token_ids)
    return {
        "lane_bytes_per_token": lane / routed,
        "lane_response_bytes_per_token": response / sampled,
        "log_bytes_per_token": log / sampled,
    }


def run(
    model_dir: Path,
    *,
    prompts: int,
    prompt_tokens: int,
    max_tokens: int,
    temperature: float,
    seed: int,
) -> dict[str, object]:
    """Both measurements (module docstring) on the model in ``model_dir``."""
    with tempfile.TemporaryDirectory(prefix="sprawl-router-replay-") as tmp:
        plain = _trainer(model_dir, Path(tmp) / "board-plain", replay=False)
        replay = _trainer(model_dir, Path(tmp) / "board-replay", replay=True)
        engine = Engine(model_dir)
        try:
            engine.activate(plain.served_view(), version=0)
            asked = _prompts(model_dir, prompts, prompt_tokens, seed)
            choices = [
                engine.generate(
                    GenerateRequest(
                        prompt_token_ids=p,
                        max_tokens=max_tokens,
                        temperature=temperature,
                        seed=seed + i,
                    )
                )[0]
                for i, p in enumerate(asked)
            ]
        finally:
            engine.close()
        if any(c.routed_experts is None for c in choices):
            raise ValueError(f"{model_dir} is not an MoE model: the engine reports no routing")
        samples = _samples(asked, choices, temperature)
        layers, k = samples[0].routed_experts.shape[1:]  # type: ignore[union-attr]
        plain_forward, replay_forward = _forward(plain, samples), _forward(replay, samples)
        return {
            "model": str(model_dir),
            "served_view": plain.config.served_view,
            "master_dtype": plain.config.master_dtype,
            "moe_layers": int(layers),
            "top_k": int(k),
            "sequences": len(samples),
            "sampled_tokens": sum(sum(s.mask) for s in samples),
            "without_replay": _summary(plain_forward, plain_forward[1]),
            "with_replay": _summary(replay_forward, plain_forward[1]),
            **_overhead(asked, choices, temperature),
        }


def _table(report: dict[str, object]) -> str:
    lines = [
        f"model {report['model']} ({report['moe_layers']} MoE layers, top-{report['top_k']}), "
        f"engine serves {report['served_view']}, trainer {report['master_dtype']}; "
        f"{report['sequences']} sequences, {report['sampled_tokens']} sampled tokens",
        "",
        f"{'':<16} {'mean |Δlogp|':>13} {'max |Δlogp|':>12} {'routing mismatch':>17} "
        f"{'after a flip':>13} {'mean |Δlogp| there':>19}",
    ]
    for name in ("without_replay", "with_replay"):
        m = report[name]
        assert isinstance(m, dict)
        lines.append(
            f"{name:<16} {m['mean_abs_logprob_diff']:>13.2e} {m['max_abs_logprob_diff']:>12.2e} "
            f"{m['routing_mismatch']:>17.3%} {m['tokens_after_a_flip']:>13.2%} "
            f"{m['mean_abs_logprob_diff_after_a_flip']:>19.2e}"
        )
    lines += [
        "",
        f"lane: {report['lane_bytes_per_token']:.2f} B per routed position "
        f"(response without routing: {report['lane_response_bytes_per_token']:.2f} B per "
        f"sampled token); log: +{report['log_bytes_per_token']:.2f} B per sampled token",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="orchestrate bench router-replay", description=__doc__)
    parser.add_argument(
        "--model", type=Path, help="an MoE model directory (default: build tiny-moe, seed 0)"
    )
    parser.add_argument("--prompts", type=int, default=32, help="sequences to sample")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="tokens per prompt (at most)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens sampled per prompt")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    for flag in ("prompts", "prompt_tokens", "max_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be at least 1")
    with quiet_logs(), tempfile.TemporaryDirectory(prefix="sprawl-tiny-moe-") as tmp:
        model = args.model or init_model(Path(tmp) / "tiny-moe", "tiny-moe")
        try:
            report = run(
                model,
                prompts=args.prompts,
                prompt_tokens=args.prompt_tokens,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=args.seed,
            )
        except ValueError as exc:
            parser.error(str(exc))
    sys.stdout.write(json.dumps(report, indent=1) + "\n" if args.json else _table(report))
    return 0
