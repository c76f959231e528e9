"""The episode runner reads a long model turn off the event loop (issue #42, defect 8): other
episodes, and everything else on the loop, go on while one turn is decoded and parsed."""

from __future__ import annotations

import time
from typing import Any, cast

import anyio
import pytest
from transformers import PreTrainedTokenizerBase

from environments.guess import Guess, GuessConfig
from orchestrator.loop.episode import INLINE_PARSE_TOKENS, EpisodeRunner
from orchestrator.loop.pool import Pool
from orchestrator.types import SamplingParams
from policies.wire.chat_tokens import ChatTokens
from policies.wire.lane import VersionBounds
from policies.wire.tool_parsers import tool_parser
from policies.wire.toolcalls import ParsedAssistant
from tests.support.fakes import ScriptedPool

pytestmark = pytest.mark.anyio
PARSE_S = 0.6


class SlowParser:
    """Hermes, taking ``PARSE_S`` of CPU-bound time per turn (a long turn's parse stands in for
    it: the wall-clock is what the loop would lose), and noting when each parse ran."""

    name = "hermes"
    markers = tool_parser("hermes").markers

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    def parse(self, text: str, **kwargs: Any) -> ParsedAssistant:
        start = time.monotonic()
        while time.monotonic() - start < PARSE_S:  # holds its thread, like a real parse
            pass
        self.spans.append((start, time.monotonic()))
        return tool_parser("hermes").parse(text, **kwargs)

    def prefill(self, function: str | None = None) -> str:
        return tool_parser("hermes").prefill(function)


async def test_a_long_turn_is_parsed_while_the_loop_goes_on(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """(fails when the runner parses inline: no tick lands inside the parse)"""
    long_turn = "word " * (2 * INLINE_PARSE_TOKENS)  # well over the inline limit in tokens
    assert len(tokenizer.encode(long_turn)) > INLINE_PARSE_TOKENS
    parser = SlowParser()
    env = Guess(GuessConfig())
    runner = EpisodeRunner(
        env,
        ChatTokens(tokenizer, env.tool_schemas()),
        parser,
        cast(Pool, ScriptedPool(tokenizer, [long_turn])),
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=4096),
        max_turns=1,
        episode_timeout_s=60,
        max_context=1 << 16,
    )
    ticks: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(time.monotonic())
            await anyio.sleep(0.02)

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        task = {"id": "g", "secret": 37}
        episode = await runner.run(task, "g0", lambda: VersionBounds(min=0), admitted_at=0)
        tg.cancel_scope.cancel()
    assert episode.error is None, episode.error
    ((start, end),) = parser.spans
    inside = [t for t in ticks if start < t < end]
    assert len(inside) >= 3, (len(inside), end - start)  # the loop ticked during the parse


async def test_a_short_turn_is_parsed_inline(tokenizer: PreTrainedTokenizerBase) -> None:
    """No thread for the common case: a short turn costs well under a millisecond."""
    parser = SlowParser()
    env = Guess(GuessConfig())
    runner = EpisodeRunner(
        env,
        ChatTokens(tokenizer, env.tool_schemas()),
        parser,
        cast(Pool, ScriptedPool(tokenizer, ["50"])),
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=64),
        max_turns=1,
        episode_timeout_s=60,
        max_context=2048,
    )
    ticks: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(time.monotonic())
            await anyio.sleep(0.02)

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        await runner.run({"id": "g", "secret": 37}, "g0", lambda: VersionBounds(min=0), 0)
        tg.cancel_scope.cancel()
    ((start, end),) = parser.spans
    assert not [t for t in ticks if start < t < end]  # inline: the loop waited
