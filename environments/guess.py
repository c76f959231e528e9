"""A multi-turn guessing game: the model guesses a secret integer; feedback comes as user turns.

After each guess the environment answers ``higher``, ``lower`` or ``correct`` as a *user* turn
(no tools). A reply without an integer gets a nudge and does not count as a guess; the game ends
when the guess is right or after ``max_guesses`` wrong guesses. Rewards: ``solved`` (1.0) and
``efficiency`` (0.5): 1 for a first-try hit, falling linearly to 0 at ``max_guesses``.
"""

from __future__ import annotations

import random
import re
from typing import Any

from pydantic import Field

from environments.base import (
    EnvConfig,
    Environment,
    EpisodeState,
    Message,
    ParsedAssistant,
    Reply,
    reward,
)

_INT = re.compile(r"-?\d+")


class GuessConfig(EnvConfig):
    max_number: int = Field(default=100, ge=2)
    """Secrets are drawn from 1..max_number."""
    max_guesses: int = Field(default=7, ge=1)
    """Wrong guesses allowed before the game ends."""


class Guess(Environment):
    Config = GuessConfig
    name = "guess"
    task_columns = ("secret",)
    config: GuessConfig

    def generate_tasks(self) -> list[dict[str, Any]]:
        rng = random.Random(self.config.seed)
        n = self.config.max_number
        return [
            {"id": f"guess-{i}", "secret": rng.randint(1, n)} for i in range(self.config.num_tasks)
        ]

    def initial_messages(self, task: dict[str, Any]) -> list[Message]:
        text = (
            f"I am thinking of an integer from 1 to {self.config.max_number}. Guess it: reply "
            "with one integer. After each guess I answer higher, lower or correct."
        )
        return [{"role": "user", "content": text}]

    async def on_answer(self, state: EpisodeState, reply: ParsedAssistant) -> Reply:
        guesses: list[int] = state.data.setdefault("guesses", [])
        numbers = _INT.findall(reply.content)
        if not numbers:
            return Reply.user(f"Reply with one integer from 1 to {self.config.max_number}.")
        guesses.append(int(numbers[-1]))
        secret = state.task["secret"]
        if guesses[-1] == secret:
            state.final_answer = reply.content
            return Reply.user("correct", done=True)
        if len(guesses) >= self.config.max_guesses:
            return Reply.user(f"Out of guesses; it was {secret}.", done=True)
        return Reply.user("higher" if guesses[-1] < secret else "lower")

    @reward(weight=1.0)
    def solved(self, state: EpisodeState) -> float:
        guesses = state.data.get("guesses", [])
        return float(bool(guesses) and guesses[-1] == state.task["secret"])

    @reward(weight=0.5)
    def efficiency(self, state: EpisodeState) -> float:
        tries = len(state.data.get("guesses", []))
        return self.solved(state) * max(0.0, 1 - (tries - 1) / self.config.max_guesses)
