"""Synthetic episodes, groups and trajectory logs."""

from __future__ import annotations

import random
from pathlib import Path

from orchestrator.record.trajlog import (
    TrajectoryLog,
)
from orchestrator.types import (
    Batch,
    Episode,
    ErrorRecord,
    Group,
    GroupDecision,
    SamplingParams,
    Segment,
    ToolCallRecord,
)
from policies.wire.lane import VersionStamp


def two_token_episode(i: int, reward: float) -> Episode:
    """Episode ``g0-<i>`` of group ``g0``: a 3-token prompt and one model call that sampled two
    tokens at version 0."""
    seg = Segment(
        turn=0,
        prompt_len=3,
        token_ids=[7, 8],
        logprobs=[-0.5, -0.25],
        finish_reason="stop",
        policy_version=VersionStamp(start=0, end=0),
        endpoint="e",
        latency_s=0.1,
        sampling=SamplingParams(temperature=1, top_p=1, top_k=0, max_tokens=4),
    )
    return Episode(
        id=f"g0-{i}",
        group_id="g0",
        task_id="t",
        environment="calc",
        token_ids=[1, 2, 3, 7, 8],
        prompt_len=3,
        segments=[seg],
        reward=reward,
        stop_reason="done",
        admitted_at_version=0,
        started_at=0.0,
        finished_at=1.0,
    )


def make_episode(
    rng: random.Random, gid: str, i: int, version: int, *, vocab: int = 200, turns: int = 2
) -> Episode:
    """A plausible episode: prompt, then per turn sampled tokens and an environment reply."""
    ids = [rng.randrange(vocab) for _ in range(rng.randint(3, 8))]
    prompt_len = len(ids)
    segments = []
    t0 = 1000.0 + rng.random()
    for turn in range(turns):
        start = max(0, version - rng.randint(0, 2))
        sampled = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        segments.append(
            Segment(
                turn=turn,
                prompt_len=len(ids),
                token_ids=sampled,
                logprobs=[-rng.random() * 3 for _ in sampled],
                finish_reason="stop",
                policy_version=VersionStamp(start=start, end=min(version, start + 1)),
                endpoint=f"engine-{rng.randrange(2)}",
                latency_s=rng.random(),
                sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=8),
            )
        )
        ids += sampled + [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
    return Episode(
        id=f"{gid}-e{i}",
        group_id=gid,
        task_id=f"t{gid}",
        environment="calculator",
        token_ids=ids,
        prompt_len=prompt_len,
        segments=segments,
        messages=[
            {"role": "user", "content": "What is 2+3?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": "5"},
            {"role": "assistant", "content": "5"},
        ],
        tool_calls=[ToolCallRecord(name="add", arguments='{"a": 2, "b": 3}', result="5")],
        rewards={"correct": float(i % 2)},
        reward=float(i % 2),
        stop_reason="done" if i % 3 else "max_turns",
        error=ErrorRecord(where="tool", type="ValueError", message="x") if i == 2 else None,
        admitted_at_version=max(0, version - 1),
        started_at=t0,
        finished_at=t0 + 1 + rng.random() * 10,
    )


def make_group(
    rng: random.Random, index: int, version: int, *, size: int = 4, vocab: int = 200
) -> tuple[Group, GroupDecision]:
    gid = f"g{index:06d}"
    eps = [make_episode(rng, gid, i, version, vocab=vocab) for i in range(size)]
    lag = version - min(s.policy_version.start for e in eps for s in e.segments)
    kept = lag <= 1
    decision = GroupDecision(
        group_id=gid,
        decision="kept" if kept else "dropped",
        reason="" if kept else "lag max exceeds staleness.drop.max_lag=1",
        max_lag=lag,
    )
    return Group(id=gid, task_id=f"t{gid}", episodes=eps), decision


def write_synthetic_log(
    directory: Path,
    *,
    seed: int = 0,
    steps: int = 3,
    groups_per_batch: int = 2,
    group_size: int = 4,
    vocab: int = 200,
) -> TrajectoryLog:
    """A closed log of ``steps`` trainer steps, as the run loop writes it (drops included)."""
    rng = random.Random(seed)
    tlog = TrajectoryLog(directory, run="synthetic", config={"seed": seed})
    index = 0
    for version in range(steps):
        kept: list[Group] = []
        decisions: list[GroupDecision] = []
        while len(kept) < groups_per_batch:
            group, decision = make_group(rng, index, version, size=group_size, vocab=vocab)
            index += 1
            tlog.write_group(group, decision, trainer_version=version)
            if decision.decision == "kept":
                kept.append(group)
                decisions.append(decision)
        batch = Batch(trained_at_version=version, groups=kept, decisions=decisions)
        tlog.write_batch(batch, version + 1, {"reward_mean": 0.5, "loss": float("nan")})
    tlog.close()
    return tlog
