"""MoE routing travels from the engine's choices through the trajectory log to the trainer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from orchestrator.loop.train_sink import batch_samples
from orchestrator.record.trajlog import TrajectoryLog, episode_records
from orchestrator.types import Episode, Group, GroupDecision, SamplingParams, Segment
from policies.serve.engine import Engine
from policies.wire.lane import GenerateRequest, VersionStamp
from policies.wire.routing import decode_routing


def test_two_calls_routing_survives_the_log_and_reaches_the_trainer_sample(
    tiny_moe_model_dir: Path, tmp_path: Path
) -> None:
    engine = Engine(tiny_moe_model_dir)
    state = AutoModelForCausalLM.from_pretrained(tiny_moe_model_dir).state_dict()
    engine.activate({k: v.to(torch.bfloat16) for k, v in state.items()}, version=0)
    ids = [5, 9, 11, 40, 7]
    segments, arrays = [], []
    routed = 0
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=5)
    try:
        for turn in range(2):
            req = GenerateRequest(
                prompt_token_ids=ids, max_tokens=5, seed=turn, routed_experts_prompt_start=routed
            )
            (choice,) = engine.generate(req)
            assert choice.routed_experts is not None
            arrays.append(decode_routing(choice.routed_experts))
            segments.append(
                Segment(
                    turn=turn,
                    prompt_len=len(ids),
                    token_ids=choice.token_ids,
                    logprobs=choice.logprobs,
                    finish_reason=choice.finish_reason,
                    policy_version=VersionStamp(start=0, end=0),
                    endpoint="e",
                    latency_s=0.0,
                    sampling=sampling,
                    routed_experts=choice.routed_experts,
                    routed_experts_start=routed,
                )
            )
            ids = [*ids, *choice.token_ids]
            routed = len(ids) - 1
            ids += [12, 13]  # the environment's reply
    finally:
        engine.close()
    episode = Episode(
        id="e0",
        group_id="g0",
        task_id="t",
        environment="calc",
        token_ids=ids,
        prompt_len=5,
        segments=segments,
        stop_reason="done",
        admitted_at_version=0,
        started_at=0.0,
        finished_at=1.0,
    )
    tlog = TrajectoryLog(tmp_path / "log", run="r", config={})
    decision = GroupDecision(group_id="g0", decision="kept", reason="fresh", max_lag=0)
    tlog.write_group(Group(id="g0", task_id="t", episodes=[episode]), decision, trainer_version=0)
    tlog.close()
    (record,) = episode_records(tmp_path / "log")
    assert record.episode == episode

    (sample,) = batch_samples([Group(id="g0", task_id="t", episodes=[record.episode])])
    assert sample.routed_experts is not None
    expected = np.concatenate(arrays)
    # every position up to the last sampled token's predecessor, each once
    assert expected.shape[0] == len(ids) - 2 - 1
    assert np.array_equal(sample.routed_experts.numpy(), expected)
