"""The episode runner asks each call for the routing of the positions no earlier call routed."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerBase

from environments.calculator import Calculator, CalculatorConfig
from tests.support.fakes import run_scripted

pytestmark = pytest.mark.anyio


async def test_each_call_starts_its_routing_where_the_previous_one_ended(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    env = Calculator(CalculatorConfig(num_tasks=2, seed=3))
    task = env.tasks()[0]
    call = json.dumps({"name": "calculator", "arguments": {"expression": "1+2"}})
    texts = [f"<tool_call>\n{call}\n</tool_call>", "The answer is 3."]
    episode, pool = await run_scripted(env, tokenizer, task, texts)
    first, second = episode.segments
    assert [r.routed_experts_prompt_start for r in pool.requests] == [
        0,
        first.prompt_len + len(first.token_ids) - 1,
    ]
    assert (first.routed_experts_start, second.routed_experts_start) == (
        0,
        first.prompt_len + len(first.token_ids) - 1,
    )
    assert first.routed_experts is None  # the scripted endpoint reports no routing
