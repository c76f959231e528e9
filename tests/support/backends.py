"""Scripted engine backends for sidecar and route tests: fixed replies, recorded requests."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from policies.board import Board
from policies.serve.types import Generation, QuiesceMode
from policies.wire.lane import GenerateChoice, GenerateRequest


class ScriptedBackend:
    """A backend that answers every request with fixed text; it records the requests."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, text: str) -> None:
        self.name = "scripted"
        self.max_context = 2048
        self.ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        self.calls: list[GenerateRequest] = []

    async def stage(self, board: Board, version: int) -> None:
        raise AssertionError("a fixed-version sidecar never stages")

    async def activate(self, version: int, mode: QuiesceMode) -> float:
        raise AssertionError("a fixed-version sidecar never activates")

    async def generate(self, req: GenerateRequest) -> Generation:
        self.calls.append(req)
        choice = GenerateChoice(
            index=0, token_ids=self.ids, logprobs=[-0.5] * len(self.ids), finish_reason="stop"
        )
        return Generation([choice], start=7, end=7)

    async def recover(self) -> None:
        return None

    async def aclose(self) -> None:
        return None
